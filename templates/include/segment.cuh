// A persistent decode segment (codegen/segments.py): the tasks of a run of consecutive launches (each
// member launch's CTAs, by their blockIdx.x) in one launch.  Task ids follow the plan: member 0's
// tiles, then member 1's, ...; a member's tasks wait until the counters of the earlier members it
// depends on say every one of their tasks is done.
//
// Counters: a __device__ array of the kernel's own module, [0] the next task to hand out, [1] the
// CTAs that have left, [2 + m] member m's finished tasks.  Zero when the module loads; the last CTA
// to leave zeroes them (as tickets.cuh's tickets), so the next launch of the kernel (the next layer,
// the next replay of a captured graph) starts from 0 with no memset and no host sync.  Launches of
// one kernel never overlap: stream order, and under PDL every CTA waits before it touches them.
//
// Deadlock: a task waits only for tasks with smaller ids.  CTA b's first task is b (so its weights
// can go towards L2 before the wait, and the grid is at most one CTA an SM, all resident once the
// kernel before has drained); later ones come from counter [0] in increasing order.  The unfinished
// task with the smallest id has every dependency done and a running CTA, whatever the grid.
//
// Memory order: a task's threads write, the CTA barrier gathers their writes to thread 0, whose
// release add publishes them; a waiting thread 0 reads the counter with acquire (which invalidates
// the SM's L1), and the barrier after it orders the CTA's loads after.  Values another task of the
// launch writes are read through `fresh` pointers: never ld.global.nc, which assumes the bytes do
// not change while the kernel runs.
#pragma once
#include "common.cuh"
#include "tickets.cuh"

namespace dsg {
namespace seg {

constexpr int NEXT = 0, LEFT = 1, DONE = 2;   // counter slots; DONE + m: member m's finished tasks

// p, with a provenance the compiler cannot trace to a const __restrict__ kernel parameter.
template <typename P>
__device__ __forceinline__ P* fresh(P* p) {
  unsigned long long v;
  asm("mov.b64 %0, %1;\n" : "=l"(v) : "l"(p));
  return reinterpret_cast<P*>(v);
}

// The CTA's next task after its first (blockIdx.x): thread 0 takes one, the barrier hands it on and
// ends the previous task's use of shared memory.
__device__ __forceinline__ int next_task(unsigned* counters, int* slot) {
  __syncthreads();
  if (threadIdx.x == 0) *slot = (int)gridDim.x + (int)atomicAdd(counters + NEXT, 1u);
  __syncthreads();
  return *slot;
}

// Thread 0 waits until member m's counter reaches `tasks`; the caller's barrier (`waited`) follows.
__device__ __forceinline__ void wait_member(const unsigned* counters, int m, unsigned tasks) {
  if (threadIdx.x == 0)
    while (ld_acquire_gpu(counters + DONE + m) < tasks) __nanosleep(20);
}

__device__ __forceinline__ void waited() { __syncthreads(); }

// After a task of member m: every thread's writes, then thread 0's release.
__device__ __forceinline__ void signal_member(unsigned* counters, int m) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counters + DONE + m) : "memory");
}

// The CTA leaves; the last of the grid zeroes the counters (nobody reads them any more: every CTA
// has taken its last task).
__device__ __forceinline__ void leave(unsigned* counters, int members) {
  if (last_arrival(counters + LEFT, gridDim.x)) {   // resets LEFT itself
    for (int i = threadIdx.x; i < DONE + members; i += blockDim.x)
      if (i != LEFT) counters[i] = 0u;
  }
}

// Weights of a task towards L2 while it waits: `rows` rows of `bytes` each, row r at row_of(r)
// (nullptr: none).  The block's threads share the 128-byte lines.
template <typename RowOf>
__device__ __forceinline__ void prefetch_rows(int rows, long long bytes, RowOf&& row_of) {
  const int lines = (int)((bytes + 127) / 128) + 1;   // + 1: a row that starts inside a line
  for (int i = threadIdx.x; i < rows * lines; i += blockDim.x) {
    const char* r = reinterpret_cast<const char*>(row_of(i / lines));
    if (r == nullptr) continue;
    const unsigned long long a = (reinterpret_cast<unsigned long long>(r) & ~127ull) + 128ull * (i % lines);
    if (a < reinterpret_cast<unsigned long long>(r) + (unsigned long long)bytes)
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a));
  }
}

}  // namespace seg
}  // namespace dsg
