// Programmatic dependent launch (PDL) on Hopper: lets a kernel start while the one before it in
// the stream drains, so its launch latency and its weight prefetch overlap the previous tail.
//
// The contract every PDL-launched kernel keeps (the launcher sets the launch attribute only on
// kernels whose family declares PDL = True):
//  - every CTA calls pdl_wait() before its first read of anything another kernel writes
//    (activations, step metadata, workspaces, the KV cache) and before its first global write,
//    early-exiting CTAs included; reading weights before it is allowed (no kernel writes them).
//    A CTA that returned without waiting could let this grid complete before its predecessor,
//    and the kernel after it would then see the predecessor's writes unfinished.  And a write
//    before the wait could land in memory the predecessor still uses: the runtime's workspaces
//    come from torch's caching allocator, which hands a block on in stream order, and PDL runs
//    this kernel before its predecessor has finished.
//  - pdl_launch_dependents() may come anywhere after that: it only lets the next kernel's CTAs be
//    scheduled (they still wait for this grid to complete before touching its outputs).
//  - So, as every PDL kernel here waits before it launches its dependents, a kernel may also read
//    before its pdl_wait() what the kernel two launches back wrote: its predecessor let it launch
//    only once that kernel had completed.  Such reads go through L2 (ld.global.cg), never an L1
//    line.  (moe_wgmma_skinny.cuh: DOWN reads the route's offsets behind gate_up_silu, and
//    gate_up_silu gathers x, the route's input, for a shared expert's tile.)
//  - By the same chain, what the step's inputs hold (uploaded before its first kernel, or made by
//    that kernel: a decode graph's context lengths) and the KV-cache rows earlier steps wrote may
//    be read before pdl_wait(); the rows this step writes may not.  (mla_decode.cuh: the decode
//    attention's first tiles, DSG_DECODE_ROWS_BEFORE_WAIT.)
// Both are no-ops when the kernel was launched without the attribute. Raw PTX, not
// cudaGridDependencySynchronize, because NVRTC builds without the device runtime.
// Both carry phases.cuh's marks (nothing unless DSG_PHASES: bench/perf_phases.py).
#pragma once
#include "phases.cuh"

namespace dsg {

__device__ __forceinline__ void pdl_wait() {
  DSG_PHASE(phases::WAIT_CALL);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  DSG_PHASE(phases::WAITED);
}

__device__ __forceinline__ void pdl_launch_dependents() {
  DSG_PHASE(phases::TRIGGER);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// What a kernel may do before pdl_wait(): start weights it will read towards L2 (no kernel writes
// them).  The block's threads share the 128-byte lines of [p, p + bytes), one prefetch per line.
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes) {
  const unsigned long long begin = reinterpret_cast<unsigned long long>(p);
  const unsigned long long first = begin & ~127ull, end = begin + (unsigned long long)bytes;
  for (unsigned long long a = first + 128ull * threadIdx.x; a < end; a += 128ull * blockDim.x)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a));
}

}  // namespace dsg
