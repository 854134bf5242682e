// Activations to FP8 for the FP8 x FP8 GEMM (gemm_fp8.cuh): x [T, K] (16-bit, rows x_stride apart)
// -> q [T, K] float8_e4m3fn and s [T, ceil(K / 128)] float32, per token per 128-column group g:
//     amax = max(|x[t, 128 g ..]|, AMAX_FLOOR),  s = amax / 448,  q = e4m3(x / s)
// round to nearest even, saturated to +-448; x ~= q * s (DeepSeek-V3 / DeepGEMM's convention, the
// scale stored as the multiplier).  The floor keeps an all-zero group's scale finite (its q are 0).
// ir/act_quant.py quantize_act_fp8 is the same arithmetic in torch (fp32 division, the same
// rounding): the reference the kernel is tested against.  A ceil group (K % 128 != 0) takes the
// columns that exist.
//
// One warp per (token, group), 4 columns a lane; 8 warps a CTA.  Needs K % 16 == 0 (the GEMM's
// 16-byte chunks of q rows), so a lane's 4 bytes of q are one aligned word.
#pragma once
#include "common.cuh"
#include "pdl.cuh"

namespace dsg {
namespace fp8q {

constexpr int GROUP = 128;
constexpr int WARPS = 8;
constexpr float E4M3_MAX = 448.f;
constexpr float AMAX_FLOOR = 1e-10f;

// Two floats -> two e4m3 bytes (lo first), rounded to nearest even, saturated to +-448.
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

template <typename T, int K>
__device__ __forceinline__ void quantize(const T* __restrict__ x, i64 x_stride, unsigned char* __restrict__ q,
                                         float* __restrict__ s, int num_tokens) {
  static_assert(K % 16 == 0, "FP8 activations: rows of whole 16-byte chunks");
  constexpr int KB = (K + GROUP - 1) / GROUP;
  const int lane = threadIdx.x & 31;
  const long long item = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);   // token * KB + group
  dsg::pdl_wait();                                     // x is the previous kernel's output
  dsg::pdl_launch_dependents();
  if (item >= (long long)num_tokens * KB) return;
  const int t = (int)(item / KB), g = (int)(item % KB);
  const int c0 = g * GROUP + 4 * lane;                 // this lane's first column; all 4 or none exist
  const bool here = c0 < K;
  float v[4];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = here ? to_float(x[(i64)t * x_stride + c0 + i]) : 0.f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  amax = fmaxf(warp_max(amax), AMAX_FLOOR);
  const float sc = amax / E4M3_MAX;
  if (here) {
    const unsigned lo = e4m3x2(v[0] / sc, v[1] / sc), hi = e4m3x2(v[2] / sc, v[3] / sc);
    *reinterpret_cast<unsigned*>(q + (i64)t * K + c0) = lo | (hi << 16);
  }
  if (lane == 0) s[(i64)t * KB + g] = sc;
}

}  // namespace fp8q
}  // namespace dsg
