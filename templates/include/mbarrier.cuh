// Hopper's shared-memory transaction barriers (mbarrier, sm_90): the stage handshakes of the
// asynchronous copy rings (bulk.cuh's row copies, tma.cuh's tensor boxes, and cp.async copies that
// report to a barrier).  A barrier counts arrivals and, for bulk / tensor copies, bytes (tx):
// a phase completes when every expected arrival has come and every announced byte has landed.
// Waiters name the phase by its parity.  Inline PTX, no CCCL.
#pragma once
#include "common.cuh"

namespace dsg {
namespace mbar {


// `arrivals` arrivals complete a phase (plus the bytes announced with arrive_expect_tx).
__device__ __forceinline__ void init(unsigned long long* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// Make initialised barriers visible to the async proxy (the copies' complete_tx); a barrier of
// the CTA follows before any use.
__device__ __forceinline__ void init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival of the current phase.
__device__ __forceinline__ void arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// One arrival on the barrier at `bar`'s offset in the shared memory of cluster CTA `rank` (sm_90): a
// consumer that frees a stage its peer's multicast copies write into tells that peer too.  The default
// .release.cta, as CUTLASS's ClusterBarrier::arrive: .release.cluster costs a MEMBAR.ALL.GPU an arrival.
__device__ __forceinline__ void arrive_cluster(unsigned long long* bar, unsigned rank) {
  asm volatile("{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, %0, %1;\n"
               " mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(smem_u32(bar)), "r"(rank) : "memory");
}
// One arrival, announcing `bytes` still to come from bulk / tensor copies in this phase.
__device__ __forceinline__ void arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// One arrival, made by the hardware once every cp.async this thread issued so far has landed
// (.noinc: it counts against the barrier's expected arrivals, so init must include it).
__device__ __forceinline__ void arrive_on_cp_async(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Block until the phase of parity `phase` has completed.  Waiting for parity 1 on a fresh
// barrier (phase 0 in progress) returns at once: a ring's producer starts that way.
__device__ __forceinline__ void wait(unsigned long long* bar, unsigned phase) {
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(phase) : "memory");
  } while (!done);
}
// Whether the phase of parity `phase` has completed, without blocking.
__device__ __forceinline__ bool test(unsigned long long* bar, unsigned phase) {
  unsigned done;
  asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(smem_u32(bar)), "r"(phase) : "memory");
  return done != 0;
}
// Order this thread's generic-proxy accesses of shared memory (plain loads / stores, cp.async
// writes made visible to it by a barrier) with the async proxy's (bulk / tensor copies, wgmma
// operand reads) that follow.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace mbar
}  // namespace dsg
