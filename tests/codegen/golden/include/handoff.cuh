// The route's hand-off to the expert kernels on a flag instead of at their PDL wait (issue 14,
// PERF_NOTES v30).  DSG_ROUTE_HANDOFF 0 (the default): nothing here is used, the expert kernels
// take the routing after their pdl_wait() as every kernel does.  1: at one token the route's
// completion reaching gate_up_silu's wait is a boundary on b=1's critical path; instead
//  - the fused route's first CTA, right after its own wait and before any CTA of it lets the
//    expert kernel launch, marks the routing's total, offsets[E], unwritten (-1: a total is never
//    negative), its fence completing before its trigger (route_invalidate);
//  - the aligning CTA writes order and every other offset, then, behind a barrier and a fence, the
//    total last, with release semantics (route_publish);
//  - gate_up_silu's thread 0 spins on the total (acquire, GPU scope) until it is a total, and only
//    then reads the routing, through L2 (route_await; the routing's earlier values may still sit in
//    an L1 line or the read-only cache from the previous layer); it calls pdl_wait() before its
//    first write, as pdl.cuh asks (a workspace the kernel before may still use), which at one
//    token comes after ~20 us of weight streaming, and lets down launch right after the flag;
//  - down, which reads the routing before its wait, awaits the same flag first: gate_up_silu no
//    longer waits for the route before it triggers (pdl.cuh's two-launches-back rule).
// The route's other path (three launches, above the fused route's tokens) never writes the flag:
// the skinny expert launches run only where the fused route does (both up to 256 tokens;
// tests/codegen/test_sass_route_handoff.py holds the lowering to it).  Off by default, built for the
// H200 to measure (PERF_NOTES v30); `sub` this line to 1 in a perf_ab arm.
#pragma once
#include "common.cuh"
#include "pdl.cuh"
#include "tickets.cuh"

#ifndef DSG_ROUTE_HANDOFF
#define DSG_ROUTE_HANDOFF 0
#endif

namespace dsg {
namespace handoff {

constexpr bool ROUTE = DSG_ROUTE_HANDOFF != 0;

__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// The route's first CTA, every thread, after its pdl_wait() and before its pdl_launch_dependents():
// the total unwritten, and visible at L2 before this CTA triggers.
__device__ __forceinline__ void route_invalidate(int* total) {
  if (threadIdx.x == 0) {
    *total = -1;
    __threadfence();
  }
  __syncthreads();
}

// The aligning CTA, every thread, once its order and offsets (but the total) are written.
__device__ __forceinline__ void route_publish(int* total, int value) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    st_release(total, value);
  }
}

// A read of the routing (order, offsets) by a kernel the route hands over to: through L2 with the
// hand-off (the route wrote it while this kernel ran: neither an L1 line nor the read-only cache may
// answer), the plain load otherwise.
__device__ __forceinline__ int routing(const i32* __restrict__ p, int i) {
  if constexpr (ROUTE) return __ldcg(p + i);
  else return p[i];
}

// Thread 0 of a consumer CTA spins until the total is written; the caller's barrier (a __syncwarp
// for warp 0, a __syncthreads for the CTA) then orders the other threads' reads after it.  A total
// that never comes (no route published one: a bug, not a case) ends the spin after ~1 ms in the PDL
// wait, which returns once the route's grid has ended: late, never a hang.
constexpr long long AWAIT_CYCLES = 2000000;
__device__ __forceinline__ void route_await(const int* total) {
  if (threadIdx.x != 0) return;
  const long long t0 = clock64();
  while ((int)ld_acquire_gpu(reinterpret_cast<const unsigned*>(total)) < 0) {
    if (clock64() - t0 > AWAIT_CYCLES) {
      pdl_wait();
      return;
    }
    __nanosleep(20);
  }
}

}  // namespace handoff
}  // namespace dsg
