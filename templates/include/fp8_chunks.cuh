// Skinny linears with FP8 weights past the kernel's MAX_TOKENS (decode batches of 17 to a few hundred
// tokens): the tokens in chunks of MAX_TOKENS along grid.y.  CTA (x, c) runs exactly the T <= MAX_TOKENS
// kernel (fp8.cuh linear_fp8) on tokens [MAX_TOKENS c, min(T, MAX_TOKENS (c + 1))): x and every output
// offset by MAX_TOKENS c rows, its own token count clipped at T.  So each token's arithmetic is the
// T <= MAX_TOKENS kernel's, bit for bit, and no quantiser launch runs (x is read as 16-bit).
//
// Why chunks and not more n8 tiles: the CTAs of one row tile (same blockIdx.x, every c) read the same
// weight bytes at about the same time, so DRAM serves them once and L2 the repeats, while each CTA keeps
// the T <= MAX_TOKENS kernel's registers (no spills, the same CTAs an SM).  The cost is L2 bandwidth
// (chunks x the weight bytes) and x read once a CTA, which are far from the bound at a few chunks.
//
// Clusters (KS > 1) stay along x: a cluster is KS CTAs of one row tile and one chunk.
#pragma once
#include "fp8.cuh"

namespace dsg {
namespace skinny {

// y_i = x @ (q_i * s_i)^T for the chunk blockIdx.y of ntok tokens.  `out` holds the outputs of all
// ntok tokens, rows of O_i (SILU: one output of ROWS[0]) elements.
template <typename T, int K, int WARPS, int RT, int U, bool ROLLING, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void linear_fp8_chunk(const T* __restrict__ x, i64 x_stride,
                                                 const Fp8Mats<sizeof...(ROWS)>& m,
                                                 const Mats<T, sizeof...(ROWS)>& out, int ntok, float* red) {
  constexpr int rows[] = {ROWS...};
  __shared__ Mats<T, sizeof...(ROWS)> mine;            // skinny.cuh chunk_outputs (the store: reduce_store)
  const int t0 = (int)blockIdx.y * MAX_TOKENS, chunk_tokens = min(MAX_TOKENS, ntok - t0);
  chunk_outputs<SILU ? 1 : (int)sizeof...(ROWS)>(out, mine, rows, t0);
  linear_fp8<T, K, WARPS, RT, U, ROLLING, KS, SILU, ROWS...>(x + (i64)t0 * x_stride, x_stride, m, mine,
                                                             chunk_tokens, red);
}

}  // namespace skinny
}  // namespace dsg
