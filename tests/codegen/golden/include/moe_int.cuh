// The grouped expert GEMMs with msModelSlim's integer weights and int8 activations: packed int4
// (int4_channel, W4A8_DYNAMIC 1.0.0; int4_group256_packed) -- PACK 2, two channels a byte along N --
// and one value a byte (int8_channel, W8A8_DYNAMIC experts; int4_channel_byte; int4_group256) -- PACK 1
// (ir/formats.py).  The arithmetic is ir/formats_int.py int_linear's, per pair as ir/ops/moe.py
// grouped_linear applies it:
//
//   qx, s_x   the activation rows quantised per row (quant_int8.cuh, its own launch before this one):
//             x's token rows for GATE_UP_SILU (one quantisation a token, shared by all its pairs), the
//             SwiGLU's pair rows for DOWN
//   acc       = sum_k qx[row, k] * q[e, o, k]                exact in int32 (KD < 2^17)
//   y         = (float(acc) * s_w[e, o]) * s_x[row]          two correctly rounded products (int8.cuh i8_scale)
//   GATE_UP_SILU: out = round(round(silu(round(y_gate))) * round(y_up)), as moe_grouped.cuh's GEMV rounds
//   DOWN:         out = round(y)
//
// so DOWN's outputs are bit-equal to the reference's, and GATE_UP_SILU's gate and up are (silu's expf
// may differ from torch's in the last bit before its rounding).
//
// Swap-AB with mma.sync m16n8k32 s8 (imma.cuh): the expert's weight channels are the mma's M side,
// its pairs the N side (n8 tiles), so decode's few pairs an expert cost little padding and each
// weight byte is read once a pass.  An m16 tile covers 16 channels from `base`: PACK 2 (int4.cuh's
// unpack) 8 packed rows base / 2 + g, channels base + 2g as mma row g and base + 2g + 1 as row g + 8,
// the mma summing 16 * q * x and the total shifted right by 4 (exact); PACK 1 (int8.cuh's fragments)
// channels base + g and base + 8 + g, two row loads.  Thread (g, c) loads 16 bytes at k0 = 64 * step +
// 16 * c of its weight rows and of pair g's quantised row, as int8.cuh does.
//
// CTA (WI4_THREADS): WI4_RT = 2 m16 tiles -- GATE_UP_SILU: the gate's and the up's tiles of the same
// 16 channels, so SwiGLU pairs them in the epilogue; DOWN: 32 channels -- of one expert; the warps
// split KD in 64-wide steps and meet in shared memory (int32, exact in any order).  Grid (column
// tiles, min(E, NP) slots): slot s is the s-th expert with pairs (moe_grouped.cuh nth_light_expert),
// so an expert without pairs costs no CTA.  The expert's pairs run in passes of up to 32 (4 n8
// tiles), 16 or 8; each pass reads the CTA's weights again (from L2 after the first): one pass covers
// decode's tokens up to 16, more pairs an expert re-read them -- correct at any T, not a prefill GEMM.
//
// Per-group int4 (second-stage scales s2 [E, N, KD / 256], W = (q * s2) * s_w): GROUP = 256.  A 64-k
// step lies in one group, so each step's int32 sums (exact) are promoted to float32 times their
// group's s2 and summed there; the warps' float partial sums meet in shared memory, then
// (sum * s_w) * s_x as above.  ir/formats_int.py sums qx * fl32(q * s2) in float64 instead: the two
// agree to ~2^-22 relative before the output's rounding, not bit for bit.
//
// Odd widths: the 16-byte weight loads need KD % 16 == 0 and 16-byte aligned weights (tested per
// CTA), else byte loads (int8.cuh chunk_i8); k past KD loads zeros; channels past N load zeros and
// are not stored.  PACK 2 needs N even (two a byte).
#pragma once
#include "int4.cuh"
#include "int8.cuh"
#include "moe_grouped.cuh"
#include "pdl.cuh"

namespace dsg {
namespace moe {

constexpr int WI4_WARPS = 4;
constexpr int WI4_THREADS = WI4_WARPS * 32;
constexpr int WI4_STEP = 64;      // k a warp step: 4 threads x 16 bytes of each row
constexpr int WI4_RT = 2;         // m16 tiles a CTA
constexpr int WI4_MAX_NT = 4;     // n8 pair tiles in the widest pass

// Output channels a CTA covers (the lowering's column tiles).
__host__ __device__ constexpr int wi4_channels(int mode) { return mode == DOWN ? 32 : 16; }

// The channel of mma row g + 8 * h (h 0 or 1) of tile rt in a CTA whose first channel is ch0.
template <int MODE, int PACK>
__device__ __forceinline__ int wi4_channel(int ch0, int rt, int g, int h) {
  const int base = ch0 + (MODE == DOWN ? 16 * rt : 0);
  return PACK == 2 ? base + 2 * g + h : base + g + 8 * h;
}

// The exact sum of one thread's products: PACK 2 summed 16 * q * x.
template <int PACK>
__device__ __forceinline__ int wi4_unscale(int acc) {
  if constexpr (PACK == 2) return dsg::int4::unscale16(acc);
  return acc;
}

// One 16-k chunk of a tile: PACK 2 from one packed row's bytes, PACK 1 from rows g and g + 8.
template <int PACK>
__device__ __forceinline__ void wi4_mma(int (&d)[4], const uint4 (&w)[2], const uint4& x) {
  if constexpr (PACK == 2) dsg::int4::mma_chunk_s4(d, w[0], x);
  else dsg::skinny::mma_chunk_s8(d, w[0], w[1], x);
}

// The accumulator a thread keeps: int32 sums of 16 * q * x (per channel), or float32 sums of
// (int32 sum of a 64-k step) * its group's second-stage scale (GROUP > 0).
template <int GROUP> struct Wi4Acc { typedef int type; };
template <> struct Wi4Acc<256> { typedef float type; };

// (acc * s_w) * s_x from a thread's total: per channel the exact sum, promoted once.
__device__ __forceinline__ float wi4_scale(int total, float sw, float sx) {
  return dsg::skinny::i8_scale(total, sw, sx);
}
__device__ __forceinline__ float wi4_scale(float total, float sw, float sx) {
  return __fmul_rn(__fmul_rn(total, sw), sx);
}

// One pass over the CTA's weights for the expert's pairs order[c0 .. min(c0 + 8 * NT, end)).
// w0 / w1, s0 / s1: the expert's matrices and scales (DOWN: w1 == w0); g0 / g1 their second-stage
// scales [N, KD / GROUP] (GROUP > 0; else unused).  ch0: the CTA's first channel.  VEC: 16-byte weight loads.
template <typename T, int MODE, int N, int KD, int K, int PACK, int GROUP, int NT, int U, bool VEC>
__device__ __forceinline__ void wi4_pass(const signed char* __restrict__ qx, const float* __restrict__ sx,
                                         const signed char* __restrict__ w0, const signed char* __restrict__ w1,
                                         const float* __restrict__ s0, const float* __restrict__ s1,
                                         const float* __restrict__ g0, const float* __restrict__ g1,
                                         const i32* __restrict__ order, int c0, int end, int ch0,
                                         T* __restrict__ out, int* red_words) {
  typedef typename Wi4Acc<GROUP>::type A;
  constexpr int NSTEPS = (KD + WI4_STEP - 1) / WI4_STEP;
  constexpr int QROW = dsg::quant::qrow(KD);
  constexpr int NG = GROUP > 0 ? KD / GROUP : 1;   // second-stage scales a channel
  constexpr int SLICE = WI4_RT * NT * 128;   // one warp's partial sums
  A* red = reinterpret_cast<A*>(red_words);
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int warp = (int)(threadIdx.x >> 5);

  // Each tile's weight rows (PACK 2: one packed row; PACK 1: channels g and g + 8) and, per group, the
  // second-stage scales of the thread's two channels (mma rows g and g + 8).
  const signed char* wr[WI4_RT][2];
  const float* gr[WI4_RT][2];
#pragma unroll
  for (int rt = 0; rt < WI4_RT; ++rt) {
    const signed char* base = (MODE == DOWN || rt == 0) ? w0 : w1;
    const float* gbase = (MODE == DOWN || rt == 0) ? g0 : g1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ch = wi4_channel<MODE, PACK>(ch0, rt, g, h);
      const int row = PACK == 2 ? ch / 2 : ch;
      wr[rt][h] = (ch < N && (PACK == 1 || h == 0)) ? base + (i64)row * KD : nullptr;
      gr[rt][h] = (GROUP > 0 && ch < N) ? gbase + (i64)ch * NG : nullptr;
    }
  }
  const signed char* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int slot = c0 + 8 * nt + g;
    xr[nt] = nullptr;
    if (slot < end) {
      const int p = order[slot];
      xr[nt] = qx + (i64)(MODE == DOWN ? p : p / K) * QROW;
    }
  }

  A acc[WI4_RT][NT][4];
#pragma unroll
  for (int rt = 0; rt < WI4_RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[rt][nt][j] = 0;

  // Steps warp + WI4_WARPS * i in batches of U (a step past the end loads zeros).
  const int my_steps = warp < NSTEPS ? (NSTEPS - warp + WI4_WARPS - 1) / WI4_WARPS : 0;
  const int batches = (my_steps + U - 1) / U;
  for (int b = 0; b < batches; ++b) {
    uint4 wv[U][WI4_RT][2], xv[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (warp + WI4_WARPS * (b * U + u)) * WI4_STEP + 16 * c;
#pragma unroll
      for (int rt = 0; rt < WI4_RT; ++rt)
#pragma unroll
        for (int h = 0; h < PACK % 2 + 1; ++h) wv[u][rt][h] = dsg::skinny::chunk_i8<KD, VEC>(wr[rt][h], k);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xv[u][nt] = dsg::skinny::chunk_qx<KD>(xr[nt], k);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (GROUP == 0) {
#pragma unroll
        for (int rt = 0; rt < WI4_RT; ++rt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) wi4_mma<PACK>(acc[rt][nt], wv[u][rt], xv[u][nt]);
      } else {
        // one 64-k step lies in one group: its exact int32 sums, then promoted with the group's scale
        const int step = warp + WI4_WARPS * (b * U + u);
        if (step < NSTEPS) {
          const int grp = step * WI4_STEP / GROUP;
#pragma unroll
          for (int rt = 0; rt < WI4_RT; ++rt) {
            const float ge = gr[rt][0] != nullptr ? __ldg(gr[rt][0] + grp) : 0.f;
            const float go = gr[rt][1] != nullptr ? __ldg(gr[rt][1] + grp) : 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              int d[4] = {0, 0, 0, 0};
              wi4_mma<PACK>(d, wv[u][rt], xv[u][nt]);
              acc[rt][nt][0] += __fmul_rn((float)wi4_unscale<PACK>(d[0]), ge);
              acc[rt][nt][1] += __fmul_rn((float)wi4_unscale<PACK>(d[1]), ge);
              acc[rt][nt][2] += __fmul_rn((float)wi4_unscale<PACK>(d[2]), go);
              acc[rt][nt][3] += __fmul_rn((float)wi4_unscale<PACK>(d[3]), go);
            }
          }
        }
      }
    }
  }

  A* mine = red + warp * SLICE;
#pragma unroll
  for (int rt = 0; rt < WI4_RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) mine[(rt * NT + nt) * 128 + lane * 4 + j] = acc[rt][nt][j];
  __syncthreads();

  // Element i of a slice: rt, nt, lane l, j -> channel wi4_channel(ch0, rt, l / 4, j / 2), pair slot
  // c0 + 8 * nt + 2 * (l % 4) + j % 2.  GATE_UP_SILU: rt 0 is the gate, rt 1 (i + NT * 128) the up of the
  // same channel and pair.
  auto total = [&](int i) {
    A s = 0;
#pragma unroll
    for (int w = 0; w < WI4_WARPS; ++w) s += red[w * SLICE + i];
    if constexpr (GROUP == 0) s = wi4_unscale<PACK>(s);
    return s;
  };
  constexpr int ITEMS = MODE == DOWN ? SLICE : SLICE / 2;
  for (int i = threadIdx.x; i < ITEMS; i += WI4_THREADS) {
    const int rt = i / (NT * 128), nt = (i / 128) % NT, l = (i % 128) >> 2, j = i & 3;
    const int ch = wi4_channel<MODE, PACK>(ch0, rt, l >> 2, j >> 1);
    const int slot = c0 + 8 * nt + 2 * (l & 3) + (j & 1);
    if (slot >= end || ch >= N) continue;
    const int p = order[slot];
    const float x_scale = sx[MODE == DOWN ? p : p / K];
    T* o = out + (i64)p * N + ch;
    if constexpr (MODE == DOWN) {
      *o = from_float<T>(wi4_scale(total(i), __ldg(s0 + ch), x_scale));
    } else {
      const float gt = round_to<T>(wi4_scale(total(i), __ldg(s0 + ch), x_scale));
      const float up = round_to<T>(wi4_scale(total(i + NT * 128), __ldg(s1 + ch), x_scale));
      const float act = round_to<T>(gt / (1.f + expf(-gt)));
      *o = from_float<T>(act * up);
    }
  }
  __syncthreads();   // red is the next pass's
}

template <typename T, int MODE, int N, int KD, int K, int PACK, int GROUP, bool VEC>
__device__ __forceinline__ void wi4_pairs(const signed char* __restrict__ qx, const float* __restrict__ sx,
                                          const signed char* __restrict__ w0, const signed char* __restrict__ w1,
                                          const float* __restrict__ s0, const float* __restrict__ s1,
                                          const float* __restrict__ g0, const float* __restrict__ g1,
                                          const i32* __restrict__ order, int beg, int end, int ch0,
                                          T* __restrict__ out, int* red) {
  for (int c0 = beg; c0 < end;) {
    const int left = end - c0;
    if (left > 16) {
      wi4_pass<T, MODE, N, KD, K, PACK, GROUP, 4, 2, VEC>(qx, sx, w0, w1, s0, s1, g0, g1, order, c0, end, ch0,
                                                          out, red);
      c0 += 32;
    } else if (left > 8) {
      wi4_pass<T, MODE, N, KD, K, PACK, GROUP, 2, 4, VEC>(qx, sx, w0, w1, s0, s1, g0, g1, order, c0, end, ch0,
                                                          out, red);
      c0 += 16;
    } else {
      wi4_pass<T, MODE, N, KD, K, PACK, GROUP, 1, 4, VEC>(qx, sx, w0, w1, s0, s1, g0, g1, order, c0, end, ch0,
                                                          out, red);
      c0 += 8;
    }
  }
}

// out [NP, N] per pair (module comment), qx [rows, qrow(KD)] / sx [rows] from the quantiser; w0 / w1
// the stacked weights [E, N / PACK, KD] (DOWN: w1 == w0), s0 / s1 their scales [E, N, 1]; GROUP > 0:
// g0 / g1 their second-stage scales [E, N, KD / GROUP] (else null).
template <typename T, int MODE, int E, int N, int KD, int K, int PACK, int GROUP>
__device__ __forceinline__ void grouped_wi4(const signed char* __restrict__ qx, const float* __restrict__ sx,
                                            const signed char* __restrict__ w0, const signed char* __restrict__ w1,
                                            const float* __restrict__ s0, const float* __restrict__ s1,
                                            const float* __restrict__ g0, const float* __restrict__ g1,
                                            const i32* __restrict__ order, const i32* __restrict__ offsets,
                                            T* __restrict__ out) {
  static_assert(MODE == GATE_UP_SILU || MODE == DOWN, "grouped int experts: GATE_UP_SILU or DOWN");
  static_assert(PACK == 1 || (PACK == 2 && N % 2 == 0), "packed int4: two output channels a byte");
  static_assert(KD < 131072, "int x int8: int32 accumulators are exact below KD = 2^17");
  static_assert(GROUP == 0 || (GROUP == 256 && KD % GROUP == 0),
                "per-group int4: groups of 256 input channels, whole ones (a 64-k step lies in one group)");
  static_assert(!dsg::skinny::IsF32<T>::value, "int experts: bf16 or fp16 activations");
  static_assert(sizeof(int) == sizeof(float), "the partial sums share one shared-memory buffer");
  __shared__ __align__(16) int red[WI4_WARPS * WI4_RT * WI4_MAX_NT * 128];
  dsg::pdl_wait();   // the routing and the quantised rows are other kernels' outputs
  dsg::pdl_launch_dependents();
  const int e = nth_light_expert<E, 0>(offsets, blockIdx.y, false);   // warp-uniform, the same in every warp
  const int ch0 = blockIdx.x * wi4_channels(MODE);
  if (e < 0 || ch0 >= N) return;
  const int beg = offsets[e], end = offsets[e + 1];
  const i64 per_expert = (i64)(N / PACK) * KD;
  const signed char* W0 = w0 + e * per_expert;
  const signed char* W1 = (MODE == DOWN ? w0 : w1) + e * per_expert;
  const float* S0 = s0 + (i64)e * N;
  const float* S1 = (MODE == DOWN ? s0 : s1) + (i64)e * N;
  constexpr int NG = GROUP > 0 ? KD / GROUP : 0;
  const float* G0 = GROUP > 0 ? g0 + (i64)e * N * NG : nullptr;
  const float* G1 = GROUP > 0 ? (MODE == DOWN ? g0 : g1) + (i64)e * N * NG : nullptr;
  if constexpr (KD % 16 == 0) {
    if (aligned16(W0) && aligned16(W1)) {
      wi4_pairs<T, MODE, N, KD, K, PACK, GROUP, true>(qx, sx, W0, W1, S0, S1, G0, G1, order, beg, end, ch0, out,
                                                      red);
      DSG_PHASE_EXIT();
      return;
    }
  }
  wi4_pairs<T, MODE, N, KD, K, PACK, GROUP, false>(qx, sx, W0, W1, S0, S1, G0, G1, order, beg, end, ch0, out, red);
  DSG_PHASE_EXIT();   // phases.cuh
}

}  // namespace moe
}  // namespace dsg
