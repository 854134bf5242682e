"""The prefill expert GEMMs with FP8 weights x FP8 activations against the bf16 ones at DeepSeek-V2-Lite's
shapes (a script).

    python3 -m bench.perf_moe_gemm_fp8 [--tokens 4096,16384] [--json PATH] [--tune moe.fp8_overlap=false ...]
    python3 -m bench.perf_moe_gemm_fp8 --compile-only     # no GPU: registers and spills of every kernel

64 experts, top-6, hidden 2048, expert intermediate 1408 (issue 49's target: prefill 32 x 512 tokens):
moe_gate_up_silu (x [T, 2048] -> [6T, 1408]) and moe_down ([6T, 1408] -> [6T, 2048]), each as its lowering
runs it above decode's range: bf16, the persistent wgmma grid (moe_wgmma.cuh); FP8, the quantiser's
launch then the FP8 x FP8 grid (moe_gemm_fp8.cuh).  Routed uniformly at random.  Timed with
runtime.timing.graph_us (the launches in one CUDA graph, median of 3 replays; weights stay in L2 or not
as they fall: the GEMMs are compute-bound here).  A row prints us, TFLOP/s of the GEMM alone and of
quantiser + GEMM (2 x pairs x N x KD, gate_up twice), and the FP8 row its norm-wise error against
float64 on the kernel's own quantised rows (BAD above 1e-2; exit status 1 if any).  `--tune
SECTION.KNOB=VALUE` (repeatable) adds an FP8 arm lowered with those knobs, timed on the same inputs and
machine: its GEMM alone against the default's, its error, and whether its output is the default's bit for
bit (A/B of one knob in one call).

Prediction (written before the first run): the FP8 grid does the bf16 grid's tile walk with half the
bytes a K element and twice the tensor-core rate, so its GEMM should run at ~1.6-1.8x the bf16 grid's
TFLOP/s (~950-1100 at T = 16384, where the bf16 grid measured ~590 on the H200: docs/PERF_NOTES.md); the promotion
per 128-K block (64 FMAs a thread) hides under the other consumer warpgroup's wgmma.  Down's quantiser
reads and writes the [6T, 1408] activations once more (~0.2 ms at T = 16384, a fifth of the GEMM):
fusing it into gate_up_silu's epilogue is the next step if it shows.
"""
from __future__ import annotations

import argparse
import json
import sys

from bench.perf_linear import compile_and_report
from tests.gpu.harness import single_op_graph, tiny_model

from codegen import families, sizes
from codegen.kernel import Options
from codegen.tuning import Tuning, parse_tune
from ir.formats import FP8, cdiv, companion_names, set_format
from ir.ops import TType

E, K, D, M = 64, 6, 2048, 1408
OPS = (("moe_gate_up_silu", D, M), ("moe_down", M, D))   # (op, KD, N)
BAD_ERR = 1e-2


def graph(op: str, KD: int, N: int, fp8: bool, tuning: Tuning | None = None):
    r = TType((f"T*{K}", E), "routing")
    if op == "moe_down":
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"a": TType((f"T*{K}", KD), "act"), "R": r}, {"weight": "e.{expert}.down"})
    else:
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"x": TType(("T", KD), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})
    if fp8:
        for name in G.nodes[nid]["weights"].values():
            set_format(G.graph["weights"], name, FP8)
    return G, nid, families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=tuning or Tuning()))


def running(launches, T: int, sms: int):
    env = {"T": T, "NP": T * K, "SMS": sms}
    return [la for la in launches if all(sizes.evaluate(g, env) > 0 for g in la.grid)]


def compile_only(tuning: Tuning) -> int:
    from codegen.arch import kernel_target
    bad = 0
    arms = [(False, None), (True, None)] + ([(True, tuning)] if tuning.changed() else [])
    for op, KD, N in OPS:
        for fp8, tune in arms:
            for la in running(graph(op, KD, N, fp8, tune)[2], 16384, 132):
                bad += compile_and_report(la, f"{la.name:<72}", kernel_target("sm_90", la.requires))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--tune", action="append", default=[], metavar="SECTION.KNOB=VALUE",
                    help="an FP8 arm lowered with these knobs besides the default one (repeatable)")
    args = ap.parse_args()
    tuning = parse_tune(args.tune)
    tuned = " ".join(tuning.flags())
    if args.compile_only:
        return compile_only(tuning)

    import torch

    from ir.act_quant import grouped_linear_fp8
    from ir.ops.moe import align_ref
    from runtime.launcher import KernelRunner
    from runtime.timing import graph_us
    from tests.gpu.test_kernels_moe_fp8 import quantized_experts
    runner = KernelRunner()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs", flush=True)
    gen = torch.Generator().manual_seed(0)
    results, bad = [], 0
    for op, KD, N in OPS:
        G, nid, lb = graph(op, KD, N, False)
        _, _, l8 = graph(op, KD, N, True)
        lt = graph(op, KD, N, True, tuning)[2] if tuning.changed() else None
        bound = G.nodes[nid]["weights"]
        wb, w8, fp8w = {}, {}, {}
        for role, name in bound.items():
            q, s = quantized_experts(E, N, KD, gen, KD ** -0.5)
            w8[name], w8[companion_names(name, FP8)[0]] = q, s
            fp8w[role] = (q, s)
            wb[name] = (q.float() * s.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :KD]).bfloat16()
        out = G.nodes[nid]["outputs"][0]
        down = op == "moe_down"
        for T in [int(t) for t in args.tokens.split(",") if t]:
            ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
            ref_r = align_ref(ids, E)
            R = {"order": ref_r["order"].cuda().to(torch.int32), "offsets": ref_r["offsets"].cuda().to(torch.int32)}
            rows = T * K if down else T
            x = (torch.randn(rows, KD, generator=gen) * (0.3 if down else 1)).to("cuda", torch.bfloat16)
            y = torch.full((T * K, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            sz = {"T": T, "NP": T * K}
            flops = 2 * T * K * N * KD * (1 if down else 2)
            work = {}

            def run(launches, weights):   # the workspaces of the first run, reused (none allocated in a capture)
                work.update(runner.run_all(launches, values={"a" if down else "x": x, "R": R, out: y},
                                           weights=weights, sizes=sz, workspaces=work))

            rb, r8 = running(lb, T, sms), running(l8, T, sms)
            run(r8, w8)
            torch.cuda.synchronize()
            q_ws, s_ws = r8[0].args[2].ref.name, r8[0].args[3].ref.name
            qx = work[q_ws].view(torch.uint8).view(rows, KD).view(torch.float8_e4m3fn)
            pair_rows = torch.arange(T * K, device="cuda") // (1 if down else K)
            experts = ids.reshape(-1).cuda()
            prods = {role: grouped_linear_fp8(qx, work[s_ws], pair_rows, experts, *fp8w[role]) for role in fp8w}
            if down:
                ref = prods["weight"]
            else:
                g, u = prods["gate"].bfloat16().double(), prods["up"].bfloat16().double()
                ref = (g * torch.sigmoid(g)).bfloat16().double() * u
            err = float((y.double() - ref).norm() / ref.norm())
            if lt:                                        # the tuned arm on the same inputs (and quantised rows)
                rt, y0 = running(lt, T, sms), y.clone()
                y.fill_(float("nan"))
                run(rt, w8)
                torch.cuda.synchronize()
                err_t = float((y.double() - ref).norm() / ref.norm())
                same = bool((y.view(torch.int16) == y0.view(torch.int16)).all())
            del prods, ref
            us_b = graph_us(lambda: run(rb, wb), iters=10)
            us_8 = graph_us(lambda: run(r8, w8), iters=10)
            us_g = graph_us(lambda: run(r8[1:], w8), iters=10)
            flag = "  BAD" if not err <= BAD_ERR else ""
            bad += bool(flag)
            print(f"{op:<17} T={T:<6} bf16 {us_b:9.1f} us {flops / us_b / 1e6:6.0f} TFLOP/s | fp8 x fp8 {us_8:9.1f} us "
                  f"{flops / us_8 / 1e6:6.0f} TFLOP/s (GEMM alone {us_g:9.1f} us {flops / us_g / 1e6:6.0f}) "
                  f"x{us_b / us_8:4.2f}  err {err:.1e}{flag}", flush=True)
            results.append({"op": op, "T": T, "bf16_us": us_b, "fp8_us": us_8, "fp8_gemm_us": us_g, "flops": flops,
                            "err": err})
            if lt:
                gemm_t = [la for la in rt if la.stage != r8[0].stage]      # all but the quantiser
                us_t = graph_us(lambda: run(gemm_t, w8), iters=10)
                flag = "  BAD" if not err_t <= BAD_ERR else ""
                bad += bool(flag)
                print(f"{'':<17} {tuned}: GEMM alone {us_t:9.1f} us {flops / us_t / 1e6:6.0f} TFLOP/s "
                      f"x{us_g / us_t:4.2f} of the default's  err {err_t:.1e}  bit-equal to the default: "
                      f"{'yes' if same else 'NO'}{flag}", flush=True)
                results[-1].update({"tuned": tuned, "tuned_gemm_us": us_t, "tuned_err": err_t, "tuned_same": same})
        del wb, w8, fp8w
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, fh, indent=1)
    if bad:
        print(f"\n{bad} launch(es) BAD (norm-wise error above {BAD_ERR})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
