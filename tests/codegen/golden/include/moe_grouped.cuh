// DeepSeekMoE grouped expert projections: every active expert's rows in one launch, the pairs
// gathered through the routing order / offsets (moe_router.cuh 3): a GEMV on CUDA cores (4), a GEMM
// on mma.sync tensor cores for experts with many pairs (4b) and its swapped tiles for few (4c).
// Semantics mirror ir/ops/moe.py (grouped_linear), including where results are rounded to the
// activation type.  Templates only fill in the constants; moe_wgmma.cuh and moe_wgmma_skinny.cuh
// are the sm_90a forms.  Dimensions: moe_common.cuh's legend.
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "moe_common.cuh"

namespace dsg {
namespace moe {

// ---- 4. grouped expert GEMV: all active experts in one launch ------------------------------
// Grid (slots, cdiv(N, WARPS * RPW)): slot s is the s-th expert that has pairs (the lowering
// makes min(E, NP) slots: no more experts can have pairs), and a CTA owns WARPS * RPW of its N
// output rows, so an expert without pairs costs no CTA (decode at batch 1 touches 6 of 64).
// Each warp takes RPW rows of every weight matrix and PT of the expert's pairs at a time; lanes
// split the reduction dim KD in VEC-wide (16-byte) slices, so with <= PT pairs per expert
// (decode) every weight row is read exactly once.  grouped_gemm (4b) runs the same rows for its
// light experts inside the tensor-core launch.
//   MODE GATE_UP_SILU: out0[p] = round(round(silu(round(x[p/K].Wg))) * round(x[p/K].Wu))
//   MODE GATE_UP:      out0[p] = round(x[p/K].Wg), out1[p] = round(x[p/K].Wu)
//   MODE DOWN:         out0[p] = round(x[p].W)      (x is per pair)
enum GroupedMode { GATE_UP_SILU = 0, GATE_UP = 1, DOWN = 2 };

// One pass over the weight rows for up to PTC pairs order[c0 .. min(c0 + PTC, end)).
template <typename T, int MODE, int NW, int N, int KD, int K, int RPW, int PTC, int VEC>
__device__ __forceinline__ void grouped_chunk(const T* __restrict__ x, const T* __restrict__ W0,
                                              const T* __restrict__ W1, const i32* __restrict__ order,
                                              int c0, int end, int row0, T* __restrict__ out0,
                                              T* __restrict__ out1) {
  const int lane = threadIdx.x & 31;
  const T* W[2] = {W0, W1};
  int pair[PTC];
  const T* xr[PTC];
#pragma unroll
  for (int j = 0; j < PTC; ++j) {
    pair[j] = (c0 + j < end) ? order[c0 + j] : -1;
    const int row = (MODE == DOWN) ? pair[j] : pair[j] / K;
    xr[j] = x + (i64)(pair[j] >= 0 ? row : 0) * KD;
  }
  float acc[RPW][NW][PTC];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < NW; ++m)
#pragma unroll
      for (int j = 0; j < PTC; ++j) acc[r][m][j] = 0.f;

#pragma unroll 2
  for (int d = lane * VEC; d < KD; d += 32 * VEC) {
    float wv[RPW][NW][VEC];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int m = 0; m < NW; ++m) {
        if (row0 + r < N) load_f_ro<T, VEC>(W[m] + (i64)(row0 + r) * KD + d, wv[r][m]);
        else
#pragma unroll
          for (int v = 0; v < VEC; ++v) wv[r][m][v] = 0.f;
      }
#pragma unroll
    for (int j = 0; j < PTC; ++j) {
      if (pair[j] >= 0) {
        float xv[VEC];
        load_f<T, VEC>(xr[j] + d, xv);
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
          for (int m = 0; m < NW; ++m)
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[r][m][j] = fmaf(wv[r][m][v], xv[v], acc[r][m][j]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < NW; ++m)
#pragma unroll
      for (int j = 0; j < PTC; ++j) acc[r][m][j] = warp_sum(acc[r][m][j]);

  // lane j stores pair j (every lane holds every sum after the xor reduction)
#pragma unroll
  for (int j = 0; j < PTC; ++j) {
    if (lane == j && pair[j] >= 0) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        if (row0 + r >= N) continue;
        const i64 o = (i64)pair[j] * N + row0 + r;
        if constexpr (MODE == GATE_UP_SILU) {
          const float g = round_to<T>(acc[r][0][j]);
          const float u = round_to<T>(acc[r][1][j]);
          const float s = round_to<T>(g / (1.f + expf(-g)));
          out0[o] = from_float<T>(s * u);
        } else if constexpr (MODE == GATE_UP) {
          out0[o] = from_float<T>(acc[r][0][j]);
          out1[o] = from_float<T>(acc[r][NW - 1][j]);
        } else {
          out0[o] = from_float<T>(acc[r][0][j]);
        }
      }
    }
  }
}

// Decode touches an expert with one or two pairs: a narrow pass then keeps the reduction and
// the register footprint to what is used; wider chunks amortise the weight reads over PT pairs.
constexpr int GROUPED_NARROW = 2;

// The tensor-core GEMM's own conditions (which pointers its wide accesses need aligned); the GEMV
// tests the same ones, so an expert the GEMM refuses at run time is the GEMV's (see below).
template <int KD> __host__ __device__ constexpr bool gemm_cp_async() { return KD % 8 == 0; }
template <typename T, int N> __host__ __device__ constexpr bool gemm_paired_store() {
  return N % 2 == 0 && sizeof(T) == 2;
}

// Whether grouped_gemm can take these operands: its 16-byte cp.async copies of x and weight rows
// (when KD % 8 == 0; rows are then 16-byte multiples apart) need 16-byte aligned bases, its
// paired 4-byte stores (N even) 4-byte aligned outputs.  Unused operands are null (aligned).
template <typename T, int N, int KD>
__device__ __forceinline__ bool gemm_operands_ok(const T* x, const T* w0, const T* w1, const T* out0,
                                                 const T* out1) {
  bool ok = true;
  if constexpr (gemm_cp_async<KD>()) ok = aligned_to<16>(x) && aligned_to<16>(w0) && aligned_to<16>(w1);
  if constexpr (gemm_paired_store<T, N>()) ok = ok && aligned_to<4>(out0) && aligned_to<4>(out1);
  return ok;
}

// One expert's rows row0 .. row0 + RPW for all its pairs, V elements per load.
template <typename T, int MODE, int NW, int N, int KD, int K, int RPW, int PT, int V>
__device__ __forceinline__ void grouped_rows(const T* __restrict__ x, const T* __restrict__ W0,
                                             const T* __restrict__ W1, const i32* __restrict__ order,
                                             int beg, int end, int row0, T* __restrict__ out0,
                                             T* __restrict__ out1) {
  for (int c0 = beg; c0 < end; c0 += PT) {
    if (end - c0 <= GROUPED_NARROW)
      grouped_chunk<T, MODE, NW, N, KD, K, RPW, GROUPED_NARROW, V>(x, W0, W1, order, c0, end, row0, out0, out1);
    else
      grouped_chunk<T, MODE, NW, N, KD, K, RPW, PT, V>(x, W0, W1, order, c0, end, row0, out0, out1);
  }
}

// The s-th expert, in expert order, that a CUDA-core pass takes: one with pairs that is not left
// to the tensor-core tiles (THR > 0: more than THR pairs, with operands the GEMM can take,
// gemm_ok).  -1 when there are fewer.  Each warp scans the offsets by itself, 32 experts a
// ballot, so the answer is warp-uniform without a barrier.
template <int E, int THR>
__device__ __forceinline__ int nth_light_expert(const i32* __restrict__ offsets, int s, bool gemm_ok) {
  const int lane = threadIdx.x & 31;
  int seen = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const int cnt = (e < E) ? offsets[e + 1] - offsets[e] : 0;
    const bool light = cnt > 0 && !(THR > 0 && cnt > THR && gemm_ok);
    unsigned m = __ballot_sync(0xffffffffu, light);
    const int n = __popc(m);
    if (s < seen + n) {
      for (int i = seen; i < s; ++i) m &= m - 1;      // drop the lower set bits
      return e0 + __ffs(m) - 1;
    }
    seen += n;
  }
  return -1;
}

// Expert e's rows row0 .. row0 + RPW (< N checked per row) for all its pairs: the wide loads when
// the bases are aligned for them, else element loads.
template <typename T, int MODE, int N, int KD, int K, int RPW, int PT, int VEC>
__device__ __forceinline__ void grouped_expert_rows(const T* __restrict__ x, const T* __restrict__ w0,
                                                    const T* __restrict__ w1, const i32* __restrict__ order,
                                                    const i32* __restrict__ offsets, int e, int row0,
                                                    T* __restrict__ out0, T* __restrict__ out1) {
  constexpr int NW = (MODE == DOWN) ? 1 : 2;   // weight matrices
  static_assert(KD % VEC == 0, "grouped gemv: reduction dim must be a multiple of the vector width");
  static_assert(PT <= 32 && PT >= GROUPED_NARROW, "grouped gemv: pairs per pass must fit a warp");
  const int beg = offsets[e], end = offsets[e + 1];
  const T* W0 = w0 + (i64)e * N * KD;
  const T* W1 = (NW > 1 ? w1 : w0) + (i64)e * N * KD;
  if constexpr (VEC > 1) {
    // Rows are KD (a multiple of VEC) elements apart, so aligned bases keep every slice aligned.
    constexpr int A = vec_align<T, VEC>();
    if (aligned_to<A>(x) && aligned_to<A>(w0) && aligned_to<A>(NW > 1 ? w1 : w0)) {
      grouped_rows<T, MODE, NW, N, KD, K, RPW, PT, VEC>(x, W0, W1, order, beg, end, row0, out0, out1);
      return;
    }
  }
  grouped_rows<T, MODE, NW, N, KD, K, RPW, PT, 1>(x, W0, W1, order, beg, end, row0, out0, out1);
}

template <typename T, int MODE, int E, int N, int KD, int K, int WARPS, int RPW, int PT, int VEC>
__device__ __forceinline__ void grouped_gemv(const T* __restrict__ x, const T* __restrict__ w0,
                                             const T* __restrict__ w1, const i32* __restrict__ order,
                                             const i32* __restrict__ offsets, T* __restrict__ out0,
                                             T* __restrict__ out1) {
  const int e = nth_light_expert<E, 0>(offsets, blockIdx.x, false);   // every expert with pairs
  if (e < 0) return;
  const int row0 = (blockIdx.y * WARPS + (threadIdx.x >> 5)) * RPW;
  if (row0 >= N) return;
  grouped_expert_rows<T, MODE, N, KD, K, RPW, PT, VEC>(x, w0, w1, order, offsets, e, row0, out0, out1);
}

// ---- 4b. grouped expert GEMM on tensor cores (bf16 / fp16): experts with many pairs ---------
// Prefill gives each expert ~T*K/E pairs: a GEMM per expert, [pairs x KD] x [KD x N], with the
// pair rows gathered through the routing order.  CTA = 256 threads (8 warps, 2 x 4) owns one
// (expert, BM-pair row tile, column tile); the column tile is 128 weight rows: 64 gate rows and
// the same 64 up rows (GATE_UP*, so SiLU * up fuses in registers) or 128 down rows (DOWN).
// A warp computes 64 pairs x 32 weight rows with mma.sync m16n8k16 (fp32 accumulation), fed by
// ldmatrix from a STAGES-deep cp.async ring of BK-wide K slices.  Row tiles are numbered over
// the experts with more than THR pairs; tiles past the last one exit at once.
// The same launch serves the light experts (1..THR pairs) on CUDA cores, so one launch a layer
// covers every expert and the two kinds of CTA share the machine instead of running one after
// the other: grid y = min(E, NP) light slots (slot y is the y-th light expert, the CTA's column
// tile of it; grouped_gemv's row code, LRPW rows a warp at a time) and then a host-side bound on
// the row tiles, NP // BM + min(E, NP // (THR + 1)).  When the operands do not fit the GEMM's
// wide accesses (gemm_operands_ok), every expert with pairs is light.

// Columns col, col + 1 of one output row (col even): one 4-byte store when N is even (rows are
// then 4-byte multiples apart; grouped_gemm checked the base), else element stores (odd N).
template <typename T, int N>
__device__ __forceinline__ void store2(T* __restrict__ row, int col, float v0, float v1) {
  if constexpr (gemm_paired_store<T, N>()) {
    if (col < N) *reinterpret_cast<unsigned*>(row + col) = dsg::mma::pack2<T>(v0, v1);
  } else {
    if (col < N) row[col] = from_float<T>(v0);
    if (col + 1 < N) row[col + 1] = from_float<T>(v1);
  }
}

constexpr int GEMM_BM = 128, GEMM_BNW = 128, GEMM_THREADS = 256;
// BK halves per K slice, ST slices in flight; rows padded by 8 halves (an odd number of 16-byte
// chunks per row), so ldmatrix's eight rows hit distinct banks.
__host__ __device__ constexpr int gemm_smem(int BK, int ST) { return ST * (GEMM_BM + GEMM_BNW) * (BK + 8) * 2; }

// (4d, moe_wgmma.cuh: the same grouped GEMM on sm_90a's wgmma + TMA, for prefill's pair counts.)

// ---- 4c. few pairs per expert: the same CTA tile with the weight rows as the mma's M side ---
// Decode at batch 16..256 gives an expert ~2..30 pairs: on the row-tile layout above a 128-row
// tile then holds a handful of live rows (most of the tensor work and half the copies wasted).
// Swapped, the CTA's 128 weight rows are M (one m16 tile per warp) and the tile's BP pairs are N
// (BP / 8 n8 tiles, BP = 16 / 32 / 64 picked from the pair count at run time), so each weight
// byte is copied once and the x rows are BP, not 128.  Its ring has its own K slice SBK (wider
// than the row tile's: each weight row is then read in SBK * 2-byte runs) and SST stages; the
// launch's dynamic shared memory is the larger of the two layouts' (gemm_launch_smem).
// Shared rows (GATE_UP*): 16-row group q holds gate rows n0 + 8q .. + 8 then the up rows of the
// same columns, so a thread's accumulators c0, c1 (row g) are gate and c2, c3 (row g + 8) up
// of one output column: SiLU * up fuses in registers.  DOWN: shared row r is weight row n0 + r.
__host__ __device__ constexpr int skinny_smem(int SK, int SBK, int SST) {
  return SK > 0 ? SST * (GEMM_BNW + SK) * (SBK + 8) * 2 : 0;
}
__host__ __device__ constexpr int gemm_launch_smem(int BK, int ST, int SK, int SBK, int SST) {
  return gemm_smem(BK, ST) > skinny_smem(SK, SBK, SST) ? gemm_smem(BK, ST) : skinny_smem(SK, SBK, SST);
}

// Shared row r of the swapped layout: weight row *n of matrix *Wm (the interleave above).
template <int MODE, typename T>
__device__ __forceinline__ void skinny_weight_row(int n0, int r, const T* W0, const T* W1, int& n, const T*& Wm) {
  if constexpr (MODE == DOWN) { n = n0 + r; Wm = W0; }
  else { n = n0 + (r >> 4) * 8 + (r & 7); Wm = (r & 8) ? W1 : W0; }
}

template <typename T, int MODE, int N, int KD, int K, int SBK, int SST, int BP>
__device__ __forceinline__ void grouped_gemm_skinny(const T* __restrict__ x, const T* __restrict__ W0,
                                                    const T* __restrict__ W1, const i32* __restrict__ order,
                                                    const int* __restrict__ s_row, int pbeg, int rows, int n0,
                                                    T* __restrict__ out0, T* __restrict__ out1, char* smem) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int BK = SBK, BNW = GEMM_BNW, P = BK + 8, NJ = BP / 8;
  static_assert(BP % 16 == 0 && BP <= GEMM_BM, "skinny gemm: pair tiles are whole ldmatrix x4 loads");
  static_assert(BK % 16 == 0 && (BNW * BK / 8) % GEMM_THREADS == 0, "skinny gemm: whole 16-byte chunks per thread");
  static_assert(SST >= 2, "skinny gemm: a ring of at least two stages");
  static_assert(GEMM_THREADS == 256 && BNW == 8 * 16, "skinny gemm: one m16 weight tile per warp");
  constexpr bool ALIGNED = gemm_cp_async<KD>();
  constexpr int KT = (KD + BK - 1) / BK;
  constexpr int BN = (MODE == DOWN) ? BNW : BNW / 2;      // output columns per CTA
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  T* Ws = reinterpret_cast<T*>(smem);                      // SST x BNW x P
  T* Xs = Ws + SST * BNW * P;                              // SST x BP x P (16-byte multiples: P is)

  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * BK;
    T* w = Ws + stage * BNW * P;
    T* a = Xs + stage * BP * P;
#pragma unroll
    for (int i = 0; i < (BNW * BK / 8) / GEMM_THREADS; ++i) {
      const int c = tid + i * GEMM_THREADS;
      const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
      int n;
      const T* Wm;
      skinny_weight_row<MODE>(n0, r, W0, W1, n, Wm);
      const int valid = (n < N) ? min(8, KD - (k0 + kc)) : 0;
      dsg::mma::load8<T, ALIGNED>(w + r * P + kc, Wm + (i64)(n < N ? n : 0) * KD + k0 + kc, valid);
    }
    for (int c = tid; c < BP * BK / 8; c += GEMM_THREADS) {
      const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
      dsg::mma::load8<T, ALIGNED>(a + r * P + kc, x + (i64)s_row[r] * KD + k0 + kc, min(8, KD - (k0 + kc)));
    }
  };

  float acc[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;

  auto compute = [&](int stage) {
    const T* w = Ws + stage * BNW * P;
    const T* a = Xs + stage * BP * P;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned wf[4];
      {
        const int r = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        dsg::mma::ldsm_x4(wf, w + r * P + kk + (lane >> 4) * 8);
      }
#pragma unroll
      for (int q = 0; q < NJ / 2; ++q) {
        unsigned xf[4];
        const int r = q * 16 + (lane & 7) + (lane >> 4) * 8;
        dsg::mma::ldsm_x4(xf, a + r * P + kk + ((lane >> 3) & 1) * 8);
        dsg::mma::mma16816<BF16>(acc[2 * q], wf, xf[0], xf[1]);
        dsg::mma::mma16816<BF16>(acc[2 * q + 1], wf, xf[2], xf[3]);
      }
    }
  };

  dsg::mma::cp_async_ring<SST>(KT, load_stage, compute);

  // epilogue: acc[j] holds weight rows warp*16 + g (c0, c1) and + 8 (c2, c3) for the tile's pairs
  // j*8 + t2, j*8 + t2 + 1
  const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = j * 8 + t2 + c;                        // pair within the tile
      if (r >= rows) continue;
      T* o0 = out0 + (i64)order[pbeg + r] * N;
      if constexpr (MODE == DOWN) {
        const int col = n0 + warp * 16 + g;
        if (col < N) o0[col] = from_float<T>(acc[j][c]);
        if (col + 8 < N) o0[col + 8] = from_float<T>(acc[j][2 + c]);
      } else {
        const int col = n0 + warp * 8 + g;
        if (col >= N) continue;
        const float gv = acc[j][c], uv = acc[j][2 + c];
        if constexpr (MODE == GATE_UP_SILU) {
          const float gr = round_to<T>(gv), ur = round_to<T>(uv);
          o0[col] = from_float<T>(round_to<T>(gr / (1.f + expf(-gr))) * ur);
        } else {
          o0[col] = from_float<T>(gv);
          out1[(i64)order[pbeg + r] * N + col] = from_float<T>(uv);
        }
      }
    }
  static_assert(BN == ((MODE == DOWN) ? 8 * 16 : 8 * 8), "skinny gemm: the column tile is the warps' rows");
}

template <typename T, int MODE, int E, int N, int KD, int K, int THR, int BK, int ST, int SK, int SBK, int SST,
          int LRPW, int VEC>
__device__ __forceinline__ void grouped_gemm(const T* __restrict__ x, const T* __restrict__ w0,
                                             const T* __restrict__ w1, const i32* __restrict__ order,
                                             const i32* __restrict__ offsets, int num_pairs,
                                             T* __restrict__ out0, T* __restrict__ out1, char* smem) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int BM = GEMM_BM, BNW = GEMM_BNW, P = BK + 8;
  static_assert(BK % 16 == 0 && (BM * BK / 8) % GEMM_THREADS == 0, "grouped gemm: BK must be a multiple of 16");
  // Shared-memory carve-up: smem is 16-byte aligned (the template declares it so) and every tile
  // row is P halves = a 16-byte multiple, so each cp.async / ldmatrix / 16-byte store target
  // (row start + a multiple of 8 halves) is 16-byte aligned, in As and in Bs = As + ST * BM * P.
  static_assert((P * sizeof(T)) % 16 == 0, "grouped gemm: padded smem rows must stay 16-byte multiples");
  constexpr int BN = (MODE == DOWN) ? BNW : BNW / 2;      // output columns per CTA
  constexpr bool ALIGNED = gemm_cp_async<KD>();            // else element loads (odd KD)
  constexpr int KT = (KD + BK - 1) / BK;
  __shared__ int s_tile[3];                                // expert, first pair, pairs
  __shared__ int s_row[BM];                                // source row of each tile row

  // Misaligned bases (never the runtime's own buffers): every expert is light.  Uniform across
  // the grid, before any shared-memory traffic.
  const bool ok = gemm_operands_ok<T, N, KD>(x, w0, w1, out0, out1);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int light_slots = min(E, num_pairs);
  if ((int)blockIdx.y < light_slots) {
    // Light slot: this CTA's BN output columns of the slot's expert, RW rows per warp (gate and
    // up rows of 8 columns, or 16 down rows), LRPW at a time.  No shared memory, no barrier.
    // A light expert has at most THR pairs, so one pass of LPT pairs takes them all (only
    // misaligned operands bring more, in more passes): a wider pass would cost registers the
    // tiles' 128 (two CTAs per SM) cannot spare.
    constexpr int RW = BN / (GEMM_THREADS / 32);
    constexpr int LPT = THR > GROUPED_NARROW ? (THR < 32 ? THR : 32) : GROUPED_NARROW;
    static_assert(RW % LRPW == 0, "grouped gemm: a warp's light rows are whole passes");
    const int e = nth_light_expert<E, THR>(offsets, blockIdx.y, ok);
    if (e < 0) return;
    const int r_beg = blockIdx.x * BN + warp * RW;
    for (int row0 = r_beg; row0 < r_beg + RW && row0 < N; row0 += LRPW)
      grouped_expert_rows<T, MODE, N, KD, K, LRPW, LPT, VEC>(x, w0, w1, order, offsets, e, row0, out0, out1);
    return;
  }
  if (!ok) return;
  if (warp == 0) {
    // which (expert, row tile) is this CTA's: a running count of the heavy experts' tiles
    const int ty = blockIdx.y - light_slots;
    int base = 0, found = -1;
    for (int e0 = 0; e0 < E && found < 0; e0 += 32) {
      const int e = e0 + lane;
      int cnt = 0;
      if (e < E) cnt = offsets[e + 1] - offsets[e];
      const int nt = (cnt > THR) ? (cnt + BM - 1) / BM : 0;
      int incl = nt;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const bool mine = nt > 0 && ty >= base + incl - nt && ty < base + incl;
      const unsigned hit = __ballot_sync(0xffffffffu, mine);
      if (hit) {
        const int src = __ffs(hit) - 1;
        const int first = __shfl_sync(0xffffffffu, base + incl - nt, src);
        found = e0 + src;
        if (lane == 0) {
          const int beg = offsets[found] + (ty - first) * BM;
          s_tile[0] = found;
          s_tile[1] = beg;
          s_tile[2] = min(BM, offsets[found + 1] - beg);
        }
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (found < 0 && lane == 0) s_tile[0] = -1;
  }
  __syncthreads();
  const int e = s_tile[0];
  if (e < 0) return;
  const int pbeg = s_tile[1], rows = s_tile[2];
  for (int r = tid; r < BM; r += GEMM_THREADS) {
    const int pr = order[pbeg + min(r, rows - 1)];          // rows past the end repeat the last
    s_row[r] = (MODE == DOWN) ? pr : pr / K;
  }
  __syncthreads();

  const int n0 = blockIdx.x * BN;
  const T* W0 = w0 + (i64)e * N * KD;
  const T* W1 = ((MODE == DOWN) ? w0 : w1) + (i64)e * N * KD;
  // A tile of at most SK pairs (decode's usual case): the swapped orientation (4c above).
  // rows is uniform across the CTA, so every thread takes the same branch.
  if constexpr (SK >= 16) {
    if (rows <= 16) {
      grouped_gemm_skinny<T, MODE, N, KD, K, SBK, SST, 16>(x, W0, W1, order, s_row, pbeg, rows, n0, out0, out1, smem);
      return;
    }
  }
  if constexpr (SK >= 32) {
    if (rows <= 32) {
      grouped_gemm_skinny<T, MODE, N, KD, K, SBK, SST, 32>(x, W0, W1, order, s_row, pbeg, rows, n0, out0, out1, smem);
      return;
    }
  }
  if constexpr (SK >= 64) {
    if (rows <= 64) {
      grouped_gemm_skinny<T, MODE, N, KD, K, SBK, SST, 64>(x, W0, W1, order, s_row, pbeg, rows, n0, out0, out1, smem);
      return;
    }
  }
  T* As = reinterpret_cast<T*>(smem);
  T* Bs = As + ST * BM * P;

  // each thread loads 2 A chunks and 2 B chunks (8 elements each) per stage
  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * BK;
    T* a = As + stage * BM * P;
    T* b = Bs + stage * BNW * P;
#pragma unroll
    for (int i = 0; i < (BM * BK / 8) / GEMM_THREADS; ++i) {
      const int c = tid + i * GEMM_THREADS;
      const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
      const int valid = min(8, KD - (k0 + kc));
      dsg::mma::load8<T, ALIGNED>(a + r * P + kc, x + (i64)s_row[r] * KD + k0 + kc, valid);
    }
#pragma unroll
    for (int i = 0; i < (BNW * BK / 8) / GEMM_THREADS; ++i) {
      const int c = tid + i * GEMM_THREADS;
      const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
      int n;
      const T* Wm;
      if constexpr (MODE == DOWN) { n = n0 + r; Wm = W0; }
      else { n = n0 + (r % BN); Wm = (r < BN) ? W0 : W1; }
      const int valid = (n < N) ? min(8, KD - (k0 + kc)) : 0;
      dsg::mma::load8<T, ALIGNED>(b + r * P + kc, Wm + (i64)(n < N ? n : 0) * KD + k0 + kc, valid);
    }
  };

  const int wm = warp >> 2, wn = warp & 3;                   // warp tile: rows wm*64, weight rows below
  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
  // smem weight row of the warp's n8 tiles 2q, 2q+1 (q = 0, 1)
  int brow[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) brow[q] = (MODE == DOWN) ? wn * 32 + q * 16 : q * BN + wn * 16;

  dsg::mma::cp_async_ring<ST>(KT, load_stage, [&](int stage) {
    const T* a = As + stage * BM * P;
    const T* b = Bs + stage * BNW * P;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[4][4], bf[2][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = wm * 64 + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        dsg::mma::ldsm_x4(af[i], a + r * P + kk + (lane >> 4) * 8);
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int r = brow[q] + (lane & 7) + (lane >> 4) * 8;
        dsg::mma::ldsm_x4(bf[q], b + r * P + kk + ((lane >> 3) & 1) * 8);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          dsg::mma::mma16816<BF16>(acc[i][j], af[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
    }
  });

  // epilogue: acc[i][j] holds rows wm*64 + i*16 + lane/4 (+8), columns 2*(lane%4) (+1) of n8 tile j
  const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * 64 + i * 16 + g + h * 8;
      if (r >= rows) continue;
      const i64 orow = (i64)order[pbeg + r] * N;
      if constexpr (MODE == DOWN) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int col = n0 + wn * 32 + j * 8 + t2;
          store2<T, N>(out0 + orow, col, acc[i][j][h * 2], acc[i][j][h * 2 + 1]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = n0 + wn * 16 + j * 8 + t2;
          float v[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float gv = acc[i][j][h * 2 + c], uv = acc[i][j + 2][h * 2 + c];
            if constexpr (MODE == GATE_UP_SILU) {
              const float gr = round_to<T>(gv), ur = round_to<T>(uv);
              v[c] = round_to<T>(gr / (1.f + expf(-gr))) * ur;
            } else {
              v[c] = gv;
            }
          }
          store2<T, N>(out0 + orow, col, v[0], v[1]);
          if constexpr (MODE == GATE_UP) store2<T, N>(out1 + orow, col, acc[i][j + 2][h * 2], acc[i][j + 2][h * 2 + 1]);
        }
      }
    }
}

}  // namespace moe
}  // namespace dsg
