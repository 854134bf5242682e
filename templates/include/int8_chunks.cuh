// Skinny linears with int8 weights past the kernel's MAX_TOKENS (decode batches of 17 to a few hundred
// tokens): the tokens in chunks of MAX_TOKENS along grid.y.  CTA (x, c) runs exactly the T <= MAX_TOKENS
// kernel (int8.cuh linear_i8) on tokens [MAX_TOKENS c, min(T, MAX_TOKENS (c + 1))): the quantised rows, their
// scales and every output offset by MAX_TOKENS c rows, its own token count clipped at T.  So each token's
// arithmetic is the T <= MAX_TOKENS kernel's, bit for bit (exact int32 sums, the same two roundings).
//
// x is read already quantised (the quantiser's launch or the norm's int8 rows, qrow(K) bytes a token), as
// the T <= MAX_TOKENS kernel reads it: the chunks replace the int8 GEMM, not the quantiser.
//
// Why chunks and not more n8 tiles: the CTAs of one row tile (same blockIdx.x, every c) read the same
// weight bytes at about the same time, so DRAM serves them once and L2 the repeats, while each CTA keeps
// the T <= MAX_TOKENS kernel's registers (no spills, the same CTAs an SM).
#pragma once
#include "int8.cuh"

namespace dsg {
namespace skinny {

// y_i = dequant(qx, s_x) @ dequant(W_i, s_i)^T for the chunk blockIdx.y of ntok tokens.  qx / sx hold all
// ntok tokens' quantised rows and scales, `out` all their outputs (rows of O_i; SILU: one output of ROWS[0]).
template <typename T, int K, int WARPS, int RT, int U, bool SILU, int... ROWS>
__device__ __forceinline__ void linear_i8_chunk(const signed char* __restrict__ qx, const float* __restrict__ sx,
                                                const I8Mats<sizeof...(ROWS)>& m, const Mats<T, sizeof...(ROWS)>& out,
                                                int ntok, int* red) {
  constexpr int rows[] = {ROWS...};
  __shared__ Mats<T, sizeof...(ROWS)> mine;            // skinny.cuh chunk_outputs (the store: i8_store)
  const int t0 = (int)blockIdx.y * MAX_TOKENS, chunk_tokens = min(MAX_TOKENS, ntok - t0);
  chunk_outputs<SILU ? 1 : (int)sizeof...(ROWS)>(out, mine, rows, t0);
  linear_i8<T, K, WARPS, RT, U, SILU, ROWS...>(qx + (i64)t0 * dsg::quant::qrow(K), sx + t0, m, mine,
                                               chunk_tokens, red);
}

}  // namespace skinny
}  // namespace dsg
