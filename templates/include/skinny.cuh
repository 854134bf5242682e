// Skinny linears: y_i[T, O_i] = x[T, K] @ W_i[O_i, K]^T for T <= MAX_TOKENS (decode's batches), one
// launch for one weight or a few stacked ones (multi_linear: siblings that read the same x).
//
// Memory-bound: each weight byte is read once, with 16-byte loads straight into registers (no shared
// memory for weights), many in flight per thread.  Bytes per CTA and the launch count are what matter;
// the tensor cores only keep the arithmetic off the critical path ("swap-AB": the weight rows are the
// mma's M side, the few tokens its N side, so padding T up to 8 or 16 costs nothing).
//
// CTA = WARPS warps over RT row tiles of 16 stacked weight rows (grid x = KS x cdiv(O, 16 * RT)).  K is
// cut in 32-wide steps; warp w takes steps w, w + WARPS, ... (the CTA streams 512 contiguous bytes of
// each row per round), every warp over all RT tiles, so x is read once per CTA per step.  The warps'
// partial sums meet in shared memory at the end (one barrier), and one thread sums each output in
// warp order (deterministic) and rounds it once to the activation type.
//
// mma.m16n8k16 fragments without shared memory (bf16 / fp16): thread (g = lane / 4, c = lane % 4)
// loads 8 consecutive k at k0 = 32 * step + 8 * c of weight rows g and g + 8 and of token row g.  A
// dot product does not care about the order of k, so A and B only need the same permutation: words
// 0 and 1 of the three 16-byte loads are the (k = 2c, 2c + 1) and (2c + 8, 2c + 9) pairs of one
// k16 mma, words 2 and 3 those of a second.  Tokens 8..15 (T > 8) are a second n8 tile.
//
// KS > 1 (a variant for shapes with few row tiles, e.g. o_proj's 128 on 132 SMs): a cluster of KS
// CTAs shares one tile set, its KS x WARPS warps splitting K; each CTA sums its own warps, and after
// a cluster barrier each sums 1/KS of the outputs over the cluster's CTAs through distributed shared
// memory (no workspace, no counter, no second launch; a second barrier keeps every CTA's shared
// memory alive until the others have read it).
//
// fp32 (no tensor cores): the same tiles and steps on CUDA cores, each thread holding its two rows'
// partial dot products for every token, summed over the four threads of a row with shuffles.
//
// SILU (gate_up_silu): the two weights are a gate and an up of n rows each, interleaved so that tile
// t holds gate rows 8t .. 8t + 8 as its rows 0..7 and the same up rows as its rows 8..15: a thread's
// accumulators for row g and row g + 8 (mma c0 c1 / c2 c3; fp32: h = 0 / 1) are the gate and up of
// one output column, and the epilogue writes silu(gate) * up, rounding where the unfused ops round.
//
// Odd widths and views: the 16-byte path needs K % 8 == 0 (fp32: % 4), 16-byte aligned bases and an
// x row stride that keeps rows aligned; a CTA tests that once and otherwise takes element loads.
// Rows past O and tokens past T load zeros (no access) and are not stored.
#pragma once
#include "cluster.cuh"
#include "common.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "vec.cuh"

namespace dsg {
namespace skinny {

constexpr int TILE = 16;         // weight rows per mma tile
constexpr int STEP = 32;         // k per warp step: 4 threads x 8 elements of each row
constexpr int MAX_TOKENS = 16;   // two n8 tiles

template <typename T> struct IsF32 { static constexpr bool value = false; };
template <> struct IsF32<float> { static constexpr bool value = true; };

// The weights and outputs of one launch, in stacking order (weight i's rows follow weight i - 1's).
template <typename T, int N>
struct Mats {
  const T* w[N];
  T* y[N];
};

// The skinny kernels past MAX_TOKENS run in chunks of MAX_TOKENS tokens along grid.y (fp8_chunks.cuh,
// int8_chunks.cuh); chunk blockIdx.y starts at token t0.  Its outputs: `mine`, the caller's __shared__ copy of
// out with each of the NOUT outputs (rows[i] elements a token) offset by t0 rows.  Thread 0 writes it and only
// the store reads it, after the barrier that starts the store, so the pointers hold no registers through the
// weight loop (in registers they pushed o_proj's FP8 kernel past its 128 and spilled).
template <int NOUT, typename T, int N>
__device__ __forceinline__ void chunk_outputs(const Mats<T, N>& out, Mats<T, N>& mine, const int (&rows)[N], int t0) {
  if (threadIdx.x == 0) {
    mine = out;
#pragma unroll
    for (int i = 0; i < NOUT; ++i) mine.y[i] = out.y[i] + (i64)t0 * rows[i];
  }
}

// Floats of shared memory for the warps' partial sums (both paths use the same amount), and with
// KS > 1 the CTA's own sum that the cluster reads.
__host__ __device__ constexpr int red_floats(int warps, int rt, int ks) {
  return (warps + (ks > 1 ? 1 : 0)) * rt * TILE * MAX_TOKENS;
}

// Sum the partial sums red[w * SLICE + i] of the WARPS warps (and, KS > 1, of the cluster's CTAs)
// and hand them to store, in a fixed order (deterministic): store(i, s) for each i, or with PAIR > 0
// store(i, s_i, s_{i + PAIR}) for each i with (i & PAIR) == 0 (SILU: a gate sum and its up's).
// Starts with the barrier that publishes the callers' writes to red.
template <int WARPS, int KS, int SLICE, int PAIR, typename Store>
__device__ __forceinline__ void reduce_store(float* red, Store&& store) {
  static_assert(PAIR == 0 || (SLICE % (2 * PAIR) == 0 && (PAIR & (PAIR - 1)) == 0),
                "skinny linear: pairs are (i, i + PAIR) inside blocks of 2 * PAIR");
  constexpr int JOBS = PAIR ? SLICE / 2 : SLICE;        // one output (or gate / up pair) each
  auto first = [](int j) { return PAIR ? (j / PAIR) * 2 * PAIR + j % PAIR : j; };
  __syncthreads();
  float* sums = red;                                    // KS == 1: the warps' partial sums
  if constexpr (KS > 1) {
    sums = red + WARPS * SLICE;                         // this CTA's sums, read by the cluster
    for (int i = threadIdx.x; i < SLICE; i += WARPS * 32) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += red[w * SLICE + i];
      sums[i] = s;
    }
    cluster::sync();
  }
  auto total = [&](int i) {
    float s = 0.f;
    if constexpr (KS == 1) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += sums[w * SLICE + i];
    } else {
#pragma unroll
      for (int q = 0; q < KS; ++q) s += cluster::ld<true>(cluster::map_rank(smem_u32(sums + i), (unsigned)q));
    }
    return s;
  };
  static_assert(JOBS % KS == 0, "skinny linear: the cluster's CTAs take equal shares of the outputs");
  const int base = KS > 1 ? (int)cluster::rank() * (JOBS / KS) : 0;
  for (int j = base + (int)threadIdx.x; j < base + JOBS / KS; j += WARPS * 32) {
    const int i = first(j);
    if constexpr (PAIR) store(i, total(i), total(i + PAIR));
    else store(i, total(i));
  }
  if constexpr (KS > 1) cluster::sync();   // no CTA leaves while the others read its sums
}

// Stacked row r -> weight row pointer (nullptr past the last row).  ROWS... are the O_i; SILU: the
// interleaved gate / up rows (the top).
template <typename T, int K, bool SILU, int... ROWS>
__device__ __forceinline__ const T* weight_row(const Mats<T, sizeof...(ROWS)>& m, int r) {
  constexpr int rows[] = {ROWS...};
  if constexpr (SILU) {
    static_assert(sizeof...(ROWS) == 2 && rows[0] == rows[1], "gate_up_silu: a gate and an up of one height");
    const int col = (r >> 4) * 8 + (r & 7);
    return col < rows[0] ? ((r & 8) ? m.w[1] : m.w[0]) + (i64)col * K : nullptr;
  }
  const T* p = nullptr;
  int off = 0;
#pragma unroll
  for (int i = 0; i < (int)sizeof...(ROWS); ++i) {
    if (r >= off && r < off + rows[i]) p = m.w[i] + (i64)(r - off) * K;
    off += rows[i];
  }
  return p;
}

// y_i[tok, r - off_i] = v for the weight i that holds stacked row r (nothing past the last row).
template <typename T, int... ROWS>
__device__ __forceinline__ void store_out(const Mats<T, sizeof...(ROWS)>& m, int r, int tok, float v) {
  constexpr int rows[] = {ROWS...};
  int off = 0;
#pragma unroll
  for (int i = 0; i < (int)sizeof...(ROWS); ++i) {
    if (r >= off && r < off + rows[i]) m.y[i][(i64)tok * rows[i] + (r - off)] = from_float<T>(v);
    off += rows[i];
  }
}

// y_0[tok, col] = silu(gate) * up for SILU's stacked row r (a gate row: r % 16 < 8), rounding gate,
// up and silu(gate) to T first, as the unfused linear, linear and silu_and_mul do.
template <typename T, int N>
__device__ __forceinline__ void store_silu(const Mats<T, 2>& m, int r, int tok, float gate, float up) {
  const int col = (r >> 4) * 8 + (r & 7);
  if (col >= N) return;
  const float g = round_to<T>(gate), u = round_to<T>(up);
  const float s = round_to<T>(g / (1.f + expf(-g)));
  m.y[0][(i64)tok * N + col] = from_float<T>(s * u);
}

// Whether the CTA can take 16-byte loads: every base aligned, x rows a whole number of vectors apart.
template <typename T, int K, int N>
__device__ __forceinline__ bool vec_ok(const T* x, i64 x_stride, const Mats<T, N>& m) {
  constexpr int V = 16 / (int)sizeof(T);
  if constexpr (K % V != 0) {
    return false;
  } else {
    bool ok = aligned16(x) && x_stride % V == 0;
#pragma unroll
    for (int i = 0; i < N; ++i) ok = ok && aligned16(m.w[i]);
    return ok;
  }
}

// ---- 16-bit types: 8 elements as one uint4 (4 words of 2) --------------------------------------

// A weight chunk: streamed once, so it skips L1 (x lives there) and asks L2 for whole 128-byte lines
// (the neighbouring warp reads the other half of the line).  Volatile: the first batch is issued
// before pdl_wait and must stay there.
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// row[k .. k + 8) as raw 16-bit words; zeros for a null row and for k >= K.  VEC: one 16-byte load
// (K % 8 == 0, so a chunk is whole or past the end); else element loads (any K, any alignment).
template <typename T, int K, bool VEC, bool WEIGHT>
__device__ __forceinline__ uint4 chunk16(const T* row, int k) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if constexpr (VEC) {
    if (row != nullptr && k < K) {
      if constexpr (WEIGHT) v = ld_weight16(row + k);
      else v = *reinterpret_cast<const uint4*>(row + k);
    }
  } else {
    if (row != nullptr) {
      const unsigned short* e = reinterpret_cast<const unsigned short*>(row);
      unsigned w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned lo = (k + 2 * j < K) ? e[k + 2 * j] : 0u;
        const unsigned hi = (k + 2 * j + 1 < K) ? e[k + 2 * j + 1] : 0u;
        w[j] = lo | (hi << 16);
      }
      v = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  return v;
}

// d += W rows (g, g + 8) x token row g over the 8 k of one chunk: two k16 mmas (see the top).
template <bool BF16>
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4& wg, const uint4& wg8, const uint4& xv) {
  const unsigned a0[4] = {wg.x, wg8.x, wg.y, wg8.y};
  dsg::mma::mma16816<BF16>(d, a0, xv.x, xv.y);
  const unsigned a1[4] = {wg.z, wg8.z, wg.w, wg8.w};
  dsg::mma::mma16816<BF16>(d, a1, xv.z, xv.w);
}

// One CTA's RT row tiles with NT n8 token tiles; partial sums to red (this warp's slice), laid out as
// [warp][rt][nt][lane][4] (an mma accumulator per lane).
template <typename T, int K, int WARPS, int RT, int U, int NT, bool VEC, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void mma_tiles(const T* __restrict__ x, i64 x_stride, const Mats<T, sizeof...(ROWS)>& m,
                                          int ntok, int row0, float* red) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int NSTEPS = (K + STEP - 1) / STEP;
  constexpr int NW = KS * WARPS;                       // warps splitting K: the cluster's
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int warp = (KS > 1 ? (int)cluster::rank() * WARPS : 0) + (int)(threadIdx.x >> 5);
  const T* wr[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) wr[rt][h] = weight_row<T, K, SILU, ROWS...>(m, row0 + rt * TILE + g + 8 * h);
  const T* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = g + 8 * nt;
    xr[nt] = tok < ntok ? x + (i64)tok * x_stride : nullptr;
  }
  // Steps warp + NW * i, i < my_steps, in batches of U (a step past the end loads zeros).
  const int my_steps = warp < NSTEPS ? (NSTEPS - warp + NW - 1) / NW : 0;
  const int batches = (my_steps + U - 1) / U;
  auto k_of = [&](int b, int u) { return (warp + NW * (b * U + u)) * STEP + 8 * c; };

  float acc[RT][NT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[rt][nt][j] = 0.f;

  uint4 wv[U][RT][2];
  auto load_weights = [&](int b) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][rt][h] = chunk16<T, K, VEC, true>(wr[rt][h], k_of(b, u));
  };
  // The first batch of weights is in flight while the kernel before this one drains (PDL); x is
  // that kernel's output, so it is read only after the wait.
  load_weights(0);
  dsg::pdl_wait();
  for (int b = 0; b < batches;) {
    uint4 xv[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xv[u][nt] = chunk16<T, K, VEC, false>(xr[nt], k_of(b, u));
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_chunk<BF16>(acc[rt][nt], wv[u][rt][0], wv[u][rt][1], xv[u][nt]);
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

// Sum the warps' accumulators (mma layout) and store: element i of a warp's slice is (rt, nt, lane,
// j) -> row rt * 16 + lane / 4 + 8 * (j / 2), token 8 * nt + 2 * (lane % 4) + j % 2.
template <typename T, int WARPS, int RT, int NT, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void mma_store(const Mats<T, sizeof...(ROWS)>& m, int ntok, int row0, float* red) {
  auto where = [&](int i, int& row, int& tok) {
    const int rt = i / (NT * 128), nt = (i / 128) % NT, l = (i % 128) >> 2, j = i & 3;
    row = row0 + rt * TILE + (l >> 2) + 8 * (j >> 1);
    tok = 8 * nt + 2 * (l & 3) + (j & 1);
  };
  if constexpr (SILU) {
    constexpr int rows[] = {ROWS...};
    // c0 c1 (i % 4 < 2) are row g, a gate row; c2 c3 (i + 2) the up row of the same column
    reduce_store<WARPS, KS, RT * NT * 128, 2>(red, [&](int i, float gate, float up) {
      int row, tok;
      where(i, row, tok);
      if (tok < ntok) store_silu<T, rows[0]>(m, row, tok, gate, up);
    });
  } else {
    reduce_store<WARPS, KS, RT * NT * 128, 0>(red, [&](int i, float s) {
      int row, tok;
      where(i, row, tok);
      if (tok < ntok) store_out<T, ROWS...>(m, row, tok, s);
    });
  }
}

// ---- fp32 on CUDA cores ------------------------------------------------------------------------

// row[k .. k + 8) as floats; zeros for a null row and past K.  VEC: two 16-byte loads (K % 4 == 0,
// so each half is whole or past the end).
template <int K, bool VEC>
__device__ __forceinline__ void chunk32(const float* row, int k, float (&v)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = 0.f;
  if (row == nullptr) return;
  if constexpr (VEC) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (k + 4 * h < K) {
        const float4 q = *reinterpret_cast<const float4*>(row + k + 4 * h);
        v[4 * h] = q.x; v[4 * h + 1] = q.y; v[4 * h + 2] = q.z; v[4 * h + 3] = q.w;
      }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k + j < K) v[j] = row[k + j];
  }
}

// The same tiles and steps as mma_tiles; thread (g, c) sums rows g and g + 8 of each tile for every
// token over its k, the four threads of a row are summed with shuffles, and lane c == 0 writes the
// partial sums to red as [warp][rt][row 0..15][token 0..15].
template <int K, int WARPS, int RT, bool VEC, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void fp32_tiles(const float* __restrict__ x, i64 x_stride,
                                           const Mats<float, sizeof...(ROWS)>& m, int ntok, int row0, float* red) {
  constexpr int NSTEPS = (K + STEP - 1) / STEP;
  constexpr int NW = KS * WARPS;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int warp = (KS > 1 ? (int)cluster::rank() * WARPS : 0) + (int)(threadIdx.x >> 5);
  const float* wr[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) wr[rt][h] = weight_row<float, K, SILU, ROWS...>(m, row0 + rt * TILE + g + 8 * h);
  float acc[RT][2][MAX_TOKENS];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int t = 0; t < MAX_TOKENS; ++t) acc[rt][h][t] = 0.f;
  dsg::pdl_wait();
  for (int s = warp; s < NSTEPS; s += NW) {
    const int k = s * STEP + 8 * c;
    float wv[RT][2][8];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) chunk32<K, VEC>(wr[rt][h], k, wv[rt][h]);
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
      if (t < ntok) {
        float xv[8];
        chunk32<K, VEC>(x + (i64)t * x_stride, k, xv);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[rt][h][t] = fmaf(wv[rt][h][j], xv[j], acc[rt][h][t]);
      }
    }
  }
  dsg::pdl_launch_dependents();
  float* mine = red + (threadIdx.x >> 5) * (RT * TILE * MAX_TOKENS);
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int t = 0; t < MAX_TOKENS; ++t) {
        float v = acc[rt][h][t];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (c == 0) mine[(rt * TILE + g + 8 * h) * MAX_TOKENS + t] = v;
      }
}

template <int WARPS, int RT, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void fp32_store(const Mats<float, sizeof...(ROWS)>& m, int ntok, int row0, float* red) {
  if constexpr (SILU) {
    constexpr int rows[] = {ROWS...};
    // [rt][row][token]: a gate row r < 8 of a tile, its up row r + 8 is 8 x 16 floats on
    reduce_store<WARPS, KS, RT * TILE * MAX_TOKENS, 8 * MAX_TOKENS>(red, [&](int i, float gate, float up) {
      const int tok = i % MAX_TOKENS;
      if (tok < ntok) store_silu<float, rows[0]>(m, row0 + i / MAX_TOKENS, tok, gate, up);
    });
  } else {
    reduce_store<WARPS, KS, RT * TILE * MAX_TOKENS, 0>(red, [&](int i, float s) {
      const int tok = i % MAX_TOKENS;
      if (tok < ntok) store_out<float, ROWS...>(m, row0 + i / MAX_TOKENS, tok, s);
    });
  }
}

// ---- the kernel body -----------------------------------------------------------------------------

// y_i = x @ W_i^T for ntok <= MAX_TOKENS tokens (the lowering's grid is 0 above; a larger ntok
// would leave the outputs unwritten, which the property tests' poisoned outputs would catch).
// KS: CTAs per cluster along x (the kernel is declared __cluster_dims__(KS, 1, 1) when KS > 1); the
// grid is KS CTAs per RT row tiles.  SILU: gate_up_silu (ROWS = n, n; one output).
template <typename T, int K, int WARPS, int RT, int U, int KS, bool SILU, int... ROWS>
__device__ __forceinline__ void linear(const T* __restrict__ x, i64 x_stride, const Mats<T, sizeof...(ROWS)>& m,
                                       int ntok, float* red) {
  static_assert(WARPS >= 1 && RT >= 1 && U >= 1, "skinny linear: at least one warp, row tile and step a batch");
  static_assert(KS == 1 || KS == 2 || KS == 4 || KS == 8, "skinny linear: a cluster of 1, 2, 4 or 8 CTAs");
  const int row0 = (blockIdx.x / KS) * RT * TILE;
  const bool vec = vec_ok<T, K, (int)sizeof...(ROWS)>(x, x_stride, m);
  if constexpr (IsF32<T>::value) {
    if (vec) fp32_tiles<K, WARPS, RT, true, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    else fp32_tiles<K, WARPS, RT, false, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    fp32_store<WARPS, RT, KS, SILU, ROWS...>(m, ntok, row0, red);
  } else {
    if (ntok <= 8) {
      if (vec) mma_tiles<T, K, WARPS, RT, U, 1, true, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
      else mma_tiles<T, K, WARPS, RT, U, 1, false, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
      mma_store<T, WARPS, RT, 1, KS, SILU, ROWS...>(m, ntok, row0, red);
    } else {
      if (vec) mma_tiles<T, K, WARPS, RT, U, 2, true, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
      else mma_tiles<T, K, WARPS, RT, U, 2, false, KS, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
      mma_store<T, WARPS, RT, 2, KS, SILU, ROWS...>(m, ntok, row0, red);
    }
  }
  DSG_PHASE_EXIT();   // phases.cuh
}

}  // namespace skinny
}  // namespace dsg
