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
template <typename T, int K, int WARPS, int RT, int U, int NT, bool VEC, int KS, bool SILU, int... ROWS>
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
  auto k_of = [&](int b, int u) { return (warp + NW * (b * U + u)) * FP8_STEP + 16 * c; };

  float acc[RT][NT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[rt][nt][j] = 0.f;

  uint4 wv[U][RT][2];
  float sv[U][RT][2];
  auto load_weights = [&](int b) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wv[u][rt][h] = chunk_fp8<K, VEC>(wr[rt][h], k_of(b, u));
          sv[u][rt][h] = scale_at<K>(sr[rt][h], k_of(b, u));
        }
  };
  // Weights and scales are static: the first batch is in flight while the kernel before drains (PDL).
  load_weights(0);
  dsg::pdl_wait();
  for (int b = 0; b < batches;) {
    uint4 xv[U][NT][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) xv[u][nt][half] = chunk16<T, K, VEC, false>(xr[nt], k_of(b, u) + 8 * half);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const uint4 g0 = widen8<T>(wv[u][rt][0].x, wv[u][rt][0].y), g1 = widen8<T>(wv[u][rt][0].z, wv[u][rt][0].w);
        const uint4 h0 = widen8<T>(wv[u][rt][1].x, wv[u][rt][1].y), h1 = widen8<T>(wv[u][rt][1].z, wv[u][rt][1].w);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float p[4] = {0.f, 0.f, 0.f, 0.f};
          mma_chunk<BF16>(p, g0, h0, xv[u][nt][0]);
          mma_chunk<BF16>(p, g1, h1, xv[u][nt][1]);
          // c0 c1 are row g, c2 c3 row g + 8
          acc[rt][nt][0] = fmaf(p[0], sv[u][rt][0], acc[rt][nt][0]);
          acc[rt][nt][1] = fmaf(p[1], sv[u][rt][0], acc[rt][nt][1]);
          acc[rt][nt][2] = fmaf(p[2], sv[u][rt][1], acc[rt][nt][2]);
          acc[rt][nt][3] = fmaf(p[3], sv[u][rt][1], acc[rt][nt][3]);
        }
      }
    if (++b < batches) load_weights(b);
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
template <typename T, int K, int WARPS, int RT, int U, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void linear_fp8(const T* __restrict__ x, i64 x_stride,
                                           const Fp8Mats<sizeof...(ROWS)>& m, const Mats<T, sizeof...(ROWS)>& out,
                                           int ntok, float* red) {
  static_assert(!IsF32<T>::value, "fp8 skinny linear: bf16 or fp16 activations");
  static_assert(WARPS >= 1 && RT >= 1 && U >= 1, "skinny linear: at least one warp, row tile and step a batch");
  static_assert(KS == 1 || KS == 2 || KS == 4 || KS == 8, "skinny linear: a cluster of 1, 2, 4 or 8 CTAs");
  const int row0 = (blockIdx.x / KS) * RT * TILE;
  const bool vec = fp8_vec_ok<T, K, (int)sizeof...(ROWS)>(x, x_stride, m);
  if (ntok <= 8) {
    if (vec) fp8_tiles<T, K, WARPS, RT, U, 1, true, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    else fp8_tiles<T, K, WARPS, RT, U, 1, false, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    mma_store<T, WARPS, RT, 1, KS, SILU, ROWS...>(out, ntok, row0, red);
  } else {
    if (vec) fp8_tiles<T, K, WARPS, RT, U, 2, true, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    else fp8_tiles<T, K, WARPS, RT, U, 2, false, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    mma_store<T, WARPS, RT, 2, KS, SILU, ROWS...>(out, ntok, row0, red);
  }
  DSG_PHASE_EXIT();   // phases.cuh
}

}  // namespace skinny
}  // namespace dsg
