// The absorbed MLA projections of decode with kv_b in FP8 (DeepSeek-V3's fp8_e4m3_block128, ir/formats.py):
// kv_b[r, c] = q[r, c] * s[r / 128, c / 128], q float8_e4m3fn [H*(N+V), C], s float32 [ceil(H*(N+V) / 128),
// ceil(C / 128)] (edge blocks partial: "ceil blocks").  The weight sides of mla_absorb.cuh's AbsorbQuery
// (UkWeightsFp8) and AbsorbVUp (UvWeightsFp8): the same CTAs, tiles and mma.sync, with half the weight
// bytes in registers.
//
// The scale is applied per weight, in fp32, before the mma: each byte is widened (e4m3 -> f16 -> f32,
// exact), multiplied by its block's scale (one fp32 rounding) and rounded to the activation type, which
// is bit for bit the weight the reference semantics use (ir.formats.dequantize in float32, cast to the
// activation dtype: ir/interpret.py bound_weight).  Not DeepGEMM's promotion per 128-k block (fresh
// accumulators scaled after each block), because
//   - a CTA holds its weight slice in registers for all its token tiles: the multiply is paid once per
//     weight and token tile (one tile at T <= 32 a chunk), not per mma, so it costs no more than a
//     per-block promotion would;
//   - the query's K is the head's N rows of kv_b, and a head's rows cross a 128-row block where
//     h * (N + V) + n does (anywhere when (N + V) % 128 != 0), so a k16 step of one thread may hold rows
//     of two blocks; v_up's rows g and g + 8 may lie in two row blocks too.  Per weight, each row takes
//     its own block's scale and no step needs to lie inside a block.
// The widening is asm volatile so the compiler keeps it in the token-tile loop, after the activation
// copies are issued, instead of hoisting it above them (where it would wait for the weight loads first,
// as the 16-bit side's permutes would: mla_absorb.cuh's prmt).
#pragma once
#include "mla_absorb.cuh"

namespace dsg {
namespace absorb {

constexpr int FP8_BLOCK = 128;   // a scale's rows and columns

// kv_b in FP8: its bytes and its block scales.
struct Fp8Src {
  const unsigned char* q;
  const float* s;
};

__device__ __forceinline__ bool aligned4(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 3ull) == 0;
}

// Four e4m3 (w's bytes, the lowest first) -> four floats, exactly.
__device__ __forceinline__ void e4m3x4_to_float(unsigned w, float (&f)[4]) {
  unsigned lo, hi;
  asm volatile("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n"
               " cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
               : "=r"(lo), "=r"(hi) : "r"(w));
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// Four bytes of p (any alignment) as one word, the lowest address in the low byte.
__device__ __forceinline__ unsigned bytes4(const unsigned char* p) {
  return (unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24);
}

// ---- mla_decode_query / mla_q_absorb: W_UK[h] = kv_b rows h*(N+V) .. +N-1 -------------------------
// A thread's rows 16s + 4c + i (i < 4) of each k16 step s, 4 columns col .. col+3 each: one 4-byte load
// a row (C % 4 == 0), 4 * KSTEPS registers.  The 4 columns lie in one column block (col % 4 == 0); a
// head's N <= 128 rows in at most two row blocks: rows before nb in the first (s_lo), the rest in the
// next (s_hi).
template <typename T, int N, int V, int C>
struct UkWeightsFp8 {
  static_assert(N <= FP8_BLOCK, "a head's W_UK rows span at most two row blocks");
  static constexpr int KSTEPS = N / 16;
  static constexpr int KB = (C + FP8_BLOCK - 1) / FP8_BLOCK;   // scale columns (the last one partial)
  typedef Fp8Src Src;
  struct Regs {
    unsigned w[KSTEPS][4];   // row 16s + 4c + i: columns col .. col+3, one byte each
    float s_lo, s_hi;        // the scales of the head's first row block and the next (0: none)
    int nb;                  // the head's rows from nb on are in the next row block
  };

  __device__ static __forceinline__ void load(Regs& wt, Fp8Src kv_b, int h, int col) {
    const i64 r0 = (i64)h * (N + V);
    const unsigned char* wk = kv_b.q + r0 * C + col;
    const int c = threadIdx.x & 3;
    if (aligned4(kv_b.q)) {   // C % 4 == 0: every row then starts 4-byte aligned too
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) wt.w[s][i] = *reinterpret_cast<const unsigned*>(wk + (i64)(16 * s + 4 * c + i) * C);
    } else {
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) wt.w[s][i] = bytes4(wk + (i64)(16 * s + 4 * c + i) * C);
    }
    const i64 rb = r0 / FP8_BLOCK;
    wt.nb = (int)((rb + 1) * FP8_BLOCK - r0);
    wt.s_lo = __ldg(kv_b.s + rb * KB + col / FP8_BLOCK);
    wt.s_hi = wt.nb < N ? __ldg(kv_b.s + (rb + 1) * KB + col / FP8_BLOCK) : 0.f;
  }

  // Step s's A fragments as UkWeights16::frags lays them out: a0 columns col, col + 1, a1 col + 2,
  // col + 3; rows 4c, 4c+1 logical k pair 0, rows 4c+2, 4c+3 pair 1.
  __device__ static __forceinline__ void frags(const Regs& wt, int s, unsigned (&a0)[4], unsigned (&a1)[4]) {
    const int c = threadIdx.x & 3;
    float f[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float sc = 16 * s + 4 * c + i < wt.nb ? wt.s_lo : wt.s_hi;
      e4m3x4_to_float(wt.w[s][i], f[i]);
#pragma unroll
      for (int j = 0; j < 4; ++j) f[i][j] *= sc;
    }
#pragma unroll
    for (int p = 0; p < 2; ++p) {   // k pair p: rows 4c + 2p, 4c + 2p + 1
      a0[2 * p] = mma::pack2<T>(f[2 * p][0], f[2 * p + 1][0]);
      a0[2 * p + 1] = mma::pack2<T>(f[2 * p][1], f[2 * p + 1][1]);
      a1[2 * p] = mma::pack2<T>(f[2 * p][2], f[2 * p + 1][2]);
      a1[2 * p + 1] = mma::pack2<T>(f[2 * p][3], f[2 * p + 1][3]);
    }
  }
};

// ---- mla_v_up: W_UV[h] = kv_b rows h*(N+V)+N .. +V-1 ----------------------------------------------
// A thread's rows g and g + 8 of its m16 tile, 8 k (8c .. 8c+7, one 8-byte load: C % 8 == 0) of each
// 32-k chunk of its k slice, and each one's scale (a chunk lies in one column block; the two rows may lie
// in two row blocks): 2 * CPS words and 2 * CPS scales.
template <typename T, int N, int V, int C, int CPS>
struct UvWeightsFp8 {
  static constexpr int KB = (C + FP8_BLOCK - 1) / FP8_BLOCK;
  typedef Fp8Src Src;
  struct Regs {
    uint2 a[CPS], b[CPS];    // rows g and g + 8, k 32*chunk + 8c .. +7, one byte each
    float sa[CPS], sb[CPS];  // their scales (0 past V or C)
  };

  __device__ static __forceinline__ void load(Regs& wt, Fp8Src kv_b, int h, int row, int ks) {
    const int c = threadIdx.x & 3;
    const bool vec = aligned8(kv_b.q);   // C % 8 == 0: every row then starts 8-byte aligned too
#pragma unroll
    for (int q = 0; q < CPS; ++q) {
      const int k = (ks * CPS + q) * 32;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int v = row + 8 * half;
        uint2& dst = half ? wt.b[q] : wt.a[q];
        float& sc = half ? wt.sb[q] : wt.sa[q];
        if (v < V && k < C) {
          const i64 r = (i64)h * (N + V) + N + v;
          const unsigned char* p = kv_b.q + r * C + k + 8 * c;
          dst = vec ? *reinterpret_cast<const uint2*>(p) : make_uint2(bytes4(p), bytes4(p + 4));
          sc = __ldg(kv_b.s + (r / FP8_BLOCK) * KB + k / FP8_BLOCK);
        } else {
          dst = make_uint2(0u, 0u);
          sc = 0.f;
        }
      }
    }
  }

  // 8 weights (k 8c .. 8c+7 of one row) times their scale as UvWeights16 holds them: pairs in k order.
  __device__ static __forceinline__ uint4 widen8(uint2 w, float sc) {
    float f[8];
    e4m3x4_to_float(w.x, *reinterpret_cast<float(*)[4]>(f));
    e4m3x4_to_float(w.y, *reinterpret_cast<float(*)[4]>(f + 4));
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] *= sc;
    return make_uint4(mma::pack2<T>(f[0], f[1]), mma::pack2<T>(f[2], f[3]), mma::pack2<T>(f[4], f[5]),
                      mma::pack2<T>(f[6], f[7]));
  }

  __device__ static __forceinline__ void frags(const Regs& wt, int q, unsigned (&s0)[4], unsigned (&s1)[4]) {
    const uint4 a = widen8(wt.a[q], wt.sa[q]), b = widen8(wt.b[q], wt.sb[q]);
    s0[0] = a.x;
    s0[1] = b.x;
    s0[2] = a.y;
    s0[3] = b.y;
    s1[0] = a.z;
    s1[1] = b.z;
    s1[2] = a.w;
    s1[3] = b.w;
  }
};

}  // namespace absorb
}  // namespace dsg
