"""The skinny linear with FP8 weights against the bf16 one at DeepSeek-V2-Lite's decode shapes (a script).

    python3 -m bench.perf_linear_fp8 [--tokens 1,8,16] [--shapes q+kv_a,o,...] [--gemm-tokens 32,512,4096] [--sms 16,64]
                                     [--chunks 128] [--json PATH] [--tune linear.gemm_weights_early=true ...]
                                     [--fp8-variants default,w8r1u4_rolling,w8r1u1_batch,...]
    python3 -m bench.perf_linear_fp8 --compile-only     # no GPU: registers and spills of every kernel

Prediction (written before the first run): FP8 reads half the weight bytes, so on the large shapes
(dense gate_up 2 x 10944 x 2048, dense down, q+kv_a) the FP8 kernel takes ~0.53-0.6 of the bf16 kernel's
time (1.7-1.9x faster) at every T <= 16; on the small ones (kv_a 2.4 MB bf16, o_proj) the launch and the
ramp-up of a ~1 us kernel stay, so less.

FP8 variants: "default" (the lowering's choice for the op) or w<warps>r<row tiles>u<unroll>[k<cluster>] with
a pipeline suffix _rolling / _batch (templates/include/fp8.cuh); each is a Tuning in the compile options
(Options(tuning=...): linear.warps, row_tiles, ksplit, and the FP8 unroll / pipeline knobs of the op,
linear.fp8_* or, for gate_up_silu, linear.fp8_silu_*).  Each launch is timed with runtime.timing.graph_us
over a CUDA graph of at least perf_linear.ITERS launches that cycles through enough copies of the weights to exceed
~4x the L2 (so weights come from HBM, as in a decode step), median of 3 replays.  A row prints us, the
weight bytes read (FP8: bytes plus the float32 block scales), GB/s and % of the measured device-to-device
copy bandwidth (runtime.bench.copy_bandwidth); the fp8/bf16 time ratio.  Correctness alongside: outputs poisoned, norm-wise error against float64 on the dequantised
weights (BAD above 1e-2; exit status 1 if any).  --gemm-tokens: what serves the FP8 node above
linear.skinny_upto tokens -- on sm_90a the FP8 x FP8 GEMM (gemm_fp8: the quantiser launch, then wgmma; its
error against float64 on the bf16 x includes x's own FP8 rounding, ~3% norm-wise, so BAD there is 5%),
elsewhere the library call (dequantise to bf16 each call, then cuBLAS) -- against bf16 cuBLAS on the same
shape, with TFLOP/s; --tune SECTION.KNOB=VALUE (repeatable): the FP8 GEMM's launches also as programmatic
dependent launches (as a model's bundle runs them: the GEMM may start while the quantiser drains), once with
the default knobs and once with these ("fp8 wgmma pdl" rows; the same inputs, so the errors agree); --chunks N:
at the --gemm-tokens values up to N, also the FP8 skinny kernel in 16-token chunks
(Tuning.linear.fp8_chunks_upto = N: x read as 16-bit, no quantiser; BAD above 1e-2 as at T <= 16).  Prediction for
the FP8 GEMM (written before its first run): at T >= 512 the large
shapes at 500-800 TFLOP/s, 1.3-2x bf16 cuBLAS (a wait per 128-K block and the promotion keep it under
DeepGEMM's ~1300); at T = 32 about cuBLAS's time (one row tile: as many CTAs as 128-column tiles).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys

from bench.perf_linear import ptxas_report, time_cycled
from tests.gpu.harness import single_op_graph

import ir
from codegen.families import linear_skinny
from codegen.kernel import KernelLaunch, Options
from codegen.paths import DEFAULT_SPEC
from codegen.tuning import DEFAULT_TUNING, Tuning, TuningError, parse_tune
from ir.formats import FP8, companion_names, scale_shape
from ir.ops import TType

ROTATE_BYTES = 256 << 20
BAD_ERR = 1e-2
_VARIANT_RE = re.compile(r"^w(\d+)r(\d+)u(\d+)(?:k(\d+))?(?:_(rolling|batch))?$")
BF16_VARIANT = "default"
FP8_DEFAULT = "default"
FP8_VARIANTS = "default,w8r1u4_rolling,w8r1u1_batch"



def shapes(m) -> dict:
    """name -> (K, weight rows, silu)."""
    d = m.dims
    D, H, N, R, V, C = (d[k] for k in ("hidden", "heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                       "kv_lora_rank"))
    I, MS = d["intermediate"], d["moe_intermediate"] * d["shared_experts"]
    return {"q": (D, [H * (N + R)], False), "kv_a": (D, [C + R], False), "q+kv_a": (D, [H * (N + R), C + R], False),
            "o": (H * V, [D], False), "dense gate_up": (D, [I, I], True), "dense down": (I, [D], False),
            "shared gate_up": (D, [MS, MS], True), "shared down": (MS, [D], False)}


def parse_variant(v: str) -> Tuning:
    """"default" (the lowering's for the op) or w<warps>r<row tiles>u<unroll>[k<cluster>][_rolling|_batch]
    -> its tuning (the unroll and pipeline set for linear / multi_linear and gate_up_silu alike; no
    pipeline suffix: each op's default); SystemExit (one line) on a bad spelling or value."""
    if v == "default":
        return DEFAULT_TUNING
    mt = _VARIANT_RE.match(v)
    if not mt:
        raise SystemExit(f"variant {v!r} is not default or w<warps>r<row tiles>u<unroll>[k<cluster>][_rolling|_batch]")
    w, r, u, k, pipe = mt.groups()
    knobs = {"warps": int(w), "row_tiles": int(r), "ksplit": int(k or 1), "fp8_unroll": int(u),
             "fp8_silu_unroll": int(u)}
    if pipe:
        knobs.update(fp8_pipeline=pipe, fp8_silu_pipeline=pipe)
    try:
        return dataclasses.replace(DEFAULT_TUNING, linear=dataclasses.replace(DEFAULT_TUNING.linear, **knobs))
    except TuningError as e:
        raise SystemExit(f"variant {v!r}: {e}") from None


def with_chunks(variant: str, upto: int) -> Tuning:
    """`variant`'s tuning with Tuning.linear.fp8_chunks_upto = upto (0: gemm_fp8 from skinny_upto + 1)."""
    base = parse_variant(variant)
    return dataclasses.replace(base, linear=dataclasses.replace(base.linear, fp8_chunks_upto=upto))


def lowered(m, K, rows, silu, variant, fp8, tuning: Tuning | None = None):
    """(the skinny launch, what serves above the skinny range, the outputs) under `variant`'s tuning, or
    `tuning` where given."""
    G, nid = _graph(m, K, rows, silu, fp8)
    # above the skinny range: gemm_fp8 (its 16-token chunks are timed by --chunks, lowered_chunks)
    steps = linear_skinny.lower(nid, G, Options(dtype="bf16", tuning=tuning or with_chunks(variant, 0)))
    (la,) = [s for s in steps if isinstance(s, KernelLaunch) and s.family == linear_skinny.FAMILY]
    above = [s for s in steps if s is not la]   # the library call, or gemm_fp8's launches
    return la, above, G.nodes[nid]["outputs"]


def _graph(m, K, rows, silu, fp8):
    """The shape's node alone in a decode graph, its weights FP8 if `fp8`."""
    x = {"x": TType(("T", K), "act")}
    if silu:
        G, nid = single_op_graph(m, "gate_up_silu", {"out_dim": rows[0]}, x, {"gate": "w0", "up": "w1"}, phase="decode")
    elif len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, x, {"weight": "w0"}, phase="decode")
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": rows}, x,
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))}, phase="decode")
    if fp8:
        for name, info in list(G.graph["weights"].items()):
            G.graph["weights"][name] = dataclasses.replace(info, format=FP8.name)
    return G, nid


def lowered_chunks(m, K, rows, silu, upto: int, variant: str = FP8_DEFAULT) -> tuple[KernelLaunch, KernelLaunch]:
    """(the FP8 skinny launch, its 16-token-chunk launch) of `variant` under Tuning.linear.fp8_chunks_upto = upto."""
    G, nid = _graph(m, K, rows, silu, True)
    opts = Options(dtype="bf16", tuning=with_chunks(variant, upto))
    plain, chunked = [s for s in linear_skinny.lower(nid, G, opts)
                      if isinstance(s, KernelLaunch) and s.family == linear_skinny.FAMILY]
    return plain, chunked


def compile_only(m, names, fp8_variants, chunks: int = 0) -> int:
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    bad = 0
    for name in names:
        K, rows, silu = shapes(m)[name]
        kinds = [(False, BF16_VARIANT), *((True, v) for v in fp8_variants), *([(True, "chunks")] if chunks else [])]
        for fp8, v in kinds:
            la = lowered_chunks(m, K, rows, silu, chunks)[1] if v == "chunks" else lowered(m, K, rows, silu, v, fp8)[0]
            spills, info = ptxas_report(compile_cubin(render_launch(la), la.name,
                                                      options=("--ptxas-options=-v",)).log)
            bad += spills
            print(f"{name:<15} {v:<9} {la.name:<52} {'SPILLS ' if spills else ''}{info}", flush=True)
    return 1 if bad else 0


def quantize(w):
    """w [O, K] float32 -> (q float8_e4m3fn, s float32 per 128 x 128 block): s = amax / 448 (V3's recipe)."""
    import torch
    O, K = w.shape
    sb = scale_shape((O, K), FP8)
    pad = torch.zeros(sb[0] * 128, sb[1] * 128, device=w.device)
    pad[:O, :K] = w
    blocks = pad.view(sb[0], 128, sb[1], 128)
    s = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448
    q = (blocks / s[:, None, :, None]).view(sb[0] * 128, sb[1] * 128)[:O, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), s.float()


def dequant(q, s):
    O, K = q.shape
    return q.double() * s.double().repeat_interleave(128, 0)[:O].repeat_interleave(128, 1)[:, :K]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,16")
    ap.add_argument("--shapes", default="q,kv_a,q+kv_a,o,dense gate_up,dense down,shared gate_up,shared down")
    ap.add_argument("--fp8-variants", default=FP8_VARIANTS)
    ap.add_argument("--gemm-tokens", default="32,512,4096")
    ap.add_argument("--sms", default="",
                    help="gemm_fp8 rows also at these SM counts (the grid and split expressions' SMS: splits = "
                         "min(8, SMS // tiles), so a small count times the unsplit walk), e.g. 16,32,64")
    ap.add_argument("--chunks", type=int, default=0,
                    help="also the FP8 skinny kernel in 16-token chunks at the --gemm-tokens values up to this "
                         "(linear.fp8_chunks_upto: 32, 64, 128 or 256)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--tune", action="append", default=[], metavar="SECTION.KNOB=VALUE",
                    help="the FP8 GEMM rows also as programmatic dependent launches, with the default knobs and "
                         "with these (repeatable), e.g. linear.gemm_weights_early=true")
    args = ap.parse_args()
    try:   # the GEMM from skinny_upto + 1 in both arms, as the other rows (the chunks have --chunks)
        label = " ".join(f.removeprefix("--tune ") for f in parse_tune(args.tune).flags())
        pdl_arms = [("", with_chunks(FP8_DEFAULT, 0)),
                    (f" {label}", parse_tune([*args.tune, "linear.fp8_chunks_upto=0"]))]
    except TuningError as e:
        raise SystemExit(f"--tune: {e}") from None
    pdl_arms = pdl_arms if args.tune else []
    m = ir.load_spec(str(DEFAULT_SPEC)).model
    names = [s for s in args.shapes.split(",") if s]
    fp8_variants = [v for v in args.fp8_variants.split(",") if v]
    for v in fp8_variants:
        parse_variant(v)
    if args.chunks:
        try:
            dataclasses.replace(DEFAULT_TUNING.linear, fp8_chunks_upto=args.chunks)
        except TuningError as e:
            raise SystemExit(f"--chunks: {e}") from None
    if args.compile_only:
        return compile_only(m, names, fp8_variants, args.chunks)

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
    sms_counts = [int(c) for c in args.sms.split(",") if c]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, bad = [], 0

    def report(name, T, what, us, nbytes, err=None, base=None, bad_err=BAD_ERR):
        nonlocal bad
        flag = ""
        if err is not None and not err <= bad_err:
            bad += 1
            flag = "  BAD"
        print(f"{name:<15} T={T:<3} {what:<22} {us:8.2f} us {nbytes / 1e6:8.2f} MB {nbytes / us / 1e3:7.0f} GB/s "
              f"({nbytes / us * 1e6 / bw * 100:3.0f}%)" + (f"  x{base / us:4.2f} vs bf16" if base else "")
              + (f"  err {err:.1e}" if err is not None else "") + flag, flush=True)
        results.append({"shape": name, "T": T, "what": what, "us": us, "bytes": nbytes, "err": err})

    for name in names:
        K, rows, silu = shapes(m)[name]
        bf16_bytes = sum(rows) * K * 2
        fp8_bytes = sum(n * K + 4 * math.prod(scale_shape((n, K), FP8)) for n in rows)
        copies = max(1, min(128, math.ceil(ROTATE_BYTES / fp8_bytes)))
        wf = [[torch.randn(n, K, device="cuda", generator=gen) * K ** -0.5 for n in rows] for _ in range(copies)]
        bf16 = [[w.to(torch.bfloat16) for w in c] for c in wf]
        qs = [[quantize(w) for w in c] for c in wf]
        del wf
        wb = [{f"w{j}": w for j, w in enumerate(c)} for c in bf16]
        w8 = [{k: v for j, (q, s) in enumerate(c) for k, v in ((f"w{j}", q), (companion_names(f"w{j}", FP8)[0], s))}
              for c in qs]
        ref_w = [dequant(q, s) for q, s in qs[0]]
        for T in tokens + fb_tokens:
            x = torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16)
            if silu:
                ref8 = [gate_up_silu_ref(x.double(), ref_w[0], ref_w[1])]
                refb = [gate_up_silu_ref(x.double(), bf16[0][0].double(), bf16[0][1].double())]
            else:
                ref8 = [x.double() @ w.T for w in ref_w]
                refb = [x.double() @ w.double().T for w in bf16[0]]

            def err_of(ys, refs):
                return max(float((y.double() - r).norm() / r.norm()) for y, r in zip(ys, refs))

            def checked(run, ys, refs):
                """run(i) (weight copy i) once on outputs poisoned with NaN: (its error against refs, its time)."""
                for y in ys.values():
                    y.fill_(float("nan"))
                run(0)
                torch.cuda.synchronize()
                return err_of(list(ys.values()), refs), time_cycled(run, copies)

            if T > DEFAULT_TUNING.linear.skinny_upto:   # the FP8 GEMM or the library call serves T
                if silu:
                    base = time_cycled(lambda i: gate_up_silu_ref(x, bf16[i][0], bf16[i][1]), copies)
                else:
                    base = time_cycled(lambda i: [F.linear(x, w) for w in bf16[i]], copies)
                flops = 2 * T * K * sum(rows)
                report(name, T, f"bf16 cuBLAS {flops / base / 1e6:6.0f} TFLOP/s", base, bf16_bytes)
                _, above, outs = lowered(m, K, rows, silu, FP8_DEFAULT, True)
                if isinstance(above[0], KernelLaunch):
                    ys = {o: torch.full((T, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                          for o, n in zip(outs, rows[:1] if silu else rows)}
                    err, us = checked(lambda i: runner.run_all(above, values={"x": x, **ys}, weights=w8[i],
                                                               sizes={"T": T}), ys, ref8)
                    # x in FP8 adds its own rounding (~2-3% norm-wise): BAD only past 5%
                    report(name, T, f"fp8 wgmma {flops / us / 1e6:6.0f} TFLOP/s", us, fp8_bytes, err, base,
                           bad_err=5e-2)
                    for sms in sms_counts:   # the same launches sized for `sms` SMs (fewer splits)
                        sz = {"T": T, "SMS": sms}
                        us = time_cycled(lambda i: runner.run_all(above, values={"x": x, **ys}, weights=w8[i],
                                                                  sizes=sz), copies)
                        report(name, T, f"fp8 wgmma SMS={sms}", us, fp8_bytes, None, base)
                    for label, arm in pdl_arms:   # as a bundle launches them, default knobs and --tune's
                        pdl = [dataclasses.replace(la, pdl=True) for la in lowered(m, K, rows, silu, FP8_DEFAULT,
                                                                                   True, arm)[1]]
                        err, us = checked(lambda i: runner.run_all(pdl, values={"x": x, **ys}, weights=w8[i],
                                                                   sizes={"T": T}), ys, ref8)
                        report(name, T, f"fp8 wgmma pdl{label}", us, fp8_bytes, err, base, bad_err=5e-2)
                    # the skinny kernel, cdiv(T, 16) chunks of tokens along grid.y, in each --fp8-variants shape
                    for v in fp8_variants if T <= args.chunks else ():
                        _, la8 = lowered_chunks(m, K, rows, silu, args.chunks, v)
                        err, us = checked(lambda i: runner.run(la8, values={"x": x, **ys}, weights=w8[i],
                                                               sizes={"T": T}), ys, ref8)
                        report(name, T, f"fp8 chunks x{-(-T // 16)} {v}", us, fp8_bytes, err, base)
                    continue
                (call,) = above
                be = CudaBackend.__new__(CudaBackend)
                fn = CudaBackend._gate_up_silu if silu else CudaBackend._linear
                env = {"x": x}

                def fallback(i):
                    be.weights = w8[i]
                    fn(be, call, env)
                fallback(0)
                err = err_of([env[o] for o in outs], ref8)
                report(name, T, "fp8 fallback", time_cycled(fallback, copies), fp8_bytes, err, base)
                continue
            la, _, outs = lowered(m, K, rows, silu, BF16_VARIANT, False)
            ys = {o: torch.full((T, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                  for o, n in zip(outs, rows[:1] if silu else rows)}
            err, base = checked(lambda i: runner.run(la, values={"x": x, **ys}, weights=wb[i], sizes={"T": T}),
                                ys, refb)
            report(name, T, f"bf16 {BF16_VARIANT}", base, bf16_bytes, err)
            for v in fp8_variants:
                la8, _, _ = lowered(m, K, rows, silu, v, True)
                err, us = checked(lambda i: runner.run(la8, values={"x": x, **ys}, weights=w8[i], sizes={"T": T}),
                                  ys, ref8)
                report(name, T, f"fp8 {v}", us, fp8_bytes, err, base)
        del bf16, qs, wb, w8
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "results": results}, fh, indent=1)
    if bad:
        print(f"\n{bad} launch(es) BAD (norm-wise error above {BAD_ERR})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
