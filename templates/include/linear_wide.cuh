// Linears of MIN_TOKENS..MAX_TOKENS tokens (17..128: decode batches above the skinny kernel's 16): y_i[T, O_i] =
// x[T, K] @ W_i[O_i, K]^T, one launch for one weight or a few stacked ones, gate_up_silu as in
// skinny.cuh.  Where cuBLAS ran these at 1.4-1.8 TB/s (PERF_NOTES v16: 0.65-0.85 ms of a decode step
// from 32 to 256 tokens), this reads each weight byte once, like the skinny kernel, with more tokens:
//
//   * CTA = 8 warps over 128 stacked weight rows, warp w owning the 16-row mma tile w: the warps
//     split the ROWS (skinny.cuh's warps split K, so every warp would hold every token's
//     accumulators for every row: 4 x NT x RT floats, too many at 128 tokens).  A warp holds NT n8
//     token tiles' accumulators (NT = 4 / 8 / 16 for up to 32 / 64 / 128 tokens: 16-64 floats).
//   * Weights straight into registers with skinny.cuh's 16-byte loads and k permutation, a batch of
//     U steps of 32 k in flight while the batch before it is multiplied (two register sets).
//   * x read through L1: the 8 warps of a CTA read the same x chunks one after another, so each
//     chunk leaves L2 about once a CTA (x bytes a CTA = T / 128 of its weight bytes).
//   * K split over a cluster of KS CTAs (the lowering picks the largest KS whose clusters all run at once);
//     each CTA keeps its sums in shared memory and, after a cluster barrier, sums 1/KS of the
//     outputs over the cluster's CTAs through distributed shared memory in rank order
//     (deterministic), rounds once and stores.
// 16-bit types only (the lowering keeps fp32 on cuBLAS).  Odd K and misaligned views take element
// loads (skinny.cuh chunk16); rows past O and tokens past T load zeros and are not stored.
#pragma once
#include "skinny.cuh"

namespace dsg {
namespace wide {

using skinny::Mats;
using skinny::STEP;
using skinny::TILE;

constexpr int WARPS = 8;
constexpr int ROWS_PER_CTA = WARPS * TILE;   // 128
constexpr int MAX_NT = 16;                   // 128 tokens
constexpr int MIN_TOKENS = 17;               // below: skinny.cuh
constexpr int MAX_TOKENS = 8 * MAX_NT;

// Floats of dynamic shared memory a CTA needs for its sums (64 KB: store() below).
__host__ __device__ constexpr int red_floats() { return WARPS * MAX_NT * 128; }

// This CTA's partial (KS > 1) or whole sums for its 128 rows, NT token tiles, in the mma
// accumulator layout acc[nt][j]: row tile0 + lane / 4 + 8 (j / 2), token 8 nt + 2 (lane % 4) + j % 2.
template <typename T, int K, int KS, int U, int NT, bool VEC, bool SILU, int... ROWS>
__device__ __forceinline__ void tiles(const T* __restrict__ x, i64 x_stride, const Mats<T, sizeof...(ROWS)>& m,
                                      int ntok, int tile0, float (&acc)[NT][4]) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int NSTEPS = (K + STEP - 1) / STEP;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  // KS == 1: blockIdx.y is 0 (a 1-high grid); a runtime 0 keeps the step bounds opaque, as they
  // are at KS > 1 (with constant bounds ptxas unrolled the K loop and spilled: 60-230 bytes)
  const int q = KS > 1 ? (int)cluster::rank() : (int)blockIdx.y;
  const int s_begin = q * NSTEPS / KS, s_end = (q + 1) * NSTEPS / KS;   // this CTA's 32-k steps
  const T* wr[2] = {skinny::weight_row<T, K, SILU, ROWS...>(m, tile0 + g),
                    skinny::weight_row<T, K, SILU, ROWS...>(m, tile0 + g + 8)};
  // token row g + 8 nt of x (nullptr past ntok), made where it is read: NT 64-bit pointers held
  // across the loop cost more registers than the address arithmetic
  auto x_row = [&](int nt) { const int tok = g + 8 * nt; return tok < ntok ? x + (i64)tok * x_stride : nullptr; };
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;

  const int batches = (s_end - s_begin + U - 1) / U;
  // step s of batch b, or -1 past this CTA's share (zeros: another CTA of the cluster sums it)
  auto step_of = [&](int b, int u) { const int s = s_begin + b * U + u; return s < s_end ? s : -1; };
  auto load = [&](uint4 (&w)[U][2], int b) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = step_of(b, u);
#pragma unroll
      for (int h = 0; h < 2; ++h)
        w[u][h] = s >= 0 ? skinny::chunk16<T, K, VEC, true>(wr[h], s * STEP + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  auto multiply = [&](const uint4 (&w)[U][2], int b) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = step_of(b, u);
      if (s < 0) break;                                  // uniform: the same for the whole CTA
      uint4 xv[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xv[nt] = skinny::chunk16<T, K, VEC, false>(x_row(nt), s * STEP + 8 * c);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) skinny::mma_chunk<BF16>(acc[nt], w[u][0], w[u][1], xv[nt]);
    }
  };
  // The first batch of weights is in flight while the kernel before this one drains (PDL); x is
  // that kernel's output, read only after the wait.  Then batch b + 1 loads while b multiplies.
  uint4 wa[U][2], wb[U][2];
  load(wa, 0);
  dsg::pdl_wait();
#pragma unroll 1
  for (int b = 0; b < batches; b += 2) {   // not unrolled: with KS = 1 its bounds are constants
    if (b + 1 < batches) load(wb, b + 1);
    multiply(wa, b);
    if (b + 1 >= batches) break;
    if (b + 2 < batches) load(wa, b + 2);
    multiply(wb, b + 1);
  }
  dsg::pdl_launch_dependents();
}

// Store the sums: each CTA puts its acc in shared memory, and after a barrier (KS > 1: the
// cluster's) the CTAs each sum a contiguous 1/KS of the elements over the cluster's KS CTAs, rank
// by rank (deterministic), round once and store.  Through shared memory at KS == 1 too: stores
// straight from 64 accumulators a thread spilled registers (ptxas), and the loop over quads
// stores each output once with no per-element address kept live.
template <typename T, int KS, int NT, bool SILU, int... ROWS>
__device__ __forceinline__ void store(const Mats<T, sizeof...(ROWS)>& m, int ntok, int row0, float (&acc)[NT][4],
                                      float* red) {
  constexpr int rows[] = {ROWS...};
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // red[((warp * NT + nt) * 32 + lane) * 4 + j] = acc[nt][j]
  constexpr int N = WARPS * NT * 128;
  static_assert(N % (4 * KS) == 0, "wide linear: the cluster's CTAs take equal, whole-quad shares");
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    *reinterpret_cast<float4*>(red + ((warp * NT + nt) * 32 + lane) * 4) =
        make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
  if constexpr (KS > 1) cluster::sync();
  else __syncthreads();
  const int share = N / KS, base = (KS > 1 ? (int)cluster::rank() : 0) * share;
  for (int i = base + 4 * (int)threadIdx.x; i < base + share; i += 4 * WARPS * 32) {   // a quad: one lane's acc[nt]
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int qr = 0; qr < KS; ++qr) {
      const float4 v = cluster::ld4<(KS > 1)>(KS > 1 ? cluster::map_rank(smem_u32(red + i), (unsigned)qr)
                                                     : smem_u32(red + i));
      s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    }
    const int l = (i >> 2) & 31, nt = (i >> 7) % NT, w = (i >> 7) / NT;
    const int r = row0 + w * TILE + (l >> 2);            // rows r (c0 c1) and r + 8 (c2 c3)
    const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = 8 * nt + 2 * (l & 3) + e;
      if (tok >= ntok) continue;
      if constexpr (SILU) {
        skinny::store_silu<T, rows[0]>(m, r, tok, v[e], v[2 + e]);   // gate row r, its up row r + 8
      } else {
        skinny::store_out<T, ROWS...>(m, r, tok, v[e]);
        skinny::store_out<T, ROWS...>(m, r + 8, tok, v[2 + e]);
      }
    }
  }
  if constexpr (KS > 1) cluster::sync();   // no CTA leaves while the others read its sums
}

template <typename T, int K, int KS, int U, int NT, bool SILU, int... ROWS>
__device__ __forceinline__ void run(const T* __restrict__ x, i64 x_stride, const Mats<T, sizeof...(ROWS)>& m,
                                    int ntok, int row0, bool vec, float* red) {
  float acc[NT][4];
  const int tile0 = row0 + (int)(threadIdx.x >> 5) * TILE;
  if (vec) tiles<T, K, KS, U, NT, true, SILU, ROWS...>(x, x_stride, m, ntok, tile0, acc);
  else tiles<T, K, KS, U, NT, false, SILU, ROWS...>(x, x_stride, m, ntok, tile0, acc);
  store<T, KS, NT, SILU, ROWS...>(m, ntok, row0, acc, red);
}

// y_i = x @ W_i^T for MIN_TOKENS <= ntok <= MAX_TOKENS (the lowering's grid is 0 elsewhere; a
// larger ntok would leave outputs unwritten, which the property tests' poisoned outputs catch).
// The grid is KS CTAs (one cluster) per 128 stacked rows.
template <typename T, int K, int KS, int U, bool SILU, int... ROWS>
__device__ __forceinline__ void linear(const T* __restrict__ x, i64 x_stride, const Mats<T, sizeof...(ROWS)>& m,
                                       int ntok, float* red) {
  static_assert(sizeof(T) == 2, "wide linear: 16-bit types (fp32 stays on cuBLAS)");
  static_assert(KS == 1 || KS == 2 || KS == 4 || KS == 8, "wide linear: a cluster of 1, 2, 4 or 8 CTAs");
  static_assert((K + STEP - 1) / STEP >= KS, "wide linear: at least one 32-k step a CTA");
  const int row0 = (blockIdx.x / KS) * ROWS_PER_CTA;
  const bool vec = skinny::vec_ok<T, K, (int)sizeof...(ROWS)>(x, x_stride, m);
  if (ntok <= 32) run<T, K, KS, U, 4, SILU, ROWS...>(x, x_stride, m, ntok, row0, vec, red);
  else if (ntok <= 64) run<T, K, KS, U, 8, SILU, ROWS...>(x, x_stride, m, ntok, row0, vec, red);
  else run<T, K, KS, U, 16, SILU, ROWS...>(x, x_stride, m, ntok, row0, vec, red);
}

}  // namespace wide
}  // namespace dsg
