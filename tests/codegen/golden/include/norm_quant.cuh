// The quantised rows an RMSNorm writes for its readers, from the normalised row it holds in registers:
// int8 rows for its int8 readers (ir/passes/fuse_norm_int8_quant.py), the same bytes and scale as
// quant_int8.cuh's quantiser launch on the norm's stored output; e4m3 rows for its FP8 x FP8 readers
// (ir/passes/fuse_norm_fp8_quant.py), the same bytes and scales as quant_fp8.cuh's.  The row in registers
// is already rounded to the activation type (norm.cuh rounds before and after the weight), so |v| and
// their max are the stored values' exactly; the quantisers' own helpers (scale_of, quantize1; e4m3x2)
// do the rest.  Elements past N are zeros in the registers (RowLayout loads zeros there) and add nothing
// to the max.
#pragma once
#include "quant_fp8.cuh"
#include "quant_int8.cuh"

namespace dsg {
namespace quant {

// v[ITEMS]: the normalised row in Layout's distribution -> q [qrow(N)] int8 (zero padded) and *s.
// Block-wide (every thread calls it); red holds Layout::NTHREADS / 32 floats of shared memory no other
// reduction of the kernel uses.
template <int N, typename Layout>
__device__ __forceinline__ void norm_rows_int8(const float* v, signed char* __restrict__ q,
                                               float* __restrict__ s, float* red) {
  constexpr int QROW = qrow(N);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < Layout::ITEMS; ++i) amax = fmaxf(amax, fabsf(v[i]));
  const float sc = scale_of(block_max<Layout::NTHREADS>(amax, red));
#pragma unroll
  for (int k = 0; k < Layout::CHUNKS; ++k) {
    const int i0 = Layout::index(k, 0);
    if constexpr (Layout::VEC == 8) {   // 8 bytes a chunk: i0 % 8 == 0 and the row starts 16-byte aligned
      if (i0 < N) {
        unsigned lo = 0u, hi = 0u;
#pragma unroll
        for (int e = 0; e < 4; ++e) lo |= (unsigned)(unsigned char)quantize1(v[k * 8 + e], sc) << (8 * e);
#pragma unroll
        for (int e = 0; e < 4; ++e) hi |= (unsigned)(unsigned char)quantize1(v[k * 8 + 4 + e], sc) << (8 * e);
        *reinterpret_cast<uint2*>(q + i0) = make_uint2(lo, hi);
      }
    } else {
#pragma unroll
      for (int j = 0; j < Layout::VEC; ++j)
        if (i0 + j < N) q[i0 + j] = quantize1(v[k * Layout::VEC + j], sc);
    }
  }
  for (int i = N + (int)threadIdx.x; i < QROW; i += Layout::NTHREADS) q[i] = 0;   // the padding
  if (threadIdx.x == 0) *s = sc;
}

// v[ITEMS]: token t's normalised row in Layout's distribution -> q + t * N: N e4m3 bytes, and s + t * KB:
// KB = ceil(N / 128) fp32 scales, per 128-column group g as quant_fp8.cuh's quantiser: amax = max(|v|,
// AMAX_FLOOR), s = amax / 448 and q = e4m3(v / s), true divisions, e4m3x2's rounding.  With 16-byte chunks
// (VEC = 8) a group is the chunk of 16 consecutive threads (half a warp, 16-aligned), so its max takes four
// xor-shuffles and no shared memory; the max is order-free, so the quantiser's 32 lanes x 4 give the same.
// Block-wide: every thread of the CTA calls it (whole warps shuffle).
template <int N, int KB, typename Layout>
__device__ __forceinline__ void norm_rows_fp8(const float* v, unsigned char* __restrict__ q,
                                              float* __restrict__ s, int t) {
  constexpr int LANES = fp8q::GROUP / 8;   // threads a group
  static_assert(N % 16 == 0 && Layout::VEC == 8, "FP8 rows: 16-bit activations, whole 16-byte chunks");
  static_assert(Layout::NTHREADS % 32 == 0, "FP8 rows: whole warps (a group is half a warp)");
  static_assert(KB == (N + fp8q::GROUP - 1) / fp8q::GROUP, "the lowering's scales a row");
  q += (i64)t * N;
  s += (i64)t * KB;
#pragma unroll
  for (int k = 0; k < Layout::CHUNKS; ++k) {
    const float* c = v + k * 8;
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(c[e]));
#pragma unroll
    for (int m = LANES / 2; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    amax = fmaxf(amax, fp8q::AMAX_FLOOR);
    const float sc = amax / fp8q::E4M3_MAX;
    const int i0 = Layout::index(k, 0);
    if (i0 < N) {   // a chunk is whole or past the end (N % 8 == 0); 8 bytes, i0 % 8 == 0
      const unsigned lo = (unsigned)fp8q::e4m3x2(c[0] / sc, c[1] / sc)
                          | ((unsigned)fp8q::e4m3x2(c[2] / sc, c[3] / sc) << 16);
      const unsigned hi = (unsigned)fp8q::e4m3x2(c[4] / sc, c[5] / sc)
                          | ((unsigned)fp8q::e4m3x2(c[6] / sc, c[7] / sc) << 16);
      *reinterpret_cast<uint2*>(q + i0) = make_uint2(lo, hi);
      if (i0 % fp8q::GROUP == 0) s[i0 / fp8q::GROUP] = sc;
    }
  }
}

}  // namespace quant
}  // namespace dsg
