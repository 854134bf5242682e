"""The prefill expert GEMMs with per-channel integer weights: the int8 wgmma grid (Tuning.moe.int_wgmma_above,
templates/include/moe_gemm_int.cuh) against the mma_int kernel it replaces, at DeepSeek-V2-Lite's shapes (a script).

    python3 -m bench.perf_moe_gemm_int [--tokens 4096,16384] [--formats int4_channel,int8_channel] [--json PATH]
    python3 -m bench.perf_moe_gemm_int --compile-only     # no GPU: registers and spills of the wgmma_int kernels

64 experts, top-6, hidden 2048, expert intermediate 1408 (prefill 32 x 512 is T = 16384): moe_gate_up_silu
(x [T, 2048] -> [6T, 1408]) and moe_down ([6T, 1408] -> [6T, 2048]), each as its lowering runs it at T: the
knob off, _moe_int's quantiser then mma_int; on (64), the same quantiser then wgmma_int.  Weights int4 (packed,
every nibble) or int8 over their whole range, routed uniformly at random.  Timed with runtime.timing.graph_us
(the launches in one CUDA graph, median of 3 replays).  A row prints each arm's quantiser + GEMM and GEMM alone
in us and TOP/s (2 x pairs x N x KD, gate_up twice), the GEMMs' speed-up, and whether the two arms' outputs are
bit-equal (they must be: exact int32 sums, the same roundings; exit status 1 if not).

Prediction (docs/notes/intwg.md): wgmma_int at ~650-790 TOP/s at T = 16384 (FP8 x FP8's grid does 706-816 at these
shapes), the experts of a W4A8 prefill 32 x 512 ~130 ms -> 65-80 ms.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.perf_linear import compile_and_report
from tests.gpu.harness import single_op_graph, tiny_model

from codegen import families, sizes
from codegen.kernel import Options
from codegen.tuning import MoeTuning, Tuning
from ir.formats import FORMATS, companion_names, set_format
from ir.ops import TType

E, K, D, M = 64, 6, 2048, 1408
OPS = (("moe_gate_up_silu", D, M), ("moe_down", M, D))   # (op, KD, N)
FMTS = ("int4_channel", "int8_channel")
ON = Tuning(moe=MoeTuning(int_wgmma_above=64))
RMS_Q = {"int4_channel": 4.6, "int8_channel": 74.0}       # a uniform weight's rms: scales keep outputs near 1


def lowered(op: str, KD: int, N: int, fmt: str, tuning: Tuning):
    """(graph, node, launches) of a lone `op` with `fmt` expert weights lowered under `tuning`."""
    r = TType((f"T*{K}", E), "routing")
    if op == "moe_down":
        ins, roles = {"a": TType((f"T*{K}", KD), "act"), "R": r}, {"weight": "e.{expert}.down"}
    else:
        ins, roles = {"x": TType(("T", KD), "act"), "R": r}, {"gate": "e.{expert}.gate", "up": "e.{expert}.up"}
    G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N}, ins, roles)
    for name in G.nodes[nid]["weights"].values():
        set_format(G.graph["weights"], name, FORMATS[fmt])
    return G, nid, families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=tuning))


def at(launches, T: int, sms: int = 132) -> list:
    """The launches with work at T tokens."""
    env = {"T": T, "NP": T * K, "SMS": sms}
    return [la for la in launches if all(sizes.evaluate(g, env) > 0 for g in la.grid)]


def compile_only(fmts) -> int:
    from codegen.arch import kernel_target
    bad = 0
    for op, KD, N in OPS:
        for fmt in fmts:
            for la in at(lowered(op, KD, N, fmt, ON)[2], 16384):
                bad += compile_and_report(la, f"{la.name:<72}", kernel_target("sm_90", la.requires))
    return 1 if bad else 0


def int_weights(names, shape: tuple, fmt: str, gen) -> dict:
    """The stored weights (int4 packed two a byte, or int8, over the whole range) and their channel scales on the
    GPU, by bound name."""
    import torch

    from ir.formats_int import pack_int4
    f = FORMATS[fmt]
    lo, hi = (-8, 7) if f.pack == 2 else (-128, 127)
    out = {}
    for name in names:
        q = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int32).to(torch.int8)
        out[name] = (pack_int4(q) if f.pack == 2 else q).cuda()
        s = (torch.rand(*shape[:2], 1, generator=gen) + 0.5) / (shape[2] ** 0.5 * RMS_Q[fmt] * 4)
        out[companion_names(name, f)[0]] = s.cuda()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--formats", default=",".join(FMTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    fmts = [f for f in args.formats.split(",") if f]
    if args.compile_only:
        return compile_only(fmts)

    import torch

    from ir.ops.moe import align_ref
    from runtime.launcher import KernelRunner
    from runtime.timing import graph_us
    runner, gen = KernelRunner(), torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, formats {', '.join(fmts)}", flush=True)
    results, bad = [], 0
    for (op, KD, N), fmt in ((o, f) for o in OPS for f in fmts):
        down = op == "moe_down"
        G, nid, off = lowered(op, KD, N, fmt, Tuning())
        on = lowered(op, KD, N, fmt, ON)[2]
        weights = int_weights(G.nodes[nid]["weights"].values(), (E, N, KD), fmt, gen)
        out = G.nodes[nid]["outputs"][0]
        for T in [int(t) for t in args.tokens.split(",") if t]:
            ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
            ref = align_ref(ids, E)
            R = {"order": ref["order"].cuda().to(torch.int32), "offsets": ref["offsets"].cuda().to(torch.int32)}
            x = torch.randn(T * K if down else T, KD, generator=gen).to("cuda", torch.bfloat16)
            arms = {"mma_int": at(off, T, sms), "wgmma_int": at(on, T, sms)}
            ys = {a: torch.full((T * K, N), float("nan"), device="cuda", dtype=torch.bfloat16) for a in arms}
            work: dict = {}

            def run(launches, y):   # the workspaces of the first run, reused (none allocated in a capture)
                work.update(runner.run_all(launches, values={"a" if down else "x": x, "R": R, out: y},
                                           weights=weights, sizes={"T": T, "NP": T * K}, workspaces=work))

            for a, launches in arms.items():
                run(launches, ys[a])
            torch.cuda.synchronize()
            same = bool((ys["mma_int"].view(torch.int16) == ys["wgmma_int"].view(torch.int16)).all())
            bad += not same
            flops = 2 * T * K * N * KD * (1 if down else 2)
            row = {"op": op, "format": fmt, "T": T, "flops": flops, "bit_equal": same}
            line = f"{op:<17} {fmt:<13} T={T:<6}"
            for a, launches in arms.items():
                both = graph_us(lambda: run(launches, ys[a]), iters=10)
                gemm = graph_us(lambda: run(launches[1:], ys[a]), iters=10)   # launches[0]: the quantiser
                row.update({f"{a}_us": both, f"{a}_gemm_us": gemm})
                line += f" | {a} {both:9.1f} us (GEMM {gemm:9.1f} us {flops / gemm / 1e6:5.0f} TOP/s)"
            print(f"{line} x{row['mma_int_gemm_us'] / row['wgmma_int_gemm_us']:5.2f}  bit-equal: "
                  f"{'yes' if same else 'NO'}", flush=True)
            results.append(row)
        weights.clear()                                   # this node's weights off the GPU before the next's
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    print(f"\n{bad} row(s) where wgmma_int is NOT bit-equal to mma_int" if bad else "\nevery row bit-equal")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
