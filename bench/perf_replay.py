"""Where a decode step's wall clock goes beyond its kernels' own device time (a script, not a test).

    python3 -m bench.perf_replay [--cases 1x512,32x512,128x512] [--top 8] [--profile]

DeepSeek-V2-Lite (random bf16 weights, as `dsgraph bench`), decode steps replayed from their CUDA
graph (PDL on, as the bench runs them).  Per case, milliseconds:
  step     the step as the bench times it (CUDA events around forward: refill, replay, clone; the
           bench's steps sit on the graph's own buffers, as the engine's do, so the refill copies
           nothing: cuda_graphs.DecodeInputs);
  host     forward()'s own host time, the GPU held busy by a spin kernel queued first;
  queued   the same step's GPU time once all of it is queued (no wait for the host);
  replay   one graph replay alone, ten back to back between two events;
  own      the sum of the kernels' own device times (each launched without PDL: bench
           device_breakdown);
  span     first kernel start to last kernel end of one replay, PDL on (profiler trace).
step - queued is host time the GPU waits for; replay - own is what the kernel boundaries cost
inside the graph.  Every case's times are taken before the first profile (the profiler leaves CUPTI
attached, which adds host time to every later launch: PERF_NOTES v17).  The host's part is then
split (refill copies, replay call, logits conversion), each timed with the GPU idle and behind a
spin kernel.  That cost per boundary is then split by (kernel before -> kernel after): for
kernel i, excess_i = (end_i - end_{i-1}) - own_i, i.e. how much later kernel i ends than it would
if it started its own work the moment kernel i-1 ended; summed over boundaries of the same kind
(families), largest first.  Negative excess is overlap that PDL bought.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile


import torch
from torch.profiler import ProfilerActivity, profile

from runtime.bench import _decode_ctx, _release, decode_engine, family_of
from runtime.timing import event_ms

from bench.perf_host import SPIN_CYCLES, host_ms, queued_ms


def kernel_timeline(fn) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel fn() runs, in start order (profiler trace)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    os.unlink(path)
    ks = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
          if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(ks, key=lambda k: k[1])


def print_chain(on, own, layer: int) -> None:
    """Each family's share of the step's chain: kernel i adds end_i - end_{i-1} to the span (the
    increments sum to the span less the first kernel's start), against its own device time (PDL
    off).  Then one layer's kernels, from the `layer`-th decode attention's q linear on: start and
    end after the previous kernel's end, and own time (us)."""
    inc = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for i in range(1, len(on)):
        f = inc[family_of(on[i][0])]
        f[0] += 1
        f[1] += on[i][2] - on[i - 1][2]
        f[2] += own[i]
    print("  chain: family, kernels, us a kernel added to the span / its own us")
    for k, (n, add, o) in sorted(inc.items(), key=lambda kv: -kv[1][1]):
        print(f"    {k:<34}{n:>5} x {add / n:6.2f} / {o / n:6.2f}  = {add / 1e3:.3f} ms")
    att = [i for i, (n, _, _) in enumerate(on) if family_of(n) == "mla_decode_attention"]
    if layer < len(att):
        i0 = max(1, att[layer] - 2)
        i1 = att[layer + 1] - 2 if layer + 1 < len(att) else len(on)
        print(f"  layer {layer}: kernel, start / end after the previous end, own (us)")
        for i in range(i0, i1):
            prev = on[i - 1][2]
            print(f"    {family_of(on[i][0]):<34}{on[i][1] - prev:>8.2f}{on[i][2] - prev:>8.2f}{own[i]:>8.2f}")


def host_split(cap, ids, step) -> dict:
    """Host microseconds of each part of a graph step (cuda_graphs.DecodeGraphs.run), each timed
    alone with the GPU idle at its start, then queued behind a spin kernel: the refill's copies,
    the replay call, the logits' conversion."""
    from runtime import cuda_graphs as cg
    parts = {"refill": lambda: cg._refill(cap.inputs, ids, step), "replay": cap.graph.replay,
             "logits": lambda: cg._logits_of(cap)}
    return {name: (host_ms(fn, 9, 0) * 1e3, host_ms(fn, 9, SPIN_CYCLES // 10) * 1e3) for name, fn in parts.items()}


def profile_host(fn, calls: int = 20, top: int = 14) -> None:
    """cProfile of fn()'s host time, each call queued behind a spin kernel (no wait for the GPU)."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        pr.enable()
        fn()
        pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x512,32x512,128x512")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--layer", type=int, default=12, help="the decode layer whose kernels print_chain lists")
    ap.add_argument("--profile", action="store_true",
                    help="also print cProfile's largest host costs of forward() (20 calls, GPU kept busy)")
    a = ap.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in a.cases.split(",")]
    eng = decode_engine(cases)
    be = eng.backend
    print(f"# {torch.cuda.get_device_name()}, decode graph replays, PDL on (ms)")
    rows = []
    timed = {}
    with torch.inference_mode():
        # Every case is timed before the first profile: once torch's profiler has run, CUPTI stays
        # attached and adds host time to each later launch (a graph's replay call: ~30-50 us before,
        # 130-280 after; PERF_NOTES v17).  So: all the timings, then the kernel timelines.
        for batch, ctx in cases:
            sids, step, ids = _decode_ctx(eng, batch, ctx)
            be.graphs_decode.graphs.clear()

            def f():
                return be.forward("decode", ids, step)
            step_ms = event_ms(f, 21, warmup=3)
            host = host_ms(f)
            queued = statistics.median(queued_ms(f) for _ in range(5))
            (cap,) = be.graphs_decode.graphs.values()
            split = host_split(cap, ids, step)
            if a.profile:
                profile_host(f)

            def replays():
                for _ in range(10):
                    cap.graph.replay()
            replay = statistics.median(queued_ms(replays) for _ in range(3)) / 10
            timed[batch, ctx] = step_ms, host, queued, split, replay
            _release(eng, sids)
        for batch, ctx in cases:
            sids, step, ids = _decode_ctx(eng, batch, ctx)
            step_ms, host, queued, split, replay = timed[batch, ctx]

            def f():
                return be.forward("decode", ids, step)
            graphs = be.graphs_decode.graphs
            graphs.clear()
            on = kernel_timeline(f)
            graphs.clear()
            be.runner.pdl = False
            try:
                off = kernel_timeline(f)
            finally:
                be.runner.pdl = True
                graphs.clear()
            own = [e - s for _, s, e in off]
            if [n for n, _, _ in on] != [n for n, _, _ in off]:
                print(f"{batch}x{ctx}: the PDL-on and PDL-off steps launch different kernels "
                      f"({len(on)} / {len(off)}); no boundary split")
                boundary = {}
            else:
                boundary = collections.defaultdict(lambda: [0, 0.0])
                for i in range(1, len(on)):
                    excess = (on[i][2] - on[i - 1][2]) - own[i]
                    k = f"{family_of(on[i - 1][0])} -> {family_of(on[i][0])}"
                    boundary[k][0] += 1
                    boundary[k][1] += excess
            span = (on[-1][2] - on[0][1]) / 1e3
            rows.append((f"{batch}x{ctx}", step_ms, host, queued, replay, sum(own) / 1e3, span,
                         len(on)))
            print(f"\n{batch}x{ctx}: step {step_ms:.3f}  host {host:.3f}  queued {queued:.3f}  "
                  f"replay {replay:.3f}  own {sum(own) / 1e3:.3f}  span {span:.3f}  kernels {len(on)}", flush=True)
            print("  host of forward's parts, us (median; GPU idle / GPU busy): "
                  + ", ".join(f"{k} {a:.0f} / {b:.0f}" for k, (a, b) in split.items()))
            if boundary:
                print_chain(on, own, a.layer)
                total = sum(v[1] for v in boundary.values())
                print(f"  boundary excess {total / 1e3:.3f} ms over {len(on) - 1} boundaries "
                      f"({total / max(1, len(on) - 1):.2f} us each)")
                for k, (n, us) in sorted(boundary.items(), key=lambda kv: -kv[1][1])[:a.top]:
                    print(f"  {k:<62}{n:>5} x {us / n:6.2f} us = {us / 1e3:.3f} ms")
            _release(eng, sids)
    print(f"\n{'case':<10}{'step':>8}{'host':>8}{'queued':>8}{'replay':>8}{'own':>8}{'span':>8}{'kernels':>9}")
    for r in rows:
        print(f"{r[0]:<10}" + "".join(f"{v:>8.3f}" for v in r[1:7]) + f"{r[7]:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
