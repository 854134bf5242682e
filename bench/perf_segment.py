"""Why a persistent decode segment is slower than the launches it replaces (issue 53; a script, not a test).

    python3 -m bench.perf_segment [--tokens 1,16] [--ctas 1,2] [--chains o_norm,mlp] [--iters 200]
    python3 -m bench.perf_segment --compile-only     # no GPU: lower, render, NVRTC-compile, ptxas -v

The chains are tests/gpu/test_kernels_persistent.py's, at V2-Lite's widths (tests/gpu/segment_chains.py):
  o_norm  o_proj (skinny linear 2048 -> 2048) + fused_add_rms_norm: the 27 two-member segments of b=1;
  mlp     o_proj, the norm, gate_up_silu (2048 -> 2 x 10944) and down (10944 -> 2048): layer 0's dense MLP.
Each arm runs the chain `iters` times in one CUDA graph, as the engine replays a step (runtime/timing.py's
graph_us: us per chain, median of 3 replays), cycling over `copies` copies of the weights so that they come
from DRAM as in a step (o_norm's 8.4 MB would stay in L2):
  launches   the members' own launches, programmatic dependent launches (PDL) as the engine's;
  single/N   each member as a one-member segment at N CTAs an SM (no counter hand-off inside): single -
             launches is the segment kernel's own cost (its launch bounds, seg::fresh reads of x, the task
             loop and counter reset), hypotheses (a) and (c);
  segment/N  the chain as one segment at N CTAs an SM (Tuning.persistent.ctas_per_sm): segment - single
             is what the counter hand-offs cost against kernel boundaries, hypothesis (b).
Every arm's outputs are checked equal to the launches' before it is timed.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

from codegen.paths import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "gpu"))     # the property test's chain builders
from segment_chains import chain, inputs, outputs, sizes  # noqa: E402

from codegen import segments  # noqa: E402
from codegen.families import segment as segment_family  # noqa: E402

# a chain: (how many of the mlp chain's members, None: all four; the outputs compared)
CHAINS = {"o_norm": (2, ("y", "h", "s")), "mlp": (None, ("y", "h", "s", "g", "z"))}


def singles(members, ctas: int) -> list:
    """Each member as a one-member segment: the segment kernel without a hand-off."""
    return [segment_family.launch([m], [segments.body(m)], [()], lead=0, gate=None, pdl=True, ctas=ctas)
            for m in members]


def arms(name: str, dtype: str, ctas_list) -> dict:
    """{arm: launches} for the chain `name` (first arm: the members' own launches)."""
    out = {}
    for ctas in ctas_list:
        members, seg = chain("mlp", dtype, "lite", ctas, CHAINS[name][0])
        out.setdefault("launches", members)
        out[f"single/{ctas}"] = singles(members, ctas)
        out[f"segment/{ctas}"] = [seg]
    return out


def compile_only(names, dtype, ctas_list, arch) -> int:
    from bench.perf_linear import compile_and_report
    bad, done = 0, set()
    for name in names:
        for arm, launches in arms(name, dtype, ctas_list).items():
            for la in launches:
                if la.name in done:
                    continue
                done.add(la.name)
                bad += compile_and_report(la, f"{name:<7} {arm:<10} {la.name:<42}", arch)
    return 1 if bad else 0


def time_chain(name: str, T: int, a, ctas_list, runner, sms: int) -> dict:
    """{arm: us a chain} for the chain `name` at T tokens; stops where an arm's outputs differ."""
    import torch

    from runtime.timing import graph_us
    values, weights = inputs("mlp", a.dtype, "lite", T, torch.Generator().manual_seed(T))
    copies = [weights] + [{k: w.clone() for k, w in weights.items()} for _ in range(a.copies - 1)]
    at = {**sizes("mlp", "lite", T), "SMS": sms}
    want, row = None, {}
    for arm, launches in arms(name, a.dtype, ctas_list).items():
        outs = outputs("mlp", a.dtype, "lite", T)
        calls = itertools.count()

        def run():
            runner.run_all(launches, values={**values, **outs}, weights=copies[next(calls) % len(copies)], sizes=at)
        run()
        torch.cuda.synchronize()
        got = {k: outs[k].clone() for k in CHAINS[name][1]}
        want = want or got
        if any(not torch.equal(got[k], want[k]) for k in want):
            raise SystemExit(f"{name} T={T}: {arm} differs from the launches")
        row[arm] = graph_us(run, iters=max(a.iters, len(copies)))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--ctas", default="1,2", help="the segments' CTAs an SM (persistent.ctas_per_sm)")
    ap.add_argument("--chains", default="o_norm,mlp")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--copies", type=int, default=8, help="weight copies cycled (1: the weights stay in L2)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    names = [c for c in a.chains.split(",") if c]
    bad = [c for c in names if c not in CHAINS]
    ctas_list = [int(c) for c in a.ctas.split(",") if c]
    if bad or not set(ctas_list) <= {1, 2} or a.copies < 1:
        raise SystemExit(f"chains are {', '.join(CHAINS)}, CTAs an SM 1 or 2, copies >= 1; got {a.chains!r}, "
                         f"{a.ctas!r}, {a.copies}")
    if a.compile_only:
        return compile_only(names, a.dtype, ctas_list, a.arch)

    import torch

    from runtime.launcher import KernelRunner
    runner = KernelRunner()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()} ({sms} SMs), {a.dtype}: us a chain, {a.iters} chains a CUDA graph, "
          f"{a.copies} weight copies")
    for name in names:
        for T in (int(t) for t in a.tokens.split(",")):
            row = time_chain(name, T, a, ctas_list, runner, sms)
            print(f"{name:<7} T={T:<3} " + "  ".join(f"{arm} {us:7.2f}" for arm, us in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
