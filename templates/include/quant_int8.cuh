// Dynamic int8 activation quantisation, per token, symmetric (msModelSlim's W8A8_DYNAMIC; the one
// definition is ir/formats_int.py quantize_activation):
//
//   s[t] = max_i |x[t, i]| / 127              float32, a true division (IEEE, round to nearest)
//   q[t, i] = clamp(rne(x[t, i] / s[t]), -128, 127)    rne: round half to even; a true division
//   a row of zeros: s = 0, q = 0
//
// Bit-exact with that definition: |x| and the max are exact, __fdiv_rn is the correctly rounded
// quotient whatever the compile flags, __float2int_rn rounds half to even, and clamping an int is
// exact.  (torch on CUDA divides by a Python scalar as a multiply by its reciprocal, which is not
// this; ir/formats_int.py divides by a tensor so its definition holds on every device.)
//
// Its own launch here: one CTA a token row, x read twice (the max, then the quotients; the second
// read hits L1/L2).  Where it fuses: into the epilogue of the kernel that produces x -- the RMSNorm
// for q_a / kv_a / the MoE input holds a whole row in one CTA, so the max is one more block
// reduction after the bf16 rounding of its output (the reference quantises the rounded value); the
// SwiGLU output that feeds down spans CTAs, so down would quantise it in its own prologue.
//
// The output row is padded to a multiple of 16 bytes with zeros (QROW), so the int8 linear
// (int8.cuh) reads it with 16-byte loads only.
#pragma once
#include "common.cuh"
#include "pdl.cuh"

namespace dsg {
namespace quant {

// Bytes of one quantised row: K rounded up to 16 (the zero padding adds nothing to a dot product).
__host__ __device__ constexpr int qrow(int k) { return (k + 15) / 16 * 16; }

// q of one element given its row's scale s (s == 0: the row is all zeros).
__device__ __forceinline__ signed char quantize1(float x, float s) {
  if (s == 0.f) return 0;
  const int q = __float2int_rn(__fdiv_rn(x, s));   // +-inf (s subnormal) saturate to INT_MAX / INT_MIN
  return (signed char)min(127, max(-128, q));
}

// The scale of a row whose max |x| is amax.
__device__ __forceinline__ float scale_of(float amax) { return __fdiv_rn(amax, 127.f); }

// Block-wide max of v over THREADS threads (every thread gets it); red holds THREADS / 32 floats.
template <int THREADS>
__device__ __forceinline__ float block_max(float v, float* red) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "quantiser: whole warps");
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) v = fmaxf(v, red[w]);
  return v;
}

// Token row blockIdx.x of x [T, K] (rows x_stride apart) -> q [T, qrow(K)] int8 (row-major, zero
// padded) and s [T] float32.  One CTA of THREADS threads a token; the lowering's grid is T (0 where
// the int8 linear does not run).
template <typename T, int K, int THREADS>
__device__ __forceinline__ void quantize_rows(const T* __restrict__ x, i64 x_stride, signed char* __restrict__ q,
                                              float* __restrict__ s, int ntok) {
  __shared__ float red[THREADS / 32];
  constexpr int QROW = qrow(K);
  const int t = blockIdx.x;
  dsg::pdl_wait();
  if (t >= ntok) return;
  const T* row = x + (i64)t * x_stride;
  float amax = 0.f;
  for (int i = threadIdx.x; i < K; i += THREADS) amax = fmaxf(amax, fabsf(to_float(row[i])));
  const float sc = scale_of(block_max<THREADS>(amax, red));
  dsg::pdl_launch_dependents();
  signed char* out = q + (i64)t * QROW;
  // four quotients a 32-bit store (QROW % 16 == 0 and the workspace is 16-byte aligned)
  for (int i = 4 * (int)threadIdx.x; i < QROW; i += 4 * THREADS) {
    unsigned word = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const signed char v = (i + j < K) ? quantize1(to_float(row[i + j]), sc) : (signed char)0;
      word |= (unsigned)(unsigned char)v << (8 * j);
    }
    *reinterpret_cast<unsigned*>(out + i) = word;
  }
  if (threadIdx.x == 0) s[t] = sc;
  DSG_PHASE_EXIT();   // phases.cuh
}

}  // namespace quant
}  // namespace dsg
