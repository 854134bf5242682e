"""Does `dsgraph bench`'s b=1 decode step depend on what ran just before it (a script, not a test)?

    python3 tests/gpu/perf_bench_order.py

The bench times its prefill cases first, then its decode cases, b=1 ctx=512 first of them.  This
times b=1 ctx=512 decode (graph replays, 50 steps, median, as the bench does) before any prefill,
then, for each warm-up time (untimed steps first: bench._timeit's warm_s), right after the bench's
prefill timings (1x2048 and 32x512, graphs and eager) and after five idle seconds; and reads the
SM clock (torch.cuda.clock_rate, via NVML) beside each.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from runtime.bench import _decode_ctx, _prefill_ctx, _release, _timeit, decode_engine  # noqa: E402


def clock() -> str:
    try:
        return f"{torch.cuda.clock_rate()} MHz"
    except Exception as e:  # noqa: BLE001
        return f"clock ? ({type(e).__name__})"


def main() -> int:
    eng = decode_engine([(32, 512)])   # its cache holds the 32 x 512 prefill
    be = eng.backend

    def decode(label, warm_s=0.0):
        sids, step, ids = _decode_ctx(eng, 1, 512)
        ms = _timeit(lambda: be.forward("decode", ids, step), 50, warm_s=warm_s)
        label = f"{label}, warm {warm_s} s"
        _release(eng, sids)
        print(f"decode 1x512 {label:<28} {ms:.3f} ms   {clock()}", flush=True)

    def prefills():
        for batch, length in ((1, 2048), (32, 512)):
            sids, step, ids = _prefill_ctx(eng, batch, length)
            ms = _timeit(lambda: be.forward("prefill", ids, step), 16, warmup=2)
            be.use_graphs = False
            eager = _timeit(lambda: be.forward("prefill", ids, step), 16, warmup=1)
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
