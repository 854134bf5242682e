"""moe_combine_residual_rms_norm alone: the plain launch (a CTA a token) against the streaming one
(Tuning.moe.combine_stream_above; codegen/families/_combine_stream.py), us and GB/s a launch (a script, not a test).

    python3 -m bench.perf_combine [--tokens 512,4096,16384] [--model v2_lite|v3|w4a8] [--rows fp8|int8|none]
    python3 -m bench.perf_combine --compile-only     # no GPU: NVRTC-compile both launches for sm_90a

A token reads its K pair rows of eo (the shared experts' among them where S > 0), the shared row (S == 0) and the
residual, and writes s, h and the quantised rows.  Each launch reads the next of enough copies of the inputs to
exceed ~4x the 50 MB L2, as a prefill's layers do; times are the per-launch time of back-to-back launches in a
CUDA graph (runtime.timing.graph_us).  Before timing, both launches run on the same inputs and their outputs are
compared bit for bit.
"""
from __future__ import annotations

import argparse
import itertools

MODELS = {"v2_lite": (2048, 8, 2), "v3": (7168, 9, 1), "w4a8": (7168, 8, 0)}   # D, K, S of the prefill combine
L2_BYTES = 50e6
TYPES = {"act": ("bfloat16", 2), "f32": ("float32", 4), "i32": ("int32", 4)}   # value dtype: torch dtype, bytes
OP = "moe_combine_residual_rms_norm"


def launches(model: str, rows: str | None, arch: str = "sm_90a"):
    """(plain, streamed) launches of the model's combine + norm, writing `rows`."""
    import pytest
    from codegen.families import _norm_quant, family_for_op
    from codegen.kernel import Options
    from codegen.tuning import LinearTuning, MoeTuning, Tuning
    from ir.ops import TType
    from ir.passes.norm_rows import give_rows
    from bench.perf_decode import lite
    from tests.gpu.harness import single_op_graph

    D, K, S = MODELS[model]
    types = {"eo": TType((f"T*{K}", D), "act"), "w": TType(("T", K), "f32"),
             **({} if S else {"shared": TType(("T", D), "act")}), "residual": TType(("T", D), "act")}
    G, nid = single_op_graph(lite(), OP, {"shared_experts": S} if S else {}, types, {"weight": "nw"})
    if rows:
        nid = give_rows(G, nid, rows)
    out = []
    for above in (None, 0):
        t = Tuning(moe=MoeTuning(combine_stream_above=above),
                   linear=LinearTuning(norm_int8=rows == "int8", norm_fp8=rows == "fp8"))
        with pytest.MonkeyPatch.context() as mp:   # no reader here: the rows an FP8 x FP8 reader from T = 1 gets
            mp.setattr(_norm_quant, "fp8_from", lambda G_, nid_, opts_: 1)
            (la,) = family_for_op(OP).lower(nid, G, Options(arch=arch, tuning=t))
        out.append(la)
    return G, nid, types, out


def token_bytes(G, nid, types, T: int) -> int:
    """Bytes a launch moves at T tokens: its inputs read once, its outputs written once, the norm weight."""
    from codegen import sizes
    total = 0
    for name in (*types, *G.nodes[nid]["outputs"]):
        t = G.graph["values"][name] if name in G.graph["values"] else types[name]
        n = 1
        for d in t.shape:
            n *= sizes.evaluate(d, {"T": T})
        total += n * TYPES[t.dtype][1]
    return total + G.graph["values"][G.nodes[nid]["outputs"][0]].shape[-1] * 2   # + the norm weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,4096,16384")
    ap.add_argument("--model", default="v2_lite", choices=sorted(MODELS))
    ap.add_argument("--rows", default="fp8", choices=("fp8", "int8", "none"))
    ap.add_argument("--iters", type=int, default=20, help="launches captured in the timed graph")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    rows = None if args.rows == "none" else args.rows
    G, nid, types, (plain, stream) = launches(args.model, rows)
    if args.compile_only:
        from codegen.nvrtc import compile_cubin
        from codegen.render import render_launch
        for la in (plain, stream):
            res = compile_cubin(render_launch(la), la.name, arch="sm_90a", options=("--ptxas-options=-v",))
            print(la.name, *[ln.strip() for ln in res.log.splitlines() if "registers" in ln or "spill" in ln],
                  sep="\n  ")
        return

    import torch
    from runtime.bench import copy_bandwidth
    from runtime.launcher import KernelRunner
    from codegen import sizes
    from runtime.timing import graph_us

    runner = KernelRunner()
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {copy / 1e12:.2f} TB/s; {args.model} {plain.name}",
          flush=True)
    D, K, S = MODELS[args.model]
    nw = (torch.rand(D, device="cuda") + 0.5).to(torch.bfloat16)
    for T in (int(t) for t in args.tokens.split(",") if t):
        nbytes = token_bytes(G, nid, types, T)
        copies = max(2, int(4 * L2_BYTES // nbytes) + 1)

        def values():
            v = {"eo": torch.randn(T * K, D, device="cuda").to(torch.bfloat16),
                 "w": torch.rand(T, K, device="cuda") * (2.0 / K), "residual": torch.randn(T, D, device="cuda")
                 .to(torch.bfloat16)}
            if not S:
                v["shared"] = torch.randn(T, D, device="cuda").to(torch.bfloat16)
            for o in G.nodes[nid]["outputs"]:
                t = G.graph["values"][o]
                shape = [sizes.evaluate(d, {"T": T}) for d in t.shape]
                v[o] = torch.zeros(shape, device="cuda", dtype=getattr(torch, TYPES[t.dtype][0]))
            return v

        sets = [values() for _ in range(copies)]
        kw = [dict(values=s, weights={"nw": nw}, sizes={"T": T, "NP": T * K}) for s in sets]
        outs = []
        for la in (plain, stream):
            runner.run(la, **kw[0])
            torch.cuda.synchronize()
            outs.append({o: sets[0][o].clone() for o in G.nodes[nid]["outputs"]})
        same = all(torch.equal(outs[0][o], outs[1][o]) for o in outs[0])
        us = []
        for la in (plain, stream):
            taken = itertools.count()
            us.append(graph_us(lambda la=la: runner.run(la, **kw[next(taken) % copies]), args.iters))
        del sets, kw
        print(f"T={T:6d}  {nbytes / 1e6:7.1f} MB   plain {us[0]:8.1f} us {nbytes / us[0] / 1e3:6.0f} GB/s "
              f"({nbytes / us[0] / 1e6 / (copy / 1e12):4.0%} of copy)   streamed {us[1]:8.1f} us "
              f"{nbytes / us[1] / 1e3:6.0f} GB/s ({nbytes / us[1] / 1e6 / (copy / 1e12):4.0%})   "
              f"x{us[0] / us[1]:.2f}   bit-equal: {same}", flush=True)


if __name__ == "__main__":
    main()
