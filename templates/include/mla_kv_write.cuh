// The latent cache write of one token: c_n = rms_norm(c) [C], k_rot = rope(k_pe) [R], and the
// cache row [c_n | k_rot] at slots[t] (a negative slot writes no row).  The whole CTA works on
// the token (THREADS threads, whole warps: the norm is a block reduction); it runs as its own
// kernel (mla_kv_cache_write.cu.j2, one CTA per token) and beside the absorbed query inside
// mla_decode_query.cu.j2 (mla_decode_prologue: extra CTAs of that grid).
#pragma once
#include "norm.cuh"
#include "rope.cuh"

namespace dsg {

template <typename T, int C, int R, int THREADS, bool PAIRS_ADJACENT, bool OUT_INTERLEAVED>
__device__ __forceinline__ void kv_cache_write_token(int t, const T* __restrict__ c, i64 c_stride,
                                                     const T* __restrict__ k_pe, i64 k_stride,
                                                     const T* __restrict__ w, float eps, const i64* __restrict__ positions,
                                                     const i64* __restrict__ slots, T* __restrict__ c_n,
                                                     T* __restrict__ k_rot, T* __restrict__ cache,
                                                     const float (&inv_freq)[R / 2], float attention_factor,
                                                     float* scratch, float* cs) {
  constexpr int W = C + R;   // cache row width
  const i64 slot = slots[t];
  T* row = cache + slot * (i64)W;
  rope_angles<R / 2>(inv_freq, attention_factor, positions[t], cs, threadIdx.x, THREADS);

  typedef RowLayout<T, C, THREADS> L;
  float v[L::ITEMS];
  L::load(c + (i64)t * c_stride, v);
  rms_norm_row<T, C, L>(v, w, eps, scratch);   // syncs: cs is ready after this
  L::store(c_n + (i64)t * C, v);
  if (slot >= 0) L::store(row, v);

  const T* kp = k_pe + (i64)t * k_stride;
  T* kr = k_rot + (i64)t * R;
  for (int i = threadIdx.x; i < R / 2; i += THREADS) rope_pair<T, R, PAIRS_ADJACENT, OUT_INTERLEAVED>(kp, kr, cs, i);
  __syncthreads();   // k_rot written by other threads: copy it into the cache row
  if (slot >= 0)
    for (int i = threadIdx.x; i < R; i += THREADS) row[C + i] = kr[i];
  __syncthreads();   // scratch and cs are reused by the CTA's next token
}

}  // namespace dsg
