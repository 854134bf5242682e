// Hopper's bulk asynchronous copies (sm_90): cp.async.bulk moves one contiguous run of global
// memory into shared memory and reports its bytes to an mbarrier (complete_tx), where the
// consumers wait.  One request per run, where 16-byte cp.async makes one per 16 bytes: the
// swapped expert tiles are L2-throughput-bound (PERF_NOTES v7).  Inline PTX, no CCCL.
#pragma once
#include "common.cuh"

namespace dsg {
namespace bulk {

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// One arrival completes a phase once the bytes announced with it have landed.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// Make the initialised barriers visible to the async proxy (the copies' complete_tx); a barrier
// of the CTA follows before any use.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// The arrival of this phase, announcing `bytes` still to come from bulk copies.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Block until the phase of parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned phase) {
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(phase) : "memory");
  } while (!done);
}
// Order this thread's view of shared memory (reads through the generic proxy, made complete by a
// barrier) before the async proxy's next writes to it: a stage is refilled after it was read.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// bytes (a multiple of 16; dst and src 16-byte aligned) from global src to shared dst, counted
// on bar.
__device__ __forceinline__ void copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

}  // namespace bulk
}  // namespace dsg
