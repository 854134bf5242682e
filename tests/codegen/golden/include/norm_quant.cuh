// The int8 rows an RMSNorm writes for its int8 readers (ir/passes/fuse_norm_int8_quant.py), from the
// normalised row it holds in registers: the same bytes and scale as quant_int8.cuh's quantiser launch on
// the norm's stored output.  The row in registers is already rounded to the activation type
// (norm.cuh rounds before and after the weight), so |v| and their max are the stored values' exactly;
// scale_of and quantize1 are the quantiser's own.  Elements past N are zeros in the registers
// (RowLayout loads zeros there) and add nothing to the max.
#pragma once
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

}  // namespace quant
}  // namespace dsg
