// Rotary embedding of one R-wide vector by a token's position, as ir/rope.py computes it:
// angle_i = float(pos) * inv_freq[i] in fp32, accurate cosf/sinf, times attention_factor.
#pragma once
#include "common.cuh"

namespace dsg {

// Fill cs[2*i] = cos, cs[2*i+1] = sin of the R/2 angles of `pos` (threads of the block
// stride over i; the caller syncs before reading).
template <int HALF>
__device__ __forceinline__ void rope_angles(const float (&inv_freq)[HALF], float attention_factor,
                                            long long pos, float* cs, int tid, int nthreads) {
  for (int i = tid; i < HALF; i += nthreads) {
    const float a = (float)pos * inv_freq[i];
    cs[2 * i] = cosf(a) * attention_factor;
    cs[2 * i + 1] = sinf(a) * attention_factor;
  }
}

// Element indices of rotation pair i in the input and the output.
// pairs: adjacent (2i, 2i+1) or halves (i, i+R/2); output: interleaved or halves.
template <int R, bool PAIRS_ADJACENT>
__device__ __forceinline__ void rope_in_pair(int i, int& a, int& b) {
  if (PAIRS_ADJACENT) { a = 2 * i; b = 2 * i + 1; } else { a = i; b = i + R / 2; }
}
template <int R, bool OUT_INTERLEAVED>
__device__ __forceinline__ void rope_out_pair(int i, int& a, int& b) {
  if (OUT_INTERLEAVED) { a = 2 * i; b = 2 * i + 1; } else { a = i; b = i + R / 2; }
}

// Pair i's two rotated elements, rounded to T: (x1, x2) by (cos, sin) = (c, s), written as the
// reference's separate products (no contraction across them matters at fp32 tolerance, but keep
// the order: x1*c - x2*s, x2*c + x1*s).
template <typename T>
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, T& ya, T& yb) {
  ya = from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
  yb = from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}

// Pair i's two inputs of x (R elements), as floats: loaded apart from the rotation, a caller can
// issue them before the angle's sine waits for the position (mla_kv_write.cuh).
template <typename T, int R, bool PAIRS_ADJACENT>
__device__ __forceinline__ void rope_load_pair(const T* x, int i, float& x1, float& x2) {
  int ia, ib;
  rope_in_pair<R, PAIRS_ADJACENT>(i, ia, ib);
  x1 = to_float(x[ia]);
  x2 = to_float(x[ib]);
}

// Rotate pair i of x (R elements) into y (R elements) by (cos, sin) = (c, s). Rounds to T.
template <typename T, int R, bool PAIRS_ADJACENT, bool OUT_INTERLEAVED>
__device__ __forceinline__ void rope_pair_cs(const T* __restrict__ x, T* __restrict__ y, float c, float s, int i) {
  float x1, x2;
  int oa, ob;
  rope_load_pair<T, R, PAIRS_ADJACENT>(x, i, x1, x2);
  rope_out_pair<R, OUT_INTERLEAVED>(i, oa, ob);
  rope_rotate<T>(x1, x2, c, s, y[oa], y[ob]);
}

// The same with the angles from rope_angles' table cs.
template <typename T, int R, bool PAIRS_ADJACENT, bool OUT_INTERLEAVED>
__device__ __forceinline__ void rope_pair(const T* __restrict__ x, T* __restrict__ y, const float* cs, int i) {
  rope_pair_cs<T, R, PAIRS_ADJACENT, OUT_INTERLEAVED>(x, y, cs[2 * i], cs[2 * i + 1], i);
}

}  // namespace dsg
