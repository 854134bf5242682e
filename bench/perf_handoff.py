"""What a kernel boundary costs when the next kernel takes its input on a flag instead of at its
PDL wait (a script, not a test).

    python3 -m bench.perf_handoff [--ctas 1,8,64,132] [--work-cycles 0,4000] [--links 200]

A chain of `links` launches of one kernel, every one a programmatic dependent launch, captured in
one CUDA graph.  Link i reads what link i - 1 wrote (one int a CTA), spins `work` SM cycles, and
writes its own.  Three ways to hand the data over:
  wait  griddepcontrol.wait first (the whole previous grid complete and flushed), then read,
        work, write: every generated kernel's way today (pdl.cuh);
  flag  launch_dependents first, then spin (acquire, at GPU scope) until link i - 1's CTAs have
        all arrived on a counter, read, work; griddepcontrol.wait only before the write (pdl.cuh:
        no write before the wait), then write and arrive (release).  The counter is zeroed once
        per replay; link i waits for it to reach i * CTAs;
  flag-only  the same without the PDL wait at all (the hand-off's floor: the benchmark's writes
        are safe without it, a step's are not, see pdl.cuh).
Per link: the replay's time over `links`; `flag` - `wait` is what the hand-off saves a boundary
(issue 14: PERF_NOTES v29 measured each decode boundary's share of b=1's step).
"""
from __future__ import annotations

import argparse
import sys

import torch

from codegen.nvrtc import compile_cubin
from runtime.cuda_driver import I32, I64, LoadedModule, launch

SRC = r"""
__device__ __forceinline__ void spin_cycles(long long n) {
  const long long t0 = clock64();
  while (clock64() - t0 < n) {}
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
extern "C" __global__ void link(const int* __restrict__ prev, int* __restrict__ next, unsigned* counter,
                                int i, unsigned work, int flag, int* bad) {
  if (flag) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) {
      const unsigned want = (unsigned)i * gridDim.x;
      while (ld_acquire(counter) < want) __nanosleep(32);
    }
    __syncthreads();
  } else {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  int v = 0;
  if (threadIdx.x == 0) v = __ldcg(prev + (blockIdx.x + 1) % gridDim.x);
  if (work) spin_cycles(work);
  if (flag == 1) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) {
    if (i > 0 && v != i) atomicAdd(bad, 1);
    next[blockIdx.x] = i + 1;
    if (flag) {
      __threadfence();
      atomicAdd(counter, 1u);
    }
  }
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctas", default="1,8,64,132")
    ap.add_argument("--work-cycles", default="0,4000", help="SM cycles of work a link (~2 a ns on an H200)")
    ap.add_argument("--links", type=int, default=200)
    a = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    cubin = compile_cubin(SRC, "link", arch=f"sm_{major}{minor}", headers={}).cubin
    func = LoadedModule.load(cubin, "handoff").function("link")
    n = a.links
    bufs = [torch.zeros(132 * 4, dtype=torch.int32, device="cuda") for _ in range(2)]
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    print(f"# {torch.cuda.get_device_name()}: {n} links a graph, us a link (median of 5 replays of 10)")
    print(f"{'CTAs':>5} {'cycles':>8} {'wait':>8} {'flag':>8} {'saved':>8} {'flag-only':>10}")
    for ctas in (int(c) for c in a.ctas.split(",")):
        for work in (int(w) for w in a.work_cycles.split(",")):
            row = {}
            for flag in (0, 1, 2):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    for b in bufs:
                        b.zero_()
                    with torch.cuda.graph(g, stream=stream):
                        counter.zero_()
                        for i in range(n):
                            launch(func, (ctas, 1, 1), (128, 1, 1), 0,
                                   [I64(bufs[i % 2].data_ptr()), I64(bufs[(i + 1) % 2].data_ptr()),
                                    I64(counter.data_ptr()), I32(i), I32(work), I32(flag), I64(bad.data_ptr())],
                                   stream, pdl=True)
                torch.cuda.synchronize()
                times = []
                for _ in range(6):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(10):
                        g.replay()   # on the current stream, as the events
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e) * 1e3 / 10 / n)
                row[flag] = sorted(times[1:])[2]
            print(f"{ctas:>5} {work:>8} {row[0]:>8.2f} {row[1]:>8.2f} {row[0] - row[1]:>8.2f} {row[2]:>10.2f}",
                  flush=True)
    print(f"wrong reads: {int(bad.item())} (the chain's data must pass link to link)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
