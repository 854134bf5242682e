"""Does `dsgraph bench`'s b=1 decode step depend on what ran just before it (a script, not a test)?

    python3 -m bench.perf_bench_order

The bench times its prefill cases first, then its decode cases, b=1 ctx=512 first of them.  This
times b=1 ctx=512 decode (graph replays, 50 steps, median, as the bench does) before any prefill,
then, for each warm-up time (untimed steps first: runtime.timing.event_ms's warm_s), right after the bench's
prefill timings (1x2048 and 32x512, graphs and eager) and after five idle seconds; and reads the
SM clock (torch.cuda.clock_rate, via NVML) beside each.

    python3 -m bench.perf_bench_order --per-step 300

times 300 consecutive b=1 ctx=512 steps one by one (CUDA events around each, as the bench) and
reads NVML's SM clock, memory clock and power after each: are the ~4% levels b=1's steps drift
between (PERF_NOTES v26) the clocks, or something the clocks do not show?  It prints the steps by
SM clock, blocks of ten steps in order (median ms and clock), and the correlation of a step's time
with its clock.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from runtime.bench import _decode_ctx, _prefill_ctx, _release, decode_engine
from runtime.timing import event_ms


def clock() -> str:
    try:
        return f"{torch.cuda.clock_rate()} MHz"
    except Exception as e:  # noqa: BLE001
        return f"clock ? ({type(e).__name__})"


class Nvml:
    """SM clock, memory clock (MHz) and power (W) of this process's GPU, or None where NVML is not there."""

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            index = torch.cuda._get_nvml_device_index(torch.cuda.current_device())
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:  # noqa: BLE001 - the step times stand without it
            print(f"# no NVML readings ({type(e).__name__}: {e})")
            self.nv = None

    def read(self) -> tuple | None:
        if self.nv is None:
            return None
        nv, h = self.nv, self.h
        return (nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                nv.nvmlDeviceGetPowerUsage(h) / 1e3)


def per_step(eng, n: int) -> None:
    import statistics
    be, nvml = eng.backend, Nvml()
    sids, step, ids = _decode_ctx(eng, 1, 512)
    for _ in range(3):
        be.forward("decode", ids, step)
    torch.cuda.synchronize()
    rows = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        be.forward("decode", ids, step)
        b.record()
        b.synchronize()
        rows.append((a.elapsed_time(b), nvml.read()))
    _release(eng, sids)
    ms = [r[0] for r in rows]
    print(f"# {n} steps of decode 1x512, one by one: median {statistics.median(ms):.3f} ms, "
          f"min {min(ms):.3f}, max {max(ms):.3f}")
    print("# blocks of 10 steps in order: median ms, median SM / memory clock (MHz), power (W)")
    for i in range(0, n - 9, 10):
        blk = rows[i:i + 10]
        med = statistics.median(r[0] for r in blk)
        clk = [r[1] for r in blk if r[1]]
        c = (f"{statistics.median(x[0] for x in clk):.0f} / {statistics.median(x[1] for x in clk):.0f} MHz, "
             f"{statistics.median(x[2] for x in clk):.0f} W") if clk else "-"
        print(f"  steps {i:>4}-{i + 9:<4} {med:.3f} ms   {c}")
    have = [(r[0], r[1][0]) for r in rows if r[1]]
    if len(have) > 2 and len({c for _, c in have}) > 1:
        print("# by SM clock: MHz, steps, median ms")
        for c in sorted({c for _, c in have}):
            got = [m for m, cc in have if cc == c]
            print(f"  {c:>5} {len(got):>5} {statistics.median(got):.3f}")
        print(f"# correlation of step time with SM clock: {statistics.correlation(*zip(*have)):+.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-step", type=int, default=0, metavar="N",
                    help="time N consecutive b=1 ctx=512 steps one by one with the clocks instead")
    a = ap.parse_args()
    eng = decode_engine([(32, 512)])   # its cache holds the 32 x 512 prefill
    if a.per_step:
        with torch.inference_mode():
            per_step(eng, a.per_step)
        return 0
    be = eng.backend

    def decode(label, warm_s=0.0):
        sids, step, ids = _decode_ctx(eng, 1, 512)
        ms = event_ms(lambda: be.forward("decode", ids, step), 50, warm_s=warm_s)
        label = f"{label}, warm {warm_s} s"
        _release(eng, sids)
        print(f"decode 1x512 {label:<28} {ms:.3f} ms   {clock()}", flush=True)

    def prefills():
        for batch, length in ((1, 2048), (32, 512)):
            sids, step, ids = _prefill_ctx(eng, batch, length)
            ms = event_ms(lambda: be.forward("prefill", ids, step), 16, warmup=2)
            be.use_graphs = False
            eager = event_ms(lambda: be.forward("prefill", ids, step), 16, warmup=1)
            be.use_graphs = True
            _release(eng, sids)
            print(f"prefill {batch}x{length}: {ms:.1f} ms (eager {eager:.1f})   {clock()}", flush=True)

    with torch.inference_mode():
        decode("first")
        decode("again")
        for warm in (0.0, 0.5):
            prefills()
            decode("right after the prefills", warm)
            decode("again", warm)
            time.sleep(5)
            decode("after 5 s idle", warm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
