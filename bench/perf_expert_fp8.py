"""The grouped expert GEMMs with FP8 weights against the bf16 ones at DeepSeek-V2-Lite's decode shapes (a script).

    python3 -m bench.perf_expert_fp8 [--tokens 1,8,32,128] [--json PATH] [--tune moe.fp8_widen_ahead=true ...]
    python3 -m bench.perf_expert_fp8 --compile-only     # no GPU: registers and spills of every kernel

`--tune SECTION.KNOB=VALUE` (repeatable) lowers the FP8 side with those knobs (the bf16 side keeps the
defaults), e.g. the FP8 decode refinements moe.fp8_one_token_down / moe.fp8_widen_ahead (the bench's routing
has no shared experts, so moe.fp8_shared_before_wait changes nothing here: time it in the step).

64 experts, top-6, hidden 2048, expert intermediate 1408: moe_gate_up_silu (x [T, 2048] -> [6T, 1408])
and moe_down ([6T, 1408] -> [6T, 2048]), each the launch its lowering runs at T (bf16: the decode wgmma
tiles, down's one-token launch at T = 1; FP8: wgmma_skinny_fp8, templates/include/moe_fp8.cuh), routed
uniformly at random (the same routing for both).  Timed with runtime.timing.graph_us over a CUDA graph
cycling two copies of every expert's weights (each copy larger than L2, so touched experts come from
HBM, as in a decode step), median of 3 replays.  A row prints us, the weight bytes the touched experts
hold (FP8: bytes plus the float32 block scales), GB/s, % of the measured device-to-device copy
bandwidth (runtime.bench.copy_bandwidth) and the fp8 / bf16 speed-up; the FP8 row also its norm-wise
error against float64 on the dequantised weights (BAD above 1e-2; exit status 1 if any).

Prediction (written before the first run): the FP8 kernel reads half the weight bytes; at T >= 8,
where bf16 reads at ~80-90% of copy bandwidth, FP8 should take ~0.55-0.65 of the bf16 time if the
widening (4 conversions per 2 weights on the consumer warpgroup) hides under the TMA stream; at T = 1
(6 experts, 22 / 16 column tiles each: ~130 / ~100 tiles, one round) less: a round's latency, not its
bytes, sets the time.  Above ~64 tokens the 32-pair row tile re-reads heavy experts' weights, so the gain
shrinks there.
"""
from __future__ import annotations

import argparse
import json
import sys

from bench.perf_linear import ptxas_report, time_cycled
from tests.gpu.harness import single_op_graph, tiny_model

from codegen import families, sizes
from codegen.kernel import Options
from codegen.tuning import Tuning, parse_tune
from ir.formats import FP8, cdiv, companion_names, set_format
from ir.ops import TType

E, K, D, M = 64, 6, 2048, 1408
OPS = (("moe_gate_up_silu", D, M), ("moe_down", M, D))   # (op, KD, N)
COPIES = 2
BAD_ERR = 1e-2


def graph(op: str, KD: int, N: int, fp8: bool, tuning: Tuning = Tuning()):
    r = TType((f"T*{K}", E), "routing")
    if op == "moe_down":
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"a": TType((f"T*{K}", KD), "act"), "R": r}, {"weight": "e.{expert}.down"},
                                 phase="decode")
    else:
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"x": TType(("T", KD), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"}, phase="decode")
    if fp8:
        for name in G.nodes[nid]["weights"].values():
            set_format(G.graph["weights"], name, FP8)
    return G, nid, families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=tuning))


def compile_only(tuning: Tuning = Tuning()) -> int:
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    bad = 0
    for op, KD, N in OPS:
        for fp8 in (False, True):
            for la in graph(op, KD, N, fp8, tuning if fp8 else Tuning())[2]:
                if "wgmma_skinny" not in la.stage:
                    continue
                spills, info = ptxas_report(compile_cubin(render_launch(la), la.name, arch="sm_90a",
                                                          options=("--ptxas-options=-v",)).log)
                bad += spills
                print(f"{la.name:<70} {'SPILLS ' if spills else ''}{info}", flush=True)
    return 1 if bad else 0


def quantize(w):
    """w [E, O, I] float32 -> (q float8_e4m3fn, s float32 [E, ceil(O / 128), ceil(I / 128)]), s = amax / 448."""
    import torch
    e, o, i = w.shape
    rb, kb = cdiv(o, 128), cdiv(i, 128)
    pad = torch.zeros(e, rb * 128, kb * 128, device=w.device)
    pad[:, :o, :i] = w
    blocks = pad.view(e, rb, 128, kb, 128)
    s = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448
    q = (blocks / s[:, :, None, :, None]).view(e, rb * 128, kb * 128)[:, :o, :i].to(torch.float8_e4m3fn)
    return q.contiguous(), s.float().contiguous()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--tune", action="append", default=[], metavar="SECTION.KNOB=VALUE",
                    help="a knob for the FP8 side's lowering (repeatable)")
    args = ap.parse_args()
    tuning = parse_tune(args.tune)
    if args.compile_only:
        return compile_only(tuning)

    import torch
    import torch.nn.functional as F

    from ir.ops.moe import align_ref
    from runtime.bench import copy_bandwidth
    from runtime.launcher import KernelRunner
    runner = KernelRunner()
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; device-to-device copy {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, bad = [], 0
    for op, KD, N in OPS:
        G, nid, lb = graph(op, KD, N, False)
        _, _, l8 = graph(op, KD, N, True, tuning)
        bound = G.nodes[nid]["weights"]
        wb, w8, deq = [], [], {}
        for c in range(COPIES):
            cb, c8 = {}, {}
            for role, name in bound.items():
                w = torch.randn(E, N, KD, device="cuda", generator=gen) * KD ** -0.5
                cb[name] = w.to(torch.bfloat16)
                q, s = quantize(w)
                c8[name], c8[companion_names(name, FP8)[0]] = q, s
                if c == 0:
                    deq[role] = q.float() * s.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :KD]
                del w
            wb.append(cb)
            w8.append(c8)
        out = G.nodes[nid]["outputs"][0]
        for T in [int(t) for t in args.tokens.split(",") if t]:
            ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(1000 + t))[:K]
                               for t in range(T)])
            ref_r = align_ref(ids, E)
            R = {"order": ref_r["order"].cuda().to(torch.int32), "offsets": ref_r["offsets"].cuda().to(torch.int32)}
            rows = T if op != "moe_down" else T * K
            x = (torch.randn(rows, KD, device="cuda", generator=gen) * (1 if op != "moe_down" else 0.3)).to(torch.bfloat16)
            first = "a" if op == "moe_down" else "x"
            y = torch.full((T * K, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            touched = len(set(ids.flatten().tolist()))
            nmat = len(bound)
            bytes_b = touched * nmat * N * KD * 2
            bytes_8 = touched * nmat * (N * KD + 4 * cdiv(N, 128) * cdiv(KD, 128))
            sz = {"T": T, "NP": T * K}

            def run(launches, weights):
                runner.run_all(launches, values={first: x, "R": R, out: y}, weights=weights, sizes=sz)

            run(l8, w8[0])
            torch.cuda.synchronize()
            # reference on the dequantised weights, float32 on the GPU (pairs by expert)
            ref = torch.zeros(T * K, N, device="cuda")
            order, offs = ref_r["order"].tolist(), ref_r["offsets"].tolist()
            for e in range(E):
                pairs = order[offs[e]:offs[e + 1]]
                if not pairs:
                    continue
                p = torch.tensor(pairs, device="cuda")
                src = x[p] if op == "moe_down" else x[p // K]
                if op == "moe_down":
                    ref[p] = src.float() @ deq["weight"][e].T
                else:
                    g = (src.float() @ deq["gate"][e].T).bfloat16().float()
                    u = (src.float() @ deq["up"][e].T).bfloat16().float()
                    ref[p] = F.silu(g).bfloat16().float() * u
            err = float((y.float() - ref).norm() / ref.norm())
            base = time_cycled(lambda i: run(lb, wb[i % COPIES]), COPIES)
            us8 = time_cycled(lambda i: run(l8, w8[i % COPIES]), COPIES)
            flag = "  BAD" if not err <= BAD_ERR else ""
            bad += bool(flag)
            for what, us, nb in (("bf16", base, bytes_b), ("fp8", us8, bytes_8)):
                print(f"{op:<17} T={T:<4} {what:<5} {us:8.2f} us {nb / 1e6:8.2f} MB {nb / us / 1e3:7.0f} GB/s "
                      f"({nb / us * 1e6 / bw * 100:3.0f}%)" + (f"  x{base / us:4.2f} vs bf16  err {err:.1e}{flag}"
                                                             if what == "fp8" else ""), flush=True)
                results.append({"op": op, "T": T, "what": what, "us": us, "bytes": nb,
                                "err": err if what == "fp8" else None})
        del wb, w8, deq
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "results": results}, fh, indent=1)
    if bad:
        print(f"\n{bad} launch(es) BAD (norm-wise error above {BAD_ERR})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
