// Skinny linears with int8 weights and int8 activations (msModelSlim W8A8_DYNAMIC, ir/formats.py
// int8_channel; the arithmetic is ir/formats_int.py int_linear's):
//
//   acc[t, o] = sum_k qx[t, k] * qw[o, k]                 exact: int32 (|acc| <= K * 2^14 < 2^31 for K < 131072)
//   y[t, o]   = (float(acc) * s_w[o]) * s_x[t]            two correctly rounded products, no FMA
//   out       = y rounded to the activation type
//
// so every output is bit-equal to the reference's (the int32 sum equals its int64 sum, int -> float
// rounds to nearest even in both, and the products are separate __fmul_rn).  qx / s_x come from the
// per-token quantiser (quant_int8.cuh): rows of qrow(K) bytes, zero padded, 16-byte aligned.
//
// The CTA, tiles, warps and swap-AB of the 16-bit kernel (skinny.cuh): the weight rows are the mma's
// M side, the T <= 16 tokens its N side (one or two n8 tiles).  mma.m16n8k32.s32.s8.s8 with the
// fragments loaded straight from global memory: thread (g = lane / 4, c = lane % 4) loads 16
// consecutive bytes at k0 = 64 * step + 16 * c of weight rows g and g + 8 and of token row g; words
// 0, 1 (and 2, 3) of the three loads are one k32 mma's a0..a3 / b0, b1.  The k order inside a step is
// permuted, identically for A and B, which a dot product does not see.  Step = 64 k.
//
// The warps' int32 partial sums meet in shared memory (exact in any order), then the epilogue.  No
// cluster split of K (KS = 1): the integer sums would need their own distributed reduction.
// SILU (gate_up_silu): gate and up rows interleaved 8 by 8 as in skinny.cuh; each is rounded to
// the activation type after its own scales, then silu(gate) * up as skinny.cuh's store_silu.
//
// Odd widths and views: the 16-byte weight loads need K % 16 == 0 and 16-byte aligned weights
// (tested once a CTA), else byte loads; k past K loads zeros; rows past O load nothing and are not
// stored.
#pragma once
#include "imma.cuh"
#include "quant_int8.cuh"
#include "skinny.cuh"

namespace dsg {
namespace skinny {

constexpr int I8_STEP = 64;   // k per warp step: 4 threads x 16 bytes of each row

// The int8 weights and their per-channel scales (the "_scale" companions, [O_i, 1] float32) of one
// launch, in stacking order (the outputs are a skinny.cuh Mats whose weights are unused).
template <int N>
struct I8Mats {
  const signed char* w[N];
  const float* s[N];
};

// d += W rows (g, g + 8) x token row g over the 16 k of one chunk: two k32 mmas (see the top).
__device__ __forceinline__ void mma_chunk_s8(int (&d)[4], const uint4& wg, const uint4& wg8, const uint4& xv) {
  dsg::mma::mma16832_s8(d, wg.x, wg8.x, wg.y, wg8.y, xv.x, xv.y);
  dsg::mma::mma16832_s8(d, wg.z, wg8.z, wg.w, wg8.w, xv.z, xv.w);
}

// Stacked row r -> its weight row and its scale (nullptrs past the last row).  SILU: skinny.cuh's
// interleaved gate / up rows.
template <int K, bool SILU, int... ROWS>
__device__ __forceinline__ void i8_row(const I8Mats<sizeof...(ROWS)>& m, int r, const signed char*& w,
                                       const float*& s) {
  constexpr int rows[] = {ROWS...};
  w = nullptr;
  s = nullptr;
  if constexpr (SILU) {
    static_assert(sizeof...(ROWS) == 2 && rows[0] == rows[1], "gate_up_silu: a gate and an up of one height");
    const int col = (r >> 4) * 8 + (r & 7);
    const bool up = (r & 8) != 0;   // a select, not an index: the struct stays in registers
    if (col < rows[0]) {
      w = (up ? m.w[1] : m.w[0]) + (i64)col * K;
      s = (up ? m.s[1] : m.s[0]) + col;
    }
    return;
  }
  int off = 0;
#pragma unroll
  for (int i = 0; i < (int)sizeof...(ROWS); ++i) {
    if (r >= off && r < off + rows[i]) {
      w = m.w[i] + (i64)(r - off) * K;
      s = m.s[i] + (r - off);
    }
    off += rows[i];
  }
}

template <int K, int N>
__device__ __forceinline__ bool i8_vec_ok(const I8Mats<N>& m) {
  if constexpr (K % 16 != 0) {
    return false;
  } else {
    bool ok = true;
#pragma unroll
    for (int i = 0; i < N; ++i) ok = ok && aligned16(m.w[i]);
    return ok;
  }
}

// Weight row[k .. k + 16) as raw bytes; zeros for a null row and for k >= K.  VEC: one 16-byte load
// (K % 16 == 0: a chunk is whole or past the end); else byte loads.
template <int K, bool VEC>
__device__ __forceinline__ uint4 chunk_i8(const signed char* row, int k) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (row == nullptr) return v;
  if constexpr (VEC) {
    if (k < K) v = ld_weight16(row + k);
  } else {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(row);
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      unsigned word = 0u;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (k + 4 * j + e < K) word |= (unsigned)b[k + 4 * j + e] << (8 * e);
      w[j] = word;
    }
    v = make_uint4(w[0], w[1], w[2], w[3]);
  }
  return v;
}

// A quantised token row's [k .. k + 16): always a 16-byte load (rows are qrow(K) bytes, zero padded
// and aligned); zeros for a token past T (null) and for k >= K.
template <int K>
__device__ __forceinline__ uint4 chunk_qx(const signed char* row, int k) {
  return (row != nullptr && k < K) ? *reinterpret_cast<const uint4*>(row + k) : make_uint4(0u, 0u, 0u, 0u);
}

// One CTA's RT row tiles with NT n8 token tiles; int32 partial sums to red (this warp's slice),
// laid out as skinny.cuh's mma_tiles lays its floats: [warp][rt][nt][lane][4].
template <int K, int WARPS, int RT, int U, int NT, bool VEC, bool SILU, int... ROWS>
__device__ __forceinline__ void i8_tiles(const signed char* __restrict__ qx, const I8Mats<sizeof...(ROWS)>& m,
                                         int ntok, int row0, int* red) {
  constexpr int NSTEPS = (K + I8_STEP - 1) / I8_STEP;
  constexpr int QROW = dsg::quant::qrow(K);
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int warp = (int)(threadIdx.x >> 5);
  const signed char* wr[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float* unused;
      i8_row<K, SILU, ROWS...>(m, row0 + rt * TILE + g + 8 * h, wr[rt][h], unused);
    }
  const signed char* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = g + 8 * nt;
    xr[nt] = tok < ntok ? qx + (i64)tok * QROW : nullptr;
  }
  // Steps warp + WARPS * i, i < my_steps, in batches of U (a step past the end loads zeros).
  const int my_steps = warp < NSTEPS ? (NSTEPS - warp + WARPS - 1) / WARPS : 0;
  const int batches = (my_steps + U - 1) / U;
  auto k_of = [&](int b, int u) { return (warp + WARPS * (b * U + u)) * I8_STEP + 16 * c; };

  int acc[RT][NT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[rt][nt][j] = 0;

  uint4 wv[U][RT][2];
  auto load_weights = [&](int b) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][rt][h] = chunk_i8<K, VEC>(wr[rt][h], k_of(b, u));
  };
  // Weights are static: the first batch is in flight while the quantiser drains (PDL); qx is its
  // output, read only after the wait.
  load_weights(0);
  dsg::pdl_wait();
  for (int b = 0; b < batches;) {
    uint4 xv[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xv[u][nt] = chunk_qx<K>(xr[nt], k_of(b, u));
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_chunk_s8(acc[rt][nt], wv[u][rt][0], wv[u][rt][1], xv[u][nt]);
    if (++b < batches) load_weights(b);
  }
  dsg::pdl_launch_dependents();
  int* mine = red + warp * (RT * NT * 128);
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<int4*>(mine + (rt * NT + nt) * 128 + lane * 4) =
          make_int4(acc[rt][nt][0], acc[rt][nt][1], acc[rt][nt][2], acc[rt][nt][3]);
}

// (float(acc) * s_w) * s_x, the two products rounded apart (quant_int8.cuh dequant).
__device__ __forceinline__ float i8_scale(int acc, float sw, float sx) { return dsg::quant::dequant(acc, sw, sx); }

// Sum the warps' int32 partial sums (element i of a slice: rt, nt, lane, j -> row rt * 16 + lane / 4
// + 8 * (j / 2), token 8 * nt + 2 * (lane % 4) + j % 2), scale and store.  SILU: c0 c1 (i % 4 < 2)
// are a gate row, c2 c3 (i + 2) the up row of the same output column.
template <typename T, int K, int WARPS, int RT, int NT, bool SILU, int... ROWS>
__device__ __forceinline__ void i8_store(const I8Mats<sizeof...(ROWS)>& m, const Mats<T, sizeof...(ROWS)>& out,
                                         const float* __restrict__ sx, int ntok, int row0, int* red) {
  constexpr int SLICE = RT * NT * 128;
  constexpr int rows[] = {ROWS...};
  __syncthreads();
  auto total = [&](int i) {
    int s = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[w * SLICE + i];
    return s;
  };
  auto where = [&](int i, int& row, int& tok) {
    const int rt = i / (NT * 128), nt = (i / 128) % NT, l = (i % 128) >> 2, j = i & 3;
    row = row0 + rt * TILE + (l >> 2) + 8 * (j >> 1);
    tok = 8 * nt + 2 * (l & 3) + (j & 1);
  };
  for (int i = threadIdx.x; i < SLICE; i += WARPS * 32) {
    if (SILU && (i & 2)) continue;   // an up row: its gate's thread takes it
    int row, tok;
    where(i, row, tok);
    if (tok >= ntok) continue;
    const signed char* w;
    const float* s;
    i8_row<K, SILU, ROWS...>(m, row, w, s);
    if (s == nullptr) continue;
    const float x_scale = sx[tok];
    if constexpr (SILU) {
      const signed char* wu;
      const float* su;
      i8_row<K, SILU, ROWS...>(m, row + 8, wu, su);
      store_silu<T, rows[0]>(out, row, tok, i8_scale(total(i), __ldg(s), x_scale),
                             i8_scale(total(i + 2), __ldg(su), x_scale));
    } else {
      store_out<T, ROWS...>(out, row, tok, i8_scale(total(i), __ldg(s), x_scale));
    }
  }
}

// y_i = dequant(qx, s_x) @ dequant(W_i, s_i)^T with the exact integer arithmetic above, for
// ntok <= MAX_TOKENS tokens (the lowering's grid is 0 above).  T: bf16 or fp16 outputs.
template <typename T, int K, int WARPS, int RT, int U, bool SILU, int... ROWS>
__device__ __forceinline__ void linear_i8(const signed char* __restrict__ qx, const float* __restrict__ sx,
                                          const I8Mats<sizeof...(ROWS)>& m, const Mats<T, sizeof...(ROWS)>& out,
                                          int ntok, int* red) {
  static_assert(!IsF32<T>::value, "int8 skinny linear: bf16 or fp16 outputs");
  static_assert(WARPS >= 1 && RT >= 1 && U >= 1, "skinny linear: at least one warp, row tile and step a batch");
  static_assert(K < 131072, "int8 skinny linear: int32 accumulators are exact below K = 2^17");
  const int row0 = blockIdx.x * RT * TILE;
  const bool vec = i8_vec_ok<K, (int)sizeof...(ROWS)>(m);
  if (ntok <= 8) {
    if (vec) i8_tiles<K, WARPS, RT, U, 1, true, SILU, ROWS...>(qx, m, ntok, row0, red);
    else i8_tiles<K, WARPS, RT, U, 1, false, SILU, ROWS...>(qx, m, ntok, row0, red);
    i8_store<T, K, WARPS, RT, 1, SILU, ROWS...>(m, out, sx, ntok, row0, red);
  } else {
    if (vec) i8_tiles<K, WARPS, RT, U, 2, true, SILU, ROWS...>(qx, m, ntok, row0, red);
    else i8_tiles<K, WARPS, RT, U, 2, false, SILU, ROWS...>(qx, m, ntok, row0, red);
    i8_store<T, K, WARPS, RT, 2, SILU, ROWS...>(m, out, sx, ntok, row0, red);
  }
  DSG_PHASE_EXIT();   // phases.cuh
}

}  // namespace skinny
}  // namespace dsg
