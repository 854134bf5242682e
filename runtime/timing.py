"""How dsgraph times GPU work, in one place: `dsgraph bench` and the timing tools in bench/ both
measure with these two functions, so their numbers mean the same thing.

- `event_ms`: each call of fn between two CUDA events, after warm-up calls (and, optionally, warm-up
  time: the GPU's clocks settle under load); the median.  Host launch cost is inside the events,
  as it is in a step's wall clock.
- `graph_us`: `iters` calls of fn captured into one CUDA graph and replayed, timed with CUDA events;
  the median of `replays` replays, per call.  No host cost per launch, as the engine's graph replay.
"""
from __future__ import annotations

import time


def event_ms(fn, iters: int, warmup: int = 2, warm_s: float = 0.0) -> float:
    """Median milliseconds of fn() over iters, timed with CUDA events, after `warmup` calls and
    then more until `warm_s` seconds have passed."""
    import torch
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def graph_us(fn, iters: int = 50, replays: int = 3) -> float:
    """Microseconds per call of fn: `iters` calls captured into one CUDA graph (after one eager
    warm-up call and one on the capture stream), one untimed replay, then the median of `replays`
    timed replays divided by iters."""
    import torch
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    times.sort()
    return times[len(times) // 2]
