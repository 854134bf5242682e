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

// One thread's ticket for its group of threads (a CTA, or the threads of a named barrier): true
// in the group that arrives last of `expected`, which also resets the counter.  The caller's
// barrier before it gathers the group's global writes to this thread; its barrier after it carries
// the answer to the group and orders every earlier arrival's writes before the group's loads.
__device__ __forceinline__ bool take_ticket(unsigned int* counter, unsigned int expected) {
  // release: the group's writes (gathered by the barrier) before the add; acquire: every earlier
  // arrival's (the adds form one release sequence) before what the last group reads.
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  const bool is_last = old == expected - 1u;
  // The next launch to take a ticket runs after this grid has completed (stream order).
  if (is_last) asm volatile("st.relaxed.gpu.global.u32 [%0], 0;\n" ::"l"(counter) : "memory");
  return is_last;
}

// A CTA's arrival at a ticket counter, after its global writes; true in the CTA that arrives
// last of `expected`, which also resets the counter.  Every thread calls it; `flag` is an int of
// the CTA's shared memory that carries thread 0's answer to the others.  The CTA barrier gathers
// every thread's writes to thread 0, whose one acquire-release atomic (atom.acq_rel.gpu, cheaper
// on the critical path than __threadfence's fence.sc around a plain atomic) publishes them; in the
// last CTA, that atomic has seen every other CTA's, and the barrier then orders them before every
// thread's loads, which must go past L1 (__ldcg: other SMs wrote the data).
__device__ __forceinline__ bool last_arrival(unsigned int* counter, unsigned int expected, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) *flag = take_ticket(counter, expected);
  __syncthreads();
  return *flag != 0;
}
// The same with the flag in static shared memory (a kernel with no dynamic shared memory to spare).
__device__ __forceinline__ bool last_arrival(unsigned int* counter, unsigned int expected) {
  __shared__ int last;
  return last_arrival(counter, expected, &last);
}

// A counter or flag another CTA publishes with release semantics, read with acquire at GPU scope
// (what the reader loads after it, past L1, then sees the publisher's writes before it).
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

}  // namespace dsg
