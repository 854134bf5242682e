// Phase marks: where a kernel's time goes inside a step (bench/perf_phases.py reads them).
//
// Only with DSG_PHASES defined (perf_phases.py compiles its own bundle with -DDSG_PHASES=1); without
// it every mark is nothing and the machine code is what it would be without this header.
//
// With it, each module holds two tables at global scope (not mangled: cuModuleGetGlobal finds them
// by these names), a row of MARKS per CTA (the first CTAS of a grid, linear block index):
//   dsg_phase_ns[cta][mark]   the global timer (%globaltimer, ns; one clock for every SM)
//   dsg_phase_clk[cta][mark]  the SM's cycle counter (clock64: exact, but per SM)
// Every launch of the kernel overwrites its rows, so after a step they hold the module's last launch
// (a decode layer's kernels: the last layer's).  The marks:
//   WAIT_CALL  thread 0 enters pdl_wait(): what the CTA does before its wait is issued
//   WAITED     thread 0 leaves it: the kernel before has completed and its writes are visible
//   TRIGGER    thread 0 calls pdl_launch_dependents()
//   EXIT       the CTA's last warp to reach DSG_PHASE_EXIT() at the end of the kernel (a max over
//              warps: warp-specialised kernels end on their consumers, not on thread 0)
//   4 .. 7     the kernel's own marks, DSG_PHASE(k) by thread 0 (perf_phases.py names them per family)
//   ENTRY      thread 0's first instruction, where a kernel marks it (the decode attention: its
//              launch and the chain it issues before its wait, apart; with PDL off what the bench's
//              profile counts as its own time begins here)
// The marks write global memory before pdl_wait(), which pdl.cuh forbids for the step's buffers
// (memory the kernel before may still use); these tables belong to the module and nothing else
// touches them.  The stores cost each marking thread a few cycles; the exit's atomics a few more.
#pragma once

namespace dsg {
namespace phases {
constexpr int CTAS = 1024, MARKS = 9;
enum Mark { WAIT_CALL = 0, WAITED = 1, TRIGGER = 2, EXIT = 3, ENTRY = 8 };   // 4 .. 7: the kernel's own
}  // namespace phases
}  // namespace dsg

#ifdef DSG_PHASES
#include "common.cuh"

__device__ unsigned long long dsg_phase_ns[dsg::phases::CTAS][dsg::phases::MARKS];
__device__ unsigned long long dsg_phase_clk[dsg::phases::CTAS][dsg::phases::MARKS];

namespace dsg {
namespace phases {

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ int cta() {
  return (int)(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}
// Mark k by thread 0 of the CTA.
__device__ __forceinline__ void mark(int k) {
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0 && cta() < CTAS) {
    const unsigned long long c = (unsigned long long)clock64();
    dsg_phase_ns[cta()][k] = global_ns();
    dsg_phase_clk[cta()][k] = c;
  }
}
// The exit mark: lane 0 of every warp, the latest kept.
__device__ __forceinline__ void mark_exit() {
  if ((threadIdx.x & 31) == 0 && cta() < CTAS) {
    const unsigned long long c = (unsigned long long)clock64();
    atomicMax(&dsg_phase_ns[cta()][EXIT], global_ns());
    atomicMax(&dsg_phase_clk[cta()][EXIT], c);
  }
}

}  // namespace phases
}  // namespace dsg

#define DSG_PHASE(k) ::dsg::phases::mark(k)
#define DSG_PHASE_EXIT() ::dsg::phases::mark_exit()
#else
#define DSG_PHASE(k) ((void)0)
#define DSG_PHASE_EXIT() ((void)0)
#endif
