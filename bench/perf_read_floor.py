"""What one kernel that only streams N bytes from HBM reaches (a script, not a test).

    python3 -m bench.perf_read_floor [--mb 8.4,15,134,419] [--ctas-per-sm 1,2,4,8] [--loads 2,4,8]
    python3 -m bench.perf_read_floor --compile-only     # no GPU: NVRTC-compile every variant

Issue 14 asks the decode linears up to 16 tokens to read their weights at >= 80% of the copy
bandwidth, each kernel timed alone (`dsgraph bench`'s linears: the profiler's own device time of
each kernel, PDL off).  A V2-Lite layer's linears are small: q + kv_a 15 MB, o 8.4 MB (the dense
layer's 134 MB and lm_head's 419 MB once a step).  A kernel pays its launch, the first HBM round
trip and its tail whatever it reads, ~2 us, which at 4.2 TB/s is itself an 8.4 MB read; so before
more work on the linear kernels this measures the ceiling: a kernel that does nothing but read
the same bytes (16-byte loads, `loads` in flight a thread, a grid-stride walk, one word a CTA
written so nothing is optimised away), at several grid sizes, timed the way the bench times the
linears (torch.profiler's kernel duration, the mean over launches) and, beside it, as the
per-launch time of back-to-back launches in a CUDA graph (runtime.timing.graph_us; launch gaps
included).  Each launch reads the next of enough copies of the buffer to exceed ~4x the 50-60 MB L2, as in a decode step,
where each layer's weights are read once.

Prints per size the best variant's us, TB/s and fraction of the measured device-to-device copy
bandwidth (runtime/bench.py's copy_bandwidth, as the bench measures it), then every variant.
PERF_NOTES v20 (Next) says what the numbers decide.
"""
from __future__ import annotations

import argparse
import itertools


from codegen.nvrtc import compile_cubin

KERNEL = "read_floor"
SOURCE = r"""
// Streams n16 16-byte chunks of src; each CTA writes one word (the XOR of what it read) so the
// loads stay.  LOADS chunks in flight a thread per round.
template <int LOADS>
__device__ __forceinline__ void read_floor_body(const uint4* __restrict__ src, long long n16, unsigned* out) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  unsigned acc = 0;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (LOADS - 1) * stride < n16; i += LOADS * stride) {
    uint4 v[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) v[j] = __ldcs(src + i + j * stride);   // streaming: no reuse
#pragma unroll
    for (int j = 0; j < LOADS; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ unsigned warp_acc[32];
  if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned a = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) a ^= warp_acc[w];
    out[blockIdx.x] = a;
  }
}
extern "C" __global__ void __launch_bounds__(256) read_floor_l2(const uint4* src, long long n16, unsigned* out) {
  read_floor_body<2>(src, n16, out);
}
extern "C" __global__ void __launch_bounds__(256) read_floor_l4(const uint4* src, long long n16, unsigned* out) {
  read_floor_body<4>(src, n16, out);
}
extern "C" __global__ void __launch_bounds__(256) read_floor_l8(const uint4* src, long long n16, unsigned* out) {
  read_floor_body<8>(src, n16, out);
}
"""
THREADS = 256
L2_BYTES = 60e6


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v]


def cubin(arch: str) -> bytes:
    return compile_cubin(SOURCE, KERNEL, arch=arch, options=("-lineinfo",)).cubin


def profiled_us(launch, n: int) -> float:
    """Mean kernel duration (us) of n launches, from torch.profiler's key averages (as `dsgraph
    bench` reads its per-family device times)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            launch(i)
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if ev.key.startswith(KERNEL) and us > 0:
            return us / ev.count
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", default="8.4,15,134,419", help="sizes in MB (1e6 bytes) a kernel reads")
    ap.add_argument("--ctas-per-sm", default="1,2,4,8", help="grid = this x the SM count")
    ap.add_argument("--loads", default="2,4,8", help="16-byte loads in flight a thread (2, 4 or 8)")
    ap.add_argument("--launches", type=int, default=40, help="launches timed a variant")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: compile for --arch and stop")
    ap.add_argument("--arch", default="sm_90", help="target of --compile-only")
    args = ap.parse_args()
    if args.compile_only:
        print(f"compiled {KERNEL}: {len(cubin(args.arch))} B cubin for {args.arch}")
        return

    import torch
    from runtime.timing import graph_us
    from runtime.bench import copy_bandwidth
    from runtime.cuda_driver import I64, LoadedModule, device_arch, launch as cu_launch

    mod = LoadedModule.load(cubin(device_arch()), KERNEL)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: {sms} SMs, copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)
    out = torch.empty(64 * sms, dtype=torch.int32, device="cuda")
    rows = []
    for mb in floats(args.mb):
        nbytes = int(mb * 1e6) // 16 * 16
        copies = max(2, int(4 * L2_BYTES // nbytes) + 1)
        bufs = [torch.randint(0, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        best = None
        for loads in ints(args.loads):
            func = mod.function(f"read_floor_l{loads}")
            for per_sm in ints(args.ctas_per_sm):
                grid = per_sm * sms

                def launch(i, func=func, grid=grid):
                    cu_launch(func, (grid, 1, 1), (THREADS, 1, 1), 0, [bufs[i % copies], I64(nbytes // 16), out])

                prof = profiled_us(launch, args.launches)
                taken = itertools.count()   # each captured launch reads the next copy
                per_launch = graph_us(lambda: launch(next(taken)), args.launches)
                row = (mb, loads, per_sm, prof, per_launch)
                rows.append(row)
                if best is None or prof < best[3]:
                    best = row
        del bufs
        mb_, loads, per_sm, prof, per_launch = best
        print(f"{mb:7.1f} MB  best: {prof:7.2f} us own ({nbytes / prof / 1e6:5.2f} TB/s, "
              f"{nbytes / prof / 1e6 / (copy / 1e12):4.0%} of copy), {per_launch:7.2f} us a launch in a graph "
              f"({nbytes / per_launch / 1e6 / (copy / 1e12):4.0%})  [loads {loads}, {per_sm} CTAs/SM]", flush=True)
    print("\nevery variant: MB, loads, CTAs/SM, own us, us a launch in a graph")
    for mb, loads, per_sm, prof, per_launch in rows:
        print(f"  {mb:7.1f} {loads:2d} {per_sm:2d} {prof:8.2f} {per_launch:8.2f}")


if __name__ == "__main__":
    main()
