// L2 cache policies (sm_80+).  A load that carries one tells L2 which of its lines to give up
// first when it needs room: evict_first for bytes read once (a decode step's weights).  The
// policy is a 64-bit value made by createpolicy (a constant: it folds into the instruction's
// operand).  Make it once, before a loop of accesses: each call is an instruction of its own.
#pragma once
#include "common.cuh"

namespace dsg {
namespace l2 {

__device__ __forceinline__ unsigned long long evict_first() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

}  // namespace l2
}  // namespace dsg
