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
  constexpr int PAIRS = (R / 2 + THREADS - 1) / THREADS;   // rotation pairs a thread
  // Every input of the token first, in one memory round trip: its slot and position, the latent
  // row, the norm's weight and this thread's rotation pairs.  (The angles' sines wait for the
  // position; computed first, as before, they held the row's loads back a round trip, and k_pe's
  // another after the norm.)
  const i64 slot = slots[t];
  const i64 pos = positions[t];
  typedef RowLayout<T, C, THREADS> L;
  float v[L::ITEMS], wv[L::ITEMS];
  L::load(c + (i64)t * c_stride, v);
  L::load(w, wv);
  const T* kp = k_pe + (i64)t * k_stride;
  float x1[PAIRS], x2[PAIRS];
#pragma unroll
  for (int j = 0; j < PAIRS; ++j) {
    const int i = (int)threadIdx.x + j * THREADS;
    float a, b;   // (a thread past the R / 2 pairs loads pair 0's and keeps zeros)
    rope_load_pair<T, R, PAIRS_ADJACENT>(kp, i < R / 2 ? i : 0, a, b);
    x1[j] = i < R / 2 ? a : 0.f;
    x2[j] = i < R / 2 ? b : 0.f;
  }
  T* row = cache + slot * (i64)W;
  rope_angles<R / 2>(inv_freq, attention_factor, pos, cs, threadIdx.x, THREADS);

  rms_norm_row_loaded<T, C, L>(v, wv, eps, scratch);   // syncs: cs is ready after this
  L::store(c_n + (i64)t * C, v);
  if (slot >= 0) L::store(row, v);

  // k_rot and the cache row's rotated part from the same registers (no read back of k_rot)
  T* kr = k_rot + (i64)t * R;
#pragma unroll
  for (int j = 0; j < PAIRS; ++j) {
    const int i = (int)threadIdx.x + j * THREADS;
    if (i < R / 2) {
      int oa, ob;
      rope_out_pair<R, OUT_INTERLEAVED>(i, oa, ob);
      T ya, yb;
      rope_rotate<T>(x1[j], x2[j], cs[2 * i], cs[2 * i + 1], ya, yb);
      kr[oa] = ya;
      kr[ob] = yb;
      if (slot >= 0) {
        row[C + oa] = ya;
        row[C + ob] = yb;
      }
    }
  }
  __syncthreads();   // scratch and cs are reused by the CTA's next token
}

}  // namespace dsg
