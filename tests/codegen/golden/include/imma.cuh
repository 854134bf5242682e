// Integer tensor-core mma (sm_80+, plain sm_90 too): mma.sync m16n8k32 with s8 operands and int32
// accumulators.  Fragments (thread g = lane / 4, c = lane % 4; four s8 a register, the lower k in
// the lower byte):
//   a0: A[g][4c .. 4c+3]    a1: A[g+8][4c .. 4c+3]    a2: A[g][16+4c ..]    a3: A[g+8][16+4c ..]
//   b0: B[4c .. 4c+3][g]    b1: B[16+4c ..][g]
//   d0, d1: D[g][2c], D[g][2c+1]        d2, d3: D[g+8][2c], D[g+8][2c+1]
// Exact: each product is at most 2^14 in magnitude, so int32 holds any sum of fewer than 2^17.
#pragma once
#include "common.cuh"

namespace dsg {
namespace mma {

// d += A (16 x 32 s8, row) * B (32 x 8 s8, col), int32 accumulators.
__device__ __forceinline__ void mma16832_s8(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                            unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace mma
}  // namespace dsg
