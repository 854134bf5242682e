"""The skinny linear with msModelSlim's int8 weights (W8A8_DYNAMIC) against the bf16 one at DeepSeek-V2-Lite's
decode shapes, and above them the int8 GEMM (gemm_int8) against bf16 cuBLAS and the exact library call (a script).

    python3 -m bench.perf_linear_int8 [--tokens 1,8,16] [--shapes q+kv_a,o,...] [--gemm-tokens 32,512,16384]
                                      [--json PATH]
    python3 -m bench.perf_linear_int8 --compile-only     # no GPU: registers and spills of every kernel
    python3 -m bench.perf_linear_int8 --prologue 4 --tokens 1,4,8   # and the kernel that quantises x itself
    python3 -m bench.perf_linear_int8 --tokens 16 --gemm-tokens 32,64,128 --chunks 128   # and the 16-token chunks

Prediction (written before the first run, no measurement yet): int8 reads half the bf16 weight bytes, so on the
large shapes (dense gate_up 2 x 10944 x 2048, dense down, q+kv_a) the int8 kernel alone takes ~0.55-0.65 of the
bf16 kernel's time at T <= 16, as FP8's did; the quantiser's own launch (one CTA a token, x read twice) adds
~2-3 us with its launch gap, so the node (both launches) gains less, and on the small shapes (kv_a, o) may
lose: the reason to fuse the quantiser into the producing RMSNorm's epilogue.

Prediction for the int8 GEMM (written before its first run, no measurement yet): at 16384 tokens its
wgmma s32.s8.s8 tiles reach ~50-60% of the H100's ~1979 dense int8 TOPS (128 x 128 tiles, two consumer
warpgroups, one stage of wgmmas in flight), so V2-Lite's int8 linears of one prefill 32 x 512 step
(~1.36e13 MACs) take ~25 ms plus ~5 ms of quantiser launches, against ~268 ms through the exact call; at
32 tokens (decode b = 32) a launch has only as many CTAs as 128-row weight tiles (5 .. 171 of 132 SMs), so
the small shapes read their weights at well under the copy bandwidth.

Prediction for --prologue N (Tuning.linear.i8_prologue_upto; written before its first run): at T <= N the one
launch that quantises x in each CTA's prologue takes about the int8 kernel alone plus ~0.5-1 us (x's rows from L2,
two block barriers, the weights' register loads after the prologue instead of before the wait, from L2), so it
saves ~2 us of the "int8 node" pair's ~quantiser launch and boundary on each int8 linear; at T > N nothing moves.

Each row times, over a CUDA graph that cycles through enough weight copies to exceed ~4x the L2
(bench.perf_linear.time_cycled): "bf16" the bf16 kernel; "int8 node" the quantiser and the int8 kernel;
"int8 kernel" the int8 kernel alone on quantised x; "int8 prologue" (--prologue N, T <= N) the launches the
lowering runs at T with that knob: the kernel that quantises x itself, alone; "int8 chunks" (--chunks N, 16 < T <= N,
Tuning.linear.i8_chunks_upto) the quantiser and the int8 kernel in 16-token chunks, "chunks kernel" the chunked
kernel alone on quantised x (where the norm writes x's int8 rows, the chunks' node is that kernel alone).  us, the weight bytes read (int8: bytes plus the float32
per-channel scales), GB/s and % of the measured copy bandwidth, the ratio to bf16.  Correctness alongside:
outputs poisoned, then compared bit for bit with ir/formats_int.py's int_linear computed on the CPU (on the
GPU above 64 tokens; BAD where any output differs; exit status 1).  --gemm-tokens: above linear.skinny_upto,
bf16 cuBLAS, "int8 GEMM" the node's launches on sm_90a (gemm_int8's quantiser and GEMMs) and "int8 exact call"
the library call that serves targets without sm_90a (torch's exact integer product), on the same shape.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from bench.perf_linear import ptxas_report, time_cycled
from bench.perf_linear_fp8 import shapes
from tests.gpu.harness import single_op_graph

import ir
from codegen.arch import kernel_target
from codegen.families import gemm_int8, linear_skinny
from codegen.kernel import KernelLaunch, LibraryCall, Options
from codegen.paths import DEFAULT_SPEC
from codegen.tuning import DEFAULT_TUNING, LinearTuning, Tuning
from ir.formats import FORMATS, companion_names
from ir.ops import TType

ROTATE_BYTES = 256 << 20
I8 = FORMATS["int8_channel"]


def lowered(m, K, rows, silu, int8: bool, arch: str = "sm_90", prologue: int = 0, chunks: int = 0):
    """(the node's kernel launches, its library call (None where kernels serve every T), its outputs) at bf16
    activations for `arch` (sm_89: no int8 GEMM, the exact library call above the skinny range); `prologue`:
    Tuning.linear.i8_prologue_upto; `chunks`: Tuning.linear.i8_chunks_upto."""
    x = {"x": TType(("T", K), "act")}
    if silu:
        G, nid = single_op_graph(m, "gate_up_silu", {"out_dim": rows[0]}, x, {"gate": "w0", "up": "w1"}, phase="decode")
    elif len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, x, {"weight": "w0"}, phase="decode")
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": rows}, x,
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))}, phase="decode")
    if int8:
        for name, info in list(G.graph["weights"].items()):
            G.graph["weights"][name] = dataclasses.replace(info, format=I8.name)
    tuning = Tuning(linear=LinearTuning(i8_prologue_upto=prologue, i8_chunks_upto=chunks))
    steps = linear_skinny.lower(nid, G, Options(dtype="bf16", arch=arch, tuning=tuning))
    launches = [s for s in steps if isinstance(s, KernelLaunch)]
    calls = [s for s in steps if isinstance(s, LibraryCall)]
    return launches, calls[0] if calls else None, G.nodes[nid]["outputs"]


def at_tokens(launches, T: int) -> list:
    """The launches whose grids have work at T (what a step of T tokens runs)."""
    from codegen.sizes import evaluate
    return [la for la in launches if all(evaluate(g, {"T": T, "SMS": 132}) > 0 for g in la.grid)]


def compile_only(m, names, prologue: int = 0, chunks: int = 0) -> int:
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    bad = 0
    for name in names:
        K, rows, silu = shapes(m)[name]
        for int8 in (False, True):
            for la in lowered(m, K, rows, silu, int8, prologue=prologue, chunks=chunks if int8 else 0)[0]:
                res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                                    options=("--ptxas-options=-v",))
                spills, info = ptxas_report(res.log)
                bad += spills
                print(f"{name:<15} {la.name:<52} {'SPILLS ' if spills else ''}{info}", flush=True)
    return 1 if bad else 0


def int8_weights(rows, K, gen):
    """{w_i, w_i_scale, w_i_offset} on the GPU: int8 over the whole range, per-channel scales ~K^-0.5 / 64."""
    import torch
    out = {}
    for j, n in enumerate(rows):
        out[f"w{j}"] = torch.randint(-128, 128, (n, K), device="cuda", generator=gen, dtype=torch.int32).to(torch.int8)
        scale, offset = companion_names(f"w{j}", I8)
        out[scale] = torch.rand((n, 1), device="cuda", generator=gen) * K ** -0.5 / 64 + 1e-4
        out[offset] = torch.zeros((n, 1), device="cuda")
    return out


def reference(x, ws, rows, silu):
    """The node's outputs by ir/formats_int.py (bf16, on the CPU): computed on the CPU up to 64 tokens, on the
    GPU above (its definitions hold on either device: exact integer sums, a true division)."""
    import torch
    from ir.formats_int import int_linear
    dev = "cpu" if x.shape[0] <= 64 else x.device
    ys = [int_linear(x.to(dev), ws[f"w{j}"].to(dev), [ws[c].to(dev) for c in companion_names(f"w{j}", I8)], I8)
          .to(torch.bfloat16).cpu() for j in range(len(rows))]
    if silu:
        g, u = (y.float() for y in ys)
        return None, (g, u)
    return ys, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,16")
    ap.add_argument("--shapes", default="q,kv_a,q+kv_a,o,dense gate_up,dense down,shared gate_up,shared down")
    ap.add_argument("--gemm-tokens", default="32,512,16384")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--prologue", type=int, default=0, metavar="N",
                    help="also time the kernel that quantises x itself at T <= N (Tuning.linear.i8_prologue_upto)")
    ap.add_argument("--chunks", type=int, default=0, metavar="N",
                    help="also time the int8 skinny kernel in 16-token chunks at the --gemm-tokens <= N "
                         "(Tuning.linear.i8_chunks_upto)")
    args = ap.parse_args()
    m = ir.load_spec(str(DEFAULT_SPEC)).model
    names = [s for s in args.shapes.split(",") if s]
    for name in names:
        if name not in shapes(m):
            raise SystemExit(f"unknown shape {name!r} (one of {', '.join(shapes(m))})")
    if args.compile_only:
        return compile_only(m, names, args.prologue, args.chunks)

    import torch
    import torch.nn.functional as F

    from ir.ops.core import gate_up_silu_ref
    from runtime.bench import copy_bandwidth
    from runtime.cuda_backend import CudaBackend
    from runtime.launcher import KernelRunner
    runner = KernelRunner()
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; device-to-device copy {bw / 1e9:.0f} GB/s", flush=True)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    fb_tokens = [int(t) for t in args.gemm_tokens.split(",") if t]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, bad = [], 0

    def report(name, T, what, us, nbytes, ok=None, base=None):
        nonlocal bad
        flag = "" if ok is None or ok else "  BAD (not bit-equal to int_linear)"
        bad += 0 if ok is None or ok else 1
        print(f"{name:<15} T={T:<3} {what:<14} {us:8.2f} us {nbytes / 1e6:8.2f} MB {nbytes / us / 1e3:7.0f} GB/s "
              f"({nbytes / us * 1e6 / bw * 100:3.0f}%)" + (f"  x{base / us:4.2f} vs bf16" if base else "") + flag,
              flush=True)
        results.append({"shape": name, "T": T, "what": what, "us": us, "bytes": nbytes, "exact": ok})

    def exact(ys, x, ws, rows, silu):
        want, gu = reference(x, ws, rows, silu)
        if silu:   # gate and up are exact; silu's expf is not torch's: within one bf16 step
            g, u = gu
            r = (g * torch.sigmoid(g)).to(torch.bfloat16).float() * u
            return bool(((ys[0].float().cpu() - r).abs() <= r.abs() / 64 + 1e-6).all())
        return all(torch.equal(y.cpu(), w) for y, w in zip(ys, want))

    for name in names:
        K, rows, silu = shapes(m)[name]
        bf16_bytes = sum(rows) * K * 2
        int8_bytes = sum(rows) * (K + 4)
        copies = max(1, min(128, -(-ROTATE_BYTES // int8_bytes)))
        w8 = [int8_weights(rows, K, gen) for _ in range(copies)]
        wb = [{f"w{j}": (w[f"w{j}"].float() * w[companion_names(f"w{j}", I8)[0]]).to(torch.bfloat16)
               for j in range(len(rows))} for w in w8]
        for T in tokens + fb_tokens:
            x = torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16)
            if T > DEFAULT_TUNING.linear.skinny_upto:   # the lowering's library call serves T
                if silu:
                    base = time_cycled(lambda i: gate_up_silu_ref(x, wb[i]["w0"], wb[i]["w1"]), copies)
                else:
                    base = time_cycled(lambda i: [F.linear(x, w) for w in wb[i].values()], copies)
                report(name, T, "bf16 cuBLAS", base, bf16_bytes)
                launches, _, outs = lowered(m, K, rows, silu, True)
                gemm = [la for la in launches if la.family == gemm_int8.FAMILY]
                work = {gemm_int8.XQ: torch.zeros((T, gemm_int8.qrow(K) // 4), dtype=torch.int32, device="cuda"),
                        gemm_int8.XS: torch.zeros(T, device="cuda")}
                ys = {o: torch.full((T, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                      for o, n in zip(outs, rows[:1] if silu else rows)}
                if gemm:
                    runner.run_all(gemm, values={"x": x, **ys}, weights=w8[0], sizes={"T": T}, workspaces=work)
                    torch.cuda.synchronize()
                    ok = exact(list(ys.values()), x, w8[0], rows, silu)
                    us = time_cycled(lambda i: runner.run_all(gemm, values={"x": x, **ys}, weights=w8[i],
                                                              sizes={"T": T}, workspaces=work), copies)
                    report(name, T, "int8 GEMM", us, int8_bytes, ok, base)
                del ys, work
                if T <= args.chunks:
                    quant, chunked = at_tokens(lowered(m, K, rows, silu, True, chunks=args.chunks)[0], T)
                    ys = {o: torch.full((T, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                          for o, n in zip(outs, rows[:1] if silu else rows)}
                    work = {"x_int8": torch.zeros((T, quant.params["qrow"] // 4), dtype=torch.int32, device="cuda"),
                            "x_scale": torch.zeros(T, device="cuda")}
                    runner.run_all([quant, chunked], values={"x": x, **ys}, weights=w8[0], sizes={"T": T},
                                   workspaces=work)
                    torch.cuda.synchronize()
                    ok = exact(list(ys.values()), x, w8[0], rows, silu)
                    us = time_cycled(lambda i: runner.run_all([quant, chunked], values={"x": x, **ys},
                                                              weights=w8[i], sizes={"T": T}, workspaces=work), copies)
                    report(name, T, "int8 chunks", us, int8_bytes, ok, base)
                    us = time_cycled(lambda i: runner.run(chunked, values={"x": x, **ys}, weights=w8[i],
                                                          sizes={"T": T}, workspaces=work), copies)
                    report(name, T, "chunks kernel", us, int8_bytes, None, base)
                    del ys, work
                _, call, outs = lowered(m, K, rows, silu, True, arch="sm_89")
                be = CudaBackend.__new__(CudaBackend)
                fn = CudaBackend._gate_up_silu if silu else CudaBackend._linear
                env = {"x": x}

                def fallback(i):
                    be.weights = w8[i]
                    fn(be, call, env)
                fallback(0)
                ok = exact([env[o] for o in outs], x, w8[0], rows, silu)
                report(name, T, "int8 exact call", time_cycled(fallback, copies), int8_bytes, ok, base)
                continue
            (la,), _, outs = lowered(m, K, rows, silu, False)
            ys = {o: torch.full((T, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                  for o, n in zip(outs, rows[:1] if silu else rows)}
            base = time_cycled(lambda i: runner.run(la, values={"x": x, **ys}, weights=wb[i], sizes={"T": T}), copies)
            report(name, T, "bf16", base, bf16_bytes)
            quant, la8 = [la for la in lowered(m, K, rows, silu, True)[0] if la.family == linear_skinny.FAMILY]
            qrow = quant.params["qrow"]
            work = {"x_int8": torch.zeros((T, qrow // 4), dtype=torch.int32, device="cuda"),
                    "x_scale": torch.zeros(T, device="cuda")}
            for y in ys.values():
                y.fill_(float("nan"))
            runner.run_all([quant, la8], values={"x": x, **ys}, weights=w8[0], sizes={"T": T}, workspaces=work)
            torch.cuda.synchronize()
            ok = exact(list(ys.values()), x, w8[0], rows, silu)
            us = time_cycled(lambda i: runner.run_all([quant, la8], values={"x": x, **ys}, weights=w8[i],
                                                      sizes={"T": T}, workspaces=work), copies)
            report(name, T, "int8 node", us, int8_bytes, ok, base)
            us = time_cycled(lambda i: runner.run(la8, values={"x": x, **ys}, weights=w8[i], sizes={"T": T},
                                                  workspaces=work), copies)
            report(name, T, "int8 kernel", us, int8_bytes, None, base)
            if T <= args.prologue:
                (xq,) = at_tokens(lowered(m, K, rows, silu, True, prologue=args.prologue)[0], T)
                for y in ys.values():
                    y.fill_(float("nan"))
                runner.run(xq, values={"x": x, **ys}, weights=w8[0], sizes={"T": T})
                torch.cuda.synchronize()
                ok = exact(list(ys.values()), x, w8[0], rows, silu)
                us = time_cycled(lambda i: runner.run(xq, values={"x": x, **ys}, weights=w8[i], sizes={"T": T}), copies)
                report(name, T, "int8 prologue", us, int8_bytes, ok, base)
        del w8, wb
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "results": results}, fh, indent=1)
    if bad:
        print(f"\n{bad} launch(es) BAD")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
