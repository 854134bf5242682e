"""Host time of an eager step against its GPU time (a script, not a test).

    python3 -m bench.perf_host [--cases prefill1x2048,prefill32x512,decode1,decode32] [--no-pdl]

DeepSeek-V2-Lite (random bf16 weights, as `dsgraph bench`), each step launched eagerly (decode
too: graphs off, as a multi-GPU rank runs it).  Per case, milliseconds:
  step     the step as the bench times it (CUDA events around forward, median of 7);
  host     the Python and driver time of forward() alone, with the GPU held busy by a spin kernel
           queued first, so no launch waits for the GPU (median of 5);
  queued   the GPU time of the same launches once they are all queued (gaps between kernels
           included, none waiting for the host);
and where the host time goes: the runner's launches (its own Python, the driver calls inside
them), buffer allocation, library calls (cuBLAS / torch).  A step is host-bound when host > queued
(PERF_NOTES v11: prefill 1x2048 was, before the launch path kept what a step's sizes decide).
Host time moves between machines by up to 2x for the same tree: compare variants in one process.
"""
from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
import time


import torch

import runtime.cuda_backend as cb
import runtime.cuda_driver as cd
import runtime.launcher as ln
from codegen.kernel import DEFAULTS
from runtime.bench import _decode_ctx, _prefill_ctx, _release
from runtime.timing import event_ms
from runtime.engine import Engine

SPIN_CYCLES = int(5e8)   # ~0.25 s of GPU spin ahead of the timed launches


def _split(acc: collections.Counter, cnt: collections.Counter):
    """Time the parts of a step whose host time is reported; returns the function that restores them."""
    def timed(fn, label):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t0
                cnt[label] += 1
        return wrapper

    patched = [(ln.KernelRunner, "_run", "launches"), (cd, "_launch_once", "of which driver calls"),
               (cb.CudaBackend, "_materialize", "buffers")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, label in patched:
        setattr(owner, name, timed(getattr(owner, name), label))
    library = dict(cb._ALLOCATING)
    for op in ("linear", "multi_linear", "gate_up_silu"):
        cb._ALLOCATING[op] = timed(library[op], "library calls")

    def restore():
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        cb._ALLOCATING.update(library)
    return restore


def host_ms(fn, n: int = 5, spin_cycles: int = SPIN_CYCLES) -> float:
    """Median host milliseconds of fn() over n calls, each after a sync; with spin_cycles > 0 a spin
    kernel is queued first, so no call waits for the GPU (0: the GPU idle at the call)."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def queued_ms(fn) -> float:
    """GPU milliseconds of fn()'s work once it is all queued (behind a spin kernel: no gap waits for
    the host), between two CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SPIN_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="prefill1x2048,prefill32x512,decode1,decode32")
    ap.add_argument("--no-pdl", action="store_true")
    a = ap.parse_args()
    cases = a.cases.split(",")
    tokens = 0
    for c in cases:
        tokens += (math.prod(int(x) for x in c[len("prefill"):].split("x")) if c.startswith("prefill")
                   else int(c[len("decode"):]) * 512)
    eng = Engine.from_spec("model_specs/deepseek_v2_lite.yaml", backend="cuda", device="cuda", dtype="bf16",
                           block_size=DEFAULTS.block_size,
                           num_blocks=math.ceil(tokens / DEFAULTS.block_size) + 8 * len(cases) + 64,
                           max_seq_len=8192, max_num_seqs=256, pdl=not a.no_pdl)
    be = eng.backend
    be.use_graphs = False
    print(f"# {torch.cuda.get_device_name()}, PDL {'off' if a.no_pdl else 'on'}, eager steps (ms)")
    print(f"{'case':<16}{'step':>8}{'host':>8}{'queued':>8}   host split (ms / calls)")
    acc, cnt = collections.Counter(), collections.Counter()
    with torch.inference_mode():
        for c in cases:
            if c.startswith("prefill"):
                b, length = (int(x) for x in c[len("prefill"):].split("x"))
                sids, step, ids = _prefill_ctx(eng, b, length)
                phase = "prefill"
            else:
                sids, step, ids = _decode_ctx(eng, int(c[len("decode"):]), 512)
                phase = "decode"

            def f():
                return be.forward(phase, ids, step)
            ms = event_ms(f, 7, warmup=2)
            host = host_ms(f)
            queued = queued_ms(f)
            acc.clear()
            cnt.clear()
            restore = _split(acc, cnt)
            try:
                torch.cuda._sleep(SPIN_CYCLES)
                f()
                torch.cuda.synchronize()
            finally:
                restore()
            split = ", ".join(f"{k} {v * 1e3:.1f}/{cnt[k]}" for k, v in acc.items())
            print(f"{c:<16}{ms:>8.2f}{host:>8.2f}{queued:>8.2f}   {split}",
                  flush=True)
            _release(eng, sids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
