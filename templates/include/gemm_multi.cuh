// One launch of several dense one-byte GEMMs over the same quantised x: a multi_linear's weights (MLA's q and
// kv_a) as the parts of one grid (Tuning.linear.gemm_multi; gemm_fp8.cuh, gemm_int8.cuh gemm).  One
// launch instead of one a weight: under PDL the second GEMM's launch waited for the whole of the first, so its
// launch floor sat on the step's chain.
//
//   * part p owns the CTAs [base_p, base_{p + 1}) of the grid (base_0 = 0; the last part's end is gridDim.x):
//     each part as many CTAs as its own launch would have (the lowering's prefix sums of the parts' grids,
//     size expressions of T and SMS evaluated at run time, like each part's `splits`);
//   * a CTA runs its part's gemm on a PartGrid (gemm_ring.cuh): CTA c = blockIdx.x - base_p of the
//     part's CTAs, where its own launch's CTA c reads c and the grid from blockIdx.x / gridDim.x (WholeGrid):
//     the same work items, K ranges, ring steps, split partials and split-order sums as that CTA -- the same
//     code on the same sums in the same order -- so each part's output is bit-equal to its own launch's;
//   * each part has its own TICKETS split tickets and its own slice of the partials (its rows at the prefix
//     sum of the earlier parts' partial rows, the lowering's), so parts never share a counter or a partial.
#pragma once
#include "common.cuh"
#include "gemm_ring.cuh"

namespace dsg {
namespace gemm_multi {

// The part a CTA works for and its place among that part's CTAs.
struct Slot {
  int part;
  gemm_ring::PartGrid grid;
};
// base[p]: the first CTA of part p (base[0] = 0, increasing); the last part runs to the grid's end.
template <int P>
__device__ __forceinline__ Slot slot_of(const int (&base)[P]) {
  static_assert(P >= 2, "gemm_multi: two parts at least");
  const int b = blockIdx.x;
  int part = 0, first = 0, end = base[1];
#pragma unroll
  for (int q = 1; q < P; ++q) {                       // the last base at or below b is the part's
    const bool in = b >= base[q];
    part = in ? q : part;
    first = in ? base[q] : first;
    end = in ? (q + 1 < P ? base[q + 1 < P ? q + 1 : q] : (int)gridDim.x) : end;
  }
  return {part, {b - first, end - first}};
}

}  // namespace gemm_multi
}  // namespace dsg
