// Skinny linears with FP8 weights (DeepSeek-V3's format fp8_e4m3_block128, ir/formats.py): W[o, i] =
// q[o, i] * s[o / 128, i / 128], q float8_e4m3fn [O, K], s float32 [ceil(O / 128), ceil(K / 128)] (the
// edge blocks partial: "ceil blocks").  y_i[T, O_i] = x[T, K] @ W_i^T for T <= MAX_TOKENS, the same CTA,
// tiles and reduction as the 16-bit kernel (skinny.cuh), which this header reuses for everything past
// the accumulators.
//
// Decode reads each weight byte once, so FP8 halves the bytes a step reads: a 16-byte load is 16
// weights, widened to the activation type in registers (e4m3 -> f16 is exact, and so is f16 -> bf16
// for every e4m3 value: 3 mantissa bits, exponents well inside both ranges), then the 16-bit mma.
//
// The step is 64 k (4 threads x 16 bytes of each row), so a step lies inside one 128-wide K block,
// and a 16-row tile inside one 128-row block of each weight row's own tensor (a tile may straddle two
// stacked weights, so rows g and g + 8 carry their own scale).  Each step's 4 mmas go into a fresh
// accumulator that is scaled by its rows' block scales and added to the running sum: the scales cost
// 4 FMAs and 2 scalar loads a step, and the sum is DeepGEMM's fp32 promotion per K block.
//
// Two pipelines of the weight loads (the lowering picks one per node, codegen/families/linear_skinny.py):
// ROLLING keeps U steps in flight per thread, each slot reloaded as soon as it is widened (deep, for
// shapes with few row tiles per SM); batch loads U steps, computes them, then loads the next U (fewer
// registers: at U = 1 three CTAs an SM, for shapes with many row tiles, such as the gate + up).
//
// Odd widths and views: the 16-byte path needs K % 16 == 0, 16-byte aligned bases and an x row
// stride that keeps rows aligned (tested once per CTA); otherwise element loads.  Rows past O and k
// past K load zeros (and a zero scale), which add nothing.
#pragma once
#include "skinny.cuh"

namespace dsg {
namespace skinny {

constexpr int FP8_STEP = 64;     // k per warp step: 4 threads x 16 weights of each row
constexpr int FP8_BLOCK = 128;   // a scale's rows and columns
static_assert(FP8_BLOCK % FP8_STEP == 0 && FP8_BLOCK % TILE == 0,
              "fp8 skinny linear: a step inside one K block, a tile inside one row block");

// The FP8 weights and their scales of one launch, in stacking order.
template <int N>
struct Fp8Mats {
  const unsigned char* q[N];
  const float* s[N];
};

// Stacked row r -> its weight row and its row of block scales (nullptrs past the last row).  SILU:
// the interleaved gate / up rows of skinny.cuh's weight_row.
template <int K, bool SILU, int... ROWS>
__device__ __forceinline__ void fp8_row(const Fp8Mats<sizeof...(ROWS)>& m, int r, const unsigned char*& q,
                                        const float*& s) {
  constexpr int rows[] = {ROWS...};
  constexpr int KB = (K + FP8_BLOCK - 1) / FP8_BLOCK;
  q = nullptr;
  s = nullptr;
  if constexpr (SILU) {
    static_assert(sizeof...(ROWS) == 2 && rows[0] == rows[1], "gate_up_silu: a gate and an up of one height");
    const int col = (r >> 4) * 8 + (r & 7);
    const int w = (r & 8) ? 1 : 0;
    if (col < rows[0]) {
      q = m.q[w] + (i64)col * K;
      s = m.s[w] + (i64)(col / FP8_BLOCK) * KB;
    }
    return;
  }
  int off = 0;
#pragma unroll
  for (int i = 0; i < (int)sizeof...(ROWS); ++i) {
    if (r >= off && r < off + rows[i]) {
      q = m.q[i] + (i64)(r - off) * K;
      s = m.s[i] + (i64)((r - off) / FP8_BLOCK) * KB;
    }
    off += rows[i];
  }
}

template <typename T, int K, int N>
__device__ __forceinline__ bool fp8_vec_ok(const T* x, i64 x_stride, const Fp8Mats<N>& m) {
  if constexpr (K % 16 != 0) {
    return false;
  } else {
    bool ok = aligned16(x) && x_stride % 8 == 0;
#pragma unroll
    for (int i = 0; i < N; ++i) ok = ok && aligned16(m.q[i]);
    return ok;
  }
}

// row[k .. k + 16) as raw bytes; zeros for a null row and for k >= K.  VEC: one 16-byte load.
template <int K, bool VEC>
__device__ __forceinline__ uint4 chunk_fp8(const unsigned char* row, int k) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (row == nullptr) return v;
  if constexpr (VEC) {
    if (k < K) v = ld_weight16(row + k);
  } else {
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      unsigned word = 0u;
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (k + 4 * j + b < K) word |= (unsigned)row[k + 4 * j + b] << (8 * b);
      w[j] = word;
    }
    v = make_uint4(w[0], w[1], w[2], w[3]);
  }
  return v;
}

// The block scale of a step at k (zero past K: that step's weights are zeros too).
template <int K>
__device__ __forceinline__ float scale_at(const float* s, int k) {
  return (s != nullptr && k < K) ? __ldg(s + k / FP8_BLOCK) : 0.f;
}

// Two e4m3 (the low 16 bits of w, the lower byte first) -> two 16-bit values of type T, packed as the
// mma operand packs a (k, k + 1) pair.  Exact.
template <typename T>
__device__ __forceinline__ unsigned widen2(unsigned w) {
  unsigned h;
  asm("{\n .reg .b16 lo;\n cvt.u16.u32 lo, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(h) : "r"(w));
  if constexpr (dsg::mma::MmaType<T>::BF16) {
    const __half2 hv = *reinterpret_cast<const __half2*>(&h);
    const __nv_bfloat162 b = __floats2bfloat162_rn(__low2float(hv), __high2float(hv));
    return *reinterpret_cast<const unsigned*>(&b);
  } else {
    return h;
  }
}

// 8 e4m3 (two words) -> 8 values of T as the uint4 a 16-bit chunk is (skinny.cuh's chunk16).
template <typename T>
__device__ __forceinline__ uint4 widen8(unsigned lo, unsigned hi) {
  return make_uint4(widen2<T>(lo), widen2<T>(lo >> 16), widen2<T>(hi), widen2<T>(hi >> 16));
}

// One CTA's RT row tiles with NT n8 token tiles; partial sums to red as skinny.cuh's mma_tiles lays
// them out (so its mma_store sums and stores them).
template <typename T, int K, int WARPS, int RT, int U, bool ROLLING, int NT, bool VEC, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void fp8_tiles(const T* __restrict__ x, i64 x_stride, const Fp8Mats<sizeof...(ROWS)>& m,
                                          int ntok, int row0, float* red) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int NSTEPS = (K + FP8_STEP - 1) / FP8_STEP;
  constexpr int NW = KS * WARPS;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int warp = (KS > 1 ? (int)cluster::rank() * WARPS : 0) + (int)(threadIdx.x >> 5);
  const unsigned char* wr[RT][2];
  const float* sr[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) fp8_row<K, SILU, ROWS...>(m, row0 + rt * TILE + g + 8 * h, wr[rt][h], sr[rt][h]);
  const T* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = g + 8 * nt;
    xr[nt] = tok < ntok ? x + (i64)tok * x_stride : nullptr;
  }
  const int my_steps = warp < NSTEPS ? (NSTEPS - warp + NW - 1) / NW : 0;
  const int batches = (my_steps + U - 1) / U;
  // Step i of this warp starts at k = step_k(i); a step past the last loads zeros (no access).
  auto step_k = [&](int i) { return (warp + NW * i) * FP8_STEP; };

  float acc[RT][NT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[rt][nt][j] = 0.f;

  // Slot u of the U in registers: a step's 16 weight bytes of rows g and g + 8 of each tile and their
  // scales.  The scale is the step's (one K block a step: every thread of the quad takes the same
  // one, whichever k its own bytes start at).
  uint4 wv[U][RT][2];
  float sv[U][RT][2];
  auto load_step = [&](int i, int u) {
    const int k = step_k(i);
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wv[u][rt][h] = chunk_fp8<K, VEC>(wr[rt][h], k + 16 * c);
        sv[u][rt][h] = scale_at<K>(sr[rt][h], k);
      }
  };
  auto load_x = [&](int k, uint4 (&xv)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) xv[nt][half] = chunk16<T, K, VEC, false>(xr[nt], k + 8 * half);
  };
  // acc += the step in slot u (k: this thread's first k of it) times its scales.  ROLLING: the slot is
  // reloaded with step `next` as soon as it is widened, and x is loaded an n8 tile at a time then
  // (fewer live registers); batch: x comes loaded (`pre`).
  auto compute = [&](int u, int next, int k, const uint4 (&pre)[NT][2]) {
    uint4 wide[RT][2][2];
    float sc[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wide[rt][h][0] = widen8<T>(wv[u][rt][h].x, wv[u][rt][h].y);
        wide[rt][h][1] = widen8<T>(wv[u][rt][h].z, wv[u][rt][h].w);
        sc[rt][h] = sv[u][rt][h];
      }
    if constexpr (ROLLING) load_step(next, u);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      uint4 x0 = pre[nt][0], x1 = pre[nt][1];
      if constexpr (ROLLING) x0 = chunk16<T, K, VEC, false>(xr[nt], k), x1 = chunk16<T, K, VEC, false>(xr[nt], k + 8);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        float p[4] = {0.f, 0.f, 0.f, 0.f};
        mma_chunk<BF16>(p, wide[rt][0][0], wide[rt][1][0], x0);
        mma_chunk<BF16>(p, wide[rt][0][1], wide[rt][1][1], x1);
        // c0 c1 are row g, c2 c3 row g + 8
        acc[rt][nt][0] = fmaf(p[0], sc[rt][0], acc[rt][nt][0]);
        acc[rt][nt][1] = fmaf(p[1], sc[rt][0], acc[rt][nt][1]);
        acc[rt][nt][2] = fmaf(p[2], sc[rt][1], acc[rt][nt][2]);
        acc[rt][nt][3] = fmaf(p[3], sc[rt][1], acc[rt][nt][3]);
      }
    }
  };
  // Weights and scales are static: the first batch is in flight while the kernel before drains (PDL).
#pragma unroll
  for (int u = 0; u < U; ++u) load_step(u, u);
  dsg::pdl_wait();
  for (int b = 0; b < batches; ++b) {
    if constexpr (ROLLING) {
      // Each slot is reloaded with the next batch's step as soon as it is widened: U loads stay in
      // flight while the warp computes (no second set of registers).
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint4 none[NT][2] = {};
        compute(u, (b + 1) * U + u, step_k(b * U + u) + 16 * c, none);
      }
    } else {
      // The batch's x first (all U steps' loads in flight together), then its mmas, then the next
      // batch's weights: fewer registers (three CTAs an SM at U = 1), nothing in flight while computing.
      uint4 xv[U][NT][2];
#pragma unroll
      for (int u = 0; u < U; ++u) load_x(step_k(b * U + u) + 16 * c, xv[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) compute(u, 0, 0, xv[u]);
      if (b + 1 < batches) {
#pragma unroll
        for (int u = 0; u < U; ++u) load_step((b + 1) * U + u, u);
      }
    }
  }
  dsg::pdl_launch_dependents();
  float* mine = red + (threadIdx.x >> 5) * (RT * NT * 128);
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<float4*>(mine + (rt * NT + nt) * 128 + lane * 4) =
          make_float4(acc[rt][nt][0], acc[rt][nt][1], acc[rt][nt][2], acc[rt][nt][3]);
}

// y_i = x @ (q_i * s_i)^T for ntok <= MAX_TOKENS tokens; `out` holds the outputs (its weights are
// unused).  T: bf16 or fp16 activations.
template <typename T, int K, int WARPS, int RT, int U, bool ROLLING, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void linear_fp8(const T* __restrict__ x, i64 x_stride,
                                           const Fp8Mats<sizeof...(ROWS)>& m, const Mats<T, sizeof...(ROWS)>& out,
                                           int ntok, float* red) {
  static_assert(!IsF32<T>::value, "fp8 skinny linear: bf16 or fp16 activations");
  static_assert(WARPS >= 1 && RT >= 1 && U >= 1, "skinny linear: at least one warp, row tile and step a batch");
  static_assert(KS == 1 || KS == 2 || KS == 4 || KS == 8, "skinny linear: a cluster of 1, 2, 4 or 8 CTAs");
  const int row0 = (blockIdx.x / KS) * RT * TILE;
  const bool vec = fp8_vec_ok<T, K, (int)sizeof...(ROWS)>(x, x_stride, m);
  if (ntok <= 8) {
    if (vec) fp8_tiles<T, K, WARPS, RT, U, ROLLING, 1, true, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    else fp8_tiles<T, K, WARPS, RT, U, ROLLING, 1, false, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    mma_store<T, WARPS, RT, 1, KS, SILU, ROWS...>(out, ntok, row0, red);
  } else {
    if (vec) fp8_tiles<T, K, WARPS, RT, U, ROLLING, 2, true, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    else fp8_tiles<T, K, WARPS, RT, U, ROLLING, 2, false, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    mma_store<T, WARPS, RT, 2, KS, SILU, ROWS...>(out, ntok, row0, red);
  }
  DSG_PHASE_EXIT();   // phases.cuh
}

}  // namespace skinny
}  // namespace dsg
