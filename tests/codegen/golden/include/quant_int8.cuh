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
// Its own launch here: one CTA a token row; 16-byte loads held in registers between the max and the
// quotients where the row allows (K % 8 == 0, aligned), else element loads read twice.  Where it fuses: into the epilogue of the kernel that produces x -- the RMSNorm
// for q_a / kv_a / the MoE input holds a whole row in one CTA, so the max is one more block
// reduction after the bf16 rounding of its output (the reference quantises the rounded value); the
// SwiGLU output that feeds down spans CTAs, so down would quantise it in its own prologue.
//
// The output row is padded to a multiple of 16 bytes with zeros (QROW), so the int8 linear
// (int8.cuh) reads it with 16-byte loads only.
#pragma once
#include "common.cuh"
#include "pdl.cuh"
#include "vec.cuh"

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

// y of one int32 sum acc (exact) with its weight channel's scale sw and its token's scale sx:
// (float(acc) * s_w) * s_x, two correctly rounded products (no contraction, no reassociation), as
// ir/formats_int.py int_linear computes it.  Every int8 x int8 kernel's epilogue (int8.cuh, gemm_int8.cuh).
__device__ __forceinline__ float dequant(int acc, float sw, float sx) {
  return __fmul_rn(__fmul_rn(__int2float_rn(acc), sw), sx);
}

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

// A 16-bit value's bits as a float (the pointer only picks the type).
__device__ __forceinline__ float bits_to_float(unsigned short b, const __half*) {
  return __half2float(__ushort_as_half(b));
}
__device__ __forceinline__ float bits_to_float(unsigned short b, const __nv_bfloat16*) {
  return __bfloat162float(__ushort_as_bfloat16(b));
}

// Element e (0..7) of 8 activations held as a uint4 (two 16-bit values a word, the lower first).
template <typename T>
__device__ __forceinline__ float elem8(const uint4& v, int e) {
  const unsigned w = e < 2 ? v.x : e < 4 ? v.y : e < 6 ? v.z : v.w;
  const unsigned short b = (e & 1) ? (unsigned short)(w >> 16) : (unsigned short)(w & 0xFFFFu);
  return bits_to_float(b, static_cast<const T*>(nullptr));
}

// The quotients of 8 activations (elem8), packed as the row's 8 bytes.
template <typename T>
__device__ __forceinline__ uint2 quantize8(const uint4& v, float sc) {
  unsigned lo = 0u, hi = 0u;
#pragma unroll
  for (int e = 0; e < 4; ++e) lo |= (unsigned)(unsigned char)quantize1(elem8<T>(v, e), sc) << (8 * e);
#pragma unroll
  for (int e = 0; e < 4; ++e) hi |= (unsigned)(unsigned char)quantize1(elem8<T>(v, 4 + e), sc) << (8 * e);
  return make_uint2(lo, hi);
}

// One row with 16-byte loads (K % 8 == 0, the row 16-byte aligned): each thread keeps its chunks of 8
// in registers between the max and the quotients, so x is read once.
template <typename T, int K, int THREADS>
__device__ __forceinline__ void quantize_row_vec(const T* __restrict__ row, signed char* __restrict__ out,
                                                 float* __restrict__ s_out, float* red) {
  constexpr int QROW = qrow(K);
  constexpr int NCH = (QROW / 8 + THREADS - 1) / THREADS;   // chunks of 8 a thread, the padding's included
  uint4 v[NCH];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < NCH; ++j) {
    const int i = 8 * ((int)threadIdx.x + j * THREADS);
    v[j] = i < K ? *reinterpret_cast<const uint4*>(row + i) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(elem8<T>(v[j], e)));
  }
  const float sc = scale_of(block_max<THREADS>(amax, red));
  dsg::pdl_launch_dependents();
#pragma unroll
  for (int j = 0; j < NCH; ++j) {
    const int i = 8 * ((int)threadIdx.x + j * THREADS);
    if (i < QROW) *reinterpret_cast<uint2*>(out + i) = i < K ? quantize8<T>(v[j], sc) : make_uint2(0u, 0u);
  }
  if (threadIdx.x == 0) *s_out = sc;
}

// One row with element loads (any K, any alignment): x read twice (the second read hits L1 / L2).
template <typename T, int K, int THREADS>
__device__ __forceinline__ void quantize_row_any(const T* __restrict__ row, signed char* __restrict__ out,
                                                 float* __restrict__ s_out, float* red) {
  constexpr int QROW = qrow(K);
  float amax = 0.f;
  for (int i = threadIdx.x; i < K; i += THREADS) amax = fmaxf(amax, fabsf(to_float(row[i])));
  const float sc = scale_of(block_max<THREADS>(amax, red));
  dsg::pdl_launch_dependents();
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
  if (threadIdx.x == 0) *s_out = sc;
}

// Token row blockIdx.x of x [T, K] (rows x_stride apart) -> q [T, qrow(K)] int8 (row-major, zero
// padded) and s [T] float32.  One CTA of THREADS threads a token; the lowering's grid is T (0 where
// the int8 linear does not run).  16-byte loads where the row allows them (tested per row).
template <typename T, int K, int THREADS>
__device__ __forceinline__ void quantize_rows(const T* __restrict__ x, i64 x_stride, signed char* __restrict__ q,
                                              float* __restrict__ s, int ntok) {
  static_assert(sizeof(T) == 2, "quantiser: bf16 or fp16 activations");
  __shared__ float red[THREADS / 32];
  const int t = blockIdx.x;
  dsg::pdl_wait();
  if (t >= ntok) return;
  const T* row = x + (i64)t * x_stride;
  signed char* out = q + (i64)t * qrow(K);
  if constexpr (K % 8 == 0) {
    if (aligned16(row)) quantize_row_vec<T, K, THREADS>(row, out, s + t, red);
    else quantize_row_any<T, K, THREADS>(row, out, s + t, red);
  } else {
    quantize_row_any<T, K, THREADS>(row, out, s + t, red);
  }
  DSG_PHASE_EXIT();   // phases.cuh
}

}  // namespace quant
}  // namespace dsg
