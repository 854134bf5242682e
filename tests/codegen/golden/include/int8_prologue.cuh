// The int8 skinny linear that quantises its own x (Tuning.linear.i8_prologue_upto): at a few tokens the
// quantiser's launch (quant_int8.cuh quantize_rows) is a kernel boundary on the step's chain for a few KB
// of work, so here every CTA reads the T <= ROWS bf16 / fp16 rows of x itself (T * K * 2 bytes: 16 KB at
// 4 x 2048, L2-resident after the kernel that wrote them), quantises them into shared memory and runs
// int8.cuh's product from there.  The CTAs repeat the same few-KB quantisation; each reads its own 16-row
// slice of the weights, which is the traffic that matters.
//
// Bit-equal to the quantiser launch by construction: the per-element arithmetic is the same functions
// (quant_int8.cuh elem8 / to_float, scale_of, quantize1, quantize8), and a row's max |x| is exact in any
// order (fmaxf of non-negative floats; a NaN is dropped by fmaxf wherever it meets), so splitting a row
// over the CTA's warps instead of one CTA a row changes no bit.  The padding past K is zeros, as there.
//
// Weights do not depend on x: before the PDL wait each CTA sends its weight rows towards L2 (pdl.cuh's
// contract allows weight reads before the wait), so their DRAM reads overlap the previous kernel's tail and
// the prologue; int8.cuh's loads then find them in L2.
//
// Shared memory (dynamic, XqSmem below; the lowering computes the same bytes and the template checks
// them): ROWS quantised rows of qrow(K) bytes, ROWS scales, ROWS x WARPS partial maxima.
#pragma once
#include "int8.cuh"
#include "pdl.cuh"

namespace dsg {
namespace quant {

// The dynamic shared-memory layout of ROWS quantised rows for THREADS threads (bytes from the base).
template <int K, int ROWS, int THREADS>
struct XqSmem {
  static constexpr int Q = 0;                                  // int8 [ROWS, qrow(K)], 16-byte rows
  static constexpr int S = ROWS * qrow(K);                     // float32 [ROWS]: the scales
  static constexpr int MAX = S + 4 * ROWS;                     // float32 [ROWS, THREADS / 32]: partial maxima
  static constexpr int BYTES = MAX + 4 * ROWS * (THREADS / 32);
};

// n rows of bf16 / fp16 activations -> int8 rows of qrow(K) bytes (zero padded) and their float32 scales
// in shared memory, every thread of the CTA taking part: row t is read from src(t) and written to q row
// dst(t) and s[dst(t)]; part holds n * THREADS / 32 floats (each row's partial maxima).  vec: every src(t)
// is 16-byte aligned and K % 8 == 0 (16-byte loads).  The quantiser launch's arithmetic (module comment).
// Ends with the barrier that publishes q and s.
template <typename T, int K, int THREADS, typename Src, typename Dst>
__device__ __forceinline__ void quantize_rows_shared(Src src, Dst dst, int n, bool vec, signed char* q, float* s,
                                                     float* part) {
  static_assert(sizeof(T) == 2, "quantiser: bf16 or fp16 activations");
  static_assert(THREADS % 32 == 0, "quantiser: whole warps");
  constexpr int QROW = qrow(K), WARPS = THREADS / 32;
  const int tid = (int)threadIdx.x;
  for (int t = 0; t < n; ++t) {
    const T* row = src(t);
    float amax = 0.f;
    if (vec) {
      for (int i = 8 * tid; i < K; i += 8 * THREADS) {
        const uint4 v = *reinterpret_cast<const uint4*>(row + i);
#pragma unroll
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(elem8<T>(v, e)));
      }
    } else {
      for (int i = tid; i < K; i += THREADS) amax = fmaxf(amax, fabsf(to_float(row[i])));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((tid & 31) == 0) part[t * WARPS + (tid >> 5)] = amax;
  }
  __syncthreads();
  if (tid < n) {
    float amax = part[tid * WARPS];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) amax = fmaxf(amax, part[tid * WARPS + w]);
    s[dst(tid)] = scale_of(amax);
  }
  __syncthreads();
  for (int t = 0; t < n; ++t) {
    const T* row = src(t);
    signed char* out = q + (i64)dst(t) * QROW;
    const float sc = s[dst(t)];
    if (vec) {   // the second read of the row hits L1
      for (int i = 8 * tid; i < QROW; i += 8 * THREADS)
        *reinterpret_cast<uint2*>(out + i) =
            i < K ? quantize8<T>(*reinterpret_cast<const uint4*>(row + i), sc) : make_uint2(0u, 0u);
    } else {
      for (int i = 4 * tid; i < QROW; i += 4 * THREADS) {
        unsigned word = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const signed char v = (i + j < K) ? quantize1(to_float(row[i + j]), sc) : (signed char)0;
          word |= (unsigned)(unsigned char)v << (8 * j);
        }
        *reinterpret_cast<unsigned*>(out + i) = word;
      }
    }
  }
  __syncthreads();
}

}  // namespace quant

namespace skinny {

// The CTA's RT * 16 stacked weight rows [row0, row0 + 16 * RT) towards L2, one prefetch a 128-byte line
// (a row need not start on a line: up to two lines more than K / 128).
template <int K, int RT, bool SILU, int... ROWS>
__device__ __forceinline__ void i8_prefetch_rows(const I8Mats<sizeof...(ROWS)>& m, int row0) {
  constexpr int LINES = K / 128 + 2;
  for (int l = (int)threadIdx.x; l < RT * TILE * LINES; l += (int)blockDim.x) {
    const signed char* w;
    const float* unused;
    i8_row<K, SILU, ROWS...>(m, row0 + l / LINES, w, unused);
    if (w == nullptr) continue;
    const unsigned long long a = (reinterpret_cast<unsigned long long>(w) & ~127ull) + 128ull * (l % LINES);
    if (a < reinterpret_cast<unsigned long long>(w + K)) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a));
  }
}

// y_i = int8.cuh linear_i8 of x quantised per token in this CTA's prologue (module comment), for ntok <=
// XQ tokens (the lowering's grid is 0 above).  smem: XqSmem<K, XQ, WARPS * 32>::BYTES of dynamic shared
// memory.
template <typename T, int K, int WARPS, int RT, int U, int XQ, bool SILU, int... ROWS>
__device__ __forceinline__ void linear_i8_xq(const T* __restrict__ x, i64 x_stride, const I8Mats<sizeof...(ROWS)>& m,
                                             const Mats<T, sizeof...(ROWS)>& out, int ntok, int* red,
                                             unsigned char* smem) {
  static_assert(XQ >= 1 && XQ <= MAX_TOKENS, "prologue quantiser: 1 to MAX_TOKENS rows");
  typedef dsg::quant::XqSmem<K, XQ, WARPS * 32> L;
  i8_prefetch_rows<K, RT, SILU, ROWS...>(m, blockIdx.x * RT * TILE);
  dsg::pdl_wait();   // x is the previous kernel's output
  auto row_of = [&](int t) { return x + (i64)t * x_stride; };
  // 16-byte loads where every row allows them (K % 8 == 0, x aligned, rows a whole number of 16 bytes apart)
  const bool vec = K % 8 == 0 && aligned16(x) && x_stride % 8 == 0;
  dsg::quant::quantize_rows_shared<T, K, WARPS * 32>(row_of, [](int t) { return t; }, ntok, vec,
                                                     reinterpret_cast<signed char*>(smem + L::Q),
                                                     reinterpret_cast<float*>(smem + L::S),
                                                     reinterpret_cast<float*>(smem + L::MAX));
  linear_i8<T, K, WARPS, RT, U, SILU, ROWS...>(reinterpret_cast<const signed char*>(smem + L::Q),
                                                reinterpret_cast<const float*>(smem + L::S), m, out, ntok, red);
}

}  // namespace skinny
}  // namespace dsg
