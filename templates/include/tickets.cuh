// Atomic tickets: the CTA of a group that finishes last does the group's follow-up work in the
// same launch (the fused route's top-k and alignment, the router GEMM's split-D sum).
//
// A ticket counter lives in a __device__ array of the kernel's own module (zero when the module
// loads); the CTA that takes the last ticket resets it, so the next launch (the next layer, or the
// next replay of a captured CUDA graph) starts from 0 with no memset launch and no host sync.
// Launches of one kernel never overlap (stream order; under PDL every CTA waits for the previous
// grid before it takes a ticket), so one array serves every layer.
#pragma once

namespace dsg {

// A CTA's arrival at a ticket counter, after its global writes; true in the CTA that arrives
// last of `expected`, which also resets the counter.  Every thread calls it; `flag` is an int of
// the CTA's shared memory that carries thread 0's answer to the others.  The grid barrier
// of cooperative groups orders memory the same way: the CTA barrier gathers every thread's
// writes to thread 0, whose fence (cumulative) publishes them before its atomic; in the last
// CTA, thread 0's atomic has seen every other CTA's, its fence and the barrier then order them
// before every thread's loads, which must go past L1 (__ldcg: other SMs wrote the data).
__device__ __forceinline__ bool last_arrival(unsigned int* counter, unsigned int expected, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const bool is_last = atomicAdd(counter, 1u) == expected - 1u;
    if (is_last) {
      atomicExch(counter, 0u);      // no other CTA of this launch touches it again
      __threadfence();
    }
    *flag = is_last;
  }
  __syncthreads();
  return *flag != 0;
}
// The same with the flag in static shared memory (a kernel with no dynamic shared memory to spare).
__device__ __forceinline__ bool last_arrival(unsigned int* counter, unsigned int expected) {
  __shared__ int last;
  return last_arrival(counter, expected, &last);
}

}  // namespace dsg
