// 4f. Decode's grouped expert GEMM with FP8 weights (fp8_e4m3_block128, ir/formats.py): W[e][o, i] =
// q[e][o, i] * s[e][o / 128, i / 128], q float8_e4m3fn [E, N, KD], s float32 [E, ceil(N / 128),
// ceil(KD / 128)] (edge blocks partial: "ceil blocks").  The contract and the walk of 4e
// (moe_wgmma_skinny.cuh: tiles of (expert, pair row tile, 128 weight rows), a persistent grid, a
// producer warpgroup feeding a consumer warpgroup through a ring of K slices, the same epilogue),
// with the weights' bytes halved, which at decode is the kernel's whole cost:
//   * a stage's weights are two TMA boxes of 64 rows x 64 bytes (one 64-wide K slice of FP8, 64B
//     swizzle: 8 KB where bf16 took 16 KB) and the tile's pair rows as in 4e (bf16, 128B swizzle);
//   * the consumer reads its fragment of the FP8 rows from shared memory, widens it in registers
//     (e4m3 -> f16 -> bf16 is exact: fp8.cuh widen2) and issues wgmma with A from registers
//     (m64nBPk16, A as 4 x b32 a thread in mma.sync's m16n8k16 A layout, warp w rows 16w..16w+15);
//   * each slice's wgmma go into fresh accumulators that are scaled by the slice's block scale and
//     added to the running sums (fp32 promotion per K slice, DeepGEMM's recipe).  A 64-wide slice
//     lies inside one 128-wide K block, a 64-row box inside one 128-row block (gate_up tiles start
//     at multiples of 64, down tiles at multiples of 128), so a box sees one scale per slice.
//     Scaling the widened weights instead would round q * s to bf16 (a second rounding of every
//     weight); the promotion costs 2 x BP / 2 FMAs a thread a slice;
//   * the row tile is 32 pairs (wgmma N = 16 or 32), not 4e's 64: the fresh accumulators double the
//     accumulator registers, and two CTAs an SM leave 128 a thread.  An expert with more than 32
//     pairs reads its weights once per 32 (decode's tokens rarely give one that many).
// Above decode (prefill) the FP8 x FP8 GEMM of moe_gemm_fp8.cuh serves; this kernel there only where
// Tuning.moe.fp8_activations is off (correct, re-reading weights per 32 pairs).  Needs 16-bit T and KD % 16 == 0 (the FP8 rows' TMA
// stride); outputs at any alignment (element stores).
#pragma once
#include "fp8.cuh"
#include "moe_wgmma_skinny.cuh"

namespace dsg {
namespace moe {

constexpr int WF_BP = 32;                          // pairs per row tile
constexpr int WF_ROWS = WS_ROWS, WF_BOX = WS_BOX;  // 128 weight rows a tile, two boxes of 64
constexpr int WF_BK = WS_BK;                       // K slice: 64 (one bf16 pair row, 64 FP8 bytes)
constexpr int WF_W_ROW_BYTES = WF_BK;              // an FP8 weight row of a slice: 64 bytes
constexpr int WF_W_BYTES = WF_ROWS * WF_W_ROW_BYTES;                  // 8 KB of weights a stage
constexpr int WF_STAGE_BYTES = WF_W_BYTES + WF_BP * WS_ROW_BYTES;     // + 4 KB of pair rows: 12 KB
constexpr int WF_BLOCK = 128;                      // a scale's rows and columns
constexpr int WF_STAGES = 8;                       // the two-CTA ring (_moe_fp8.STAGES); deeper: one CTA an SM
static_assert(WF_BLOCK % WF_BK == 0 && WF_BLOCK % WF_BOX == 0, "fp8 experts: a box sees one scale a slice");
static_assert(WF_W_BYTES % 1024 == 0 && WF_STAGE_BYTES % 1024 == 0, "fp8 experts: 1024-byte aligned stage parts");

// Dynamic shared memory: the ring plus slack to start it on a 1024-byte boundary.
__host__ __device__ constexpr int wgmma_fp8_smem(int stages) { return stages * WF_STAGE_BYTES + 1024; }

struct WgFp8Tiles {
  static constexpr int BM = WF_BP, BOX = WF_BOX, STAGE_BYTES = WF_STAGE_BYTES;
  static constexpr int ROWS_AT = WF_W_BYTES, WEIGHTS_AT = 0, W_ROW_BYTES = WF_W_ROW_BYTES;
  static constexpr bool W_EVICT_FIRST = true;     // (as WgSkinnyTiles: read once a step)
  __host__ __device__ static constexpr int cols(int mode) { return wgmma_skinny_cols(mode); }
};

__device__ __forceinline__ uint4 lds128(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// This thread's A fragments of one 64-row FP8 box (64B swizzle: 16-byte chunk c of row r at
// c ^ ((r / 2) % 4)) for the slice's four k16 steps, widened to T: a[j] = {(r, 2t..2t+1),
// (r + 8, 2t..), (r, 2t+8..2t+9), (r + 8, 2t+8..)} at k = 16 j + .., r = 16 warp + lane / 4,
// t = lane % 4.  A warp's 8 rows of one chunk index are 8 distinct 16-byte bank groups.
template <typename T>
__device__ __forceinline__ void fp8_box_fragments(unsigned box, unsigned (&a)[4][4]) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, t = lane & 3;
  const unsigned sel = (t & 1) ? 0x7632u : 0x5410u;    // bytes 2t, 2t + 1 of the low and the high word
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + (lane >> 2) + 8 * h;
    const unsigned row = box + r * WF_W_ROW_BYTES;
    const int sw = (r >> 1) & 3;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 v = lds128(row + ((j ^ sw) << 4));
      const unsigned lo = (t & 2) ? v.y : v.x, hi = (t & 2) ? v.w : v.z;
      const unsigned q = __byte_perm(lo, hi, sel);   // k = 16j + 2t, +1, +8, +9
      a[j][h] = dsg::skinny::widen2<T>(q);
      a[j][2 + h] = dsg::skinny::widen2<T>(q >> 16);
    }
  }
}

// d (64 x N fp32) (+)= a (64 x 16, registers) * b (16 x N, shared memory descriptor); acc: d is
// overwritten (false) or accumulated into.
#define DSG_WGMMA_RA(shape, types, acc, ra, db, sd)                                                      \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " sd ", 0;\n"                                                      \
  "wgmma.mma_async.sync.aligned." shape ".f32." types "\n" acc ", " ra ", " db ", p, 1, 1, 0;\n}\n"
#define DSG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define DSG_RA(i) "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])
template <bool BF16, int N>
__device__ __forceinline__ void mma_rA_m64nk16(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b_desc,
                                               int acc) {
  static_assert(N == 16 || N == 32, "fp8 experts: wgmma N is 16 or 32");
  if constexpr (N == 16) {
    if constexpr (BF16)
      asm volatile(DSG_WGMMA_RA("m64n16k16", "bf16.bf16", "{%0, %1, %2, %3, %4, %5, %6, %7}", "{%8, %9, %10, %11}",
                                "%12", "%13")
                   : DSG_D8(0) : DSG_RA(0), "l"(b_desc), "r"(acc));
    else
      asm volatile(DSG_WGMMA_RA("m64n16k16", "f16.f16", "{%0, %1, %2, %3, %4, %5, %6, %7}", "{%8, %9, %10, %11}",
                                "%12", "%13")
                   : DSG_D8(0) : DSG_RA(0), "l"(b_desc), "r"(acc));
  } else {
    if constexpr (BF16)
      asm volatile(DSG_WGMMA_RA("m64n32k16", "bf16.bf16",
                                "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}",
                                "{%16, %17, %18, %19}", "%20", "%21")
                   : DSG_D8(0), DSG_D8(8) : DSG_RA(0), "l"(b_desc), "r"(acc));
    else
      asm volatile(DSG_WGMMA_RA("m64n32k16", "f16.f16",
                                "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}",
                                "{%16, %17, %18, %19}", "%20", "%21")
                   : DSG_D8(0), DSG_D8(8) : DSG_RA(0), "l"(b_desc), "r"(acc));
  }
}
#undef DSG_RA
#undef DSG_D8
#undef DSG_WGMMA_RA

// A tile's block scales in its two weights (s0 / s1; DOWN: both s0): its 128 rows lie in one row
// block, and a 64-wide K slice kt in one 128-wide K block.
template <int MODE, int N, int KD>
struct WgFp8Scales {
  static constexpr int RB = (N + WF_BLOCK - 1) / WF_BLOCK;
  static constexpr int KB = (KD + WF_BLOCK - 1) / WF_BLOCK;
  const float* sc0;
  const float* sc1;
  __device__ __forceinline__ WgFp8Scales(const WgTile& tl, const float* __restrict__ s0, const float* __restrict__ s1) {
    const i64 srow = ((i64)tl.e * RB + tl.n0 / WF_BLOCK) * KB;
    sc0 = s0 + srow;
    sc1 = (MODE == DOWN ? s0 : s1) + srow;
  }
  __device__ __forceinline__ float f0(int kt) const { return __ldg(sc0 + kt * WF_BK / WF_BLOCK); }
  __device__ __forceinline__ float f1(int kt) const { return __ldg(sc1 + kt * WF_BK / WF_BLOCK); }
};

// An in-flight wgmma's A registers: kept as they are until its group completes.
__device__ __forceinline__ void fence_fragments(unsigned (&a)[4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[j][0]), "+r"(a[j][1]), "+r"(a[j][2]), "+r"(a[j][3])::"memory");
}

// One tile's K loop and epilogue on the consumer warpgroup, BP pairs wide (the tile has <= BP).
// s0 / s1: the block scales of w0 / w1 (DOWN: both s0).  WAIT: the tile ran before the kernel's PDL
// wait, which comes between its K loop and its stores (pdl.cuh: no global write before it).
// AHEAD (Tuning.moe.fp8_widen_ahead, 16-pair tiles): the widening under the tensor core: a slice's two
// 64-row boxes go as two wgmma groups, box 1 widened while box 0's group runs, and the next slice's box 0
// (its stage awaited first) while box 1's runs, into next0; box 0's registers are rewritten only once its
// group is done (wait<1>).  The same products, scales and sums.  (At 32 pairs the next box, both boxes'
// products and the sums need more than 128 registers a thread: ptxas spilled.)
template <typename T, int MODE, int N, int KD, int ST, int BP, bool WAIT = false, bool AHEAD = false>
__device__ __forceinline__ void wgmma_fp8_tile(const WgTile& tl, const i32* __restrict__ order, unsigned ring,
                                               unsigned long long* full, unsigned long long* empty,
                                               const float* __restrict__ s0, const float* __restrict__ s1,
                                               T* __restrict__ out0, T* __restrict__ out1, int& it) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int KT = (KD + WF_BK - 1) / WF_BK;
  const int lane = threadIdx.x & 31;
  const WgFp8Scales<MODE, N, KD> sc(tl, s0, s1);
  float acc0[BP / 2], acc1[BP / 2], d0[BP / 2], d1[BP / 2];   // running sums; one slice's products
#pragma unroll
  for (int i = 0; i < BP / 2; ++i) acc0[i] = acc1[i] = 0.f;
  static_assert(!AHEAD || BP == 16, "fp8 experts: widen ahead on 16-pair tiles");
  unsigned next0[AHEAD ? 4 : 1][4];                      // AHEAD: the slice's box 0, widened already
  if constexpr (AHEAD) {
    mbar::wait(&full[it % ST], (it / ST) & 1);
    mbar::fence_proxy_async();
    fp8_box_fragments<T>(ring + it % ST * WF_STAGE_BYTES, next0);
  }
  for (int kt = 0; kt < KT; ++kt, ++it) {
    const int s = it % ST;
    const float f0 = sc.f0(kt), f1 = sc.f1(kt);
    if constexpr (!AHEAD) {
      mbar::wait(&full[s], (it / ST) & 1);
      mbar::fence_proxy_async();                         // the gathered rows were cp.async (generic) writes
    }
    const unsigned w = ring + s * WF_STAGE_BYTES;
    const unsigned long long db = wgmma::desc_sw128(w + WF_W_BYTES);
    unsigned a0[4][4], a1[4][4];
    if constexpr (AHEAD) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) a0[j][r] = next0[j][r];
      wgmma::fence();
#pragma unroll
      for (int k16 = 0; k16 < WF_BK / 16; ++k16)
        mma_rA_m64nk16<BF16, BP>(d0, a0[k16], wgmma::desc_advance(db, k16), k16);
      wgmma::commit();
      fp8_box_fragments<T>(w + WF_BOX * WF_W_ROW_BYTES, a1);
      wgmma::fence();
#pragma unroll
      for (int k16 = 0; k16 < WF_BK / 16; ++k16)
        mma_rA_m64nk16<BF16, BP>(d1, a1[k16], wgmma::desc_advance(db, k16), k16);
      wgmma::commit();
      if (kt + 1 < KT) {
        wgmma::wait<1>();                                // box 0's group done: its registers free
        fence_fragments(a0);
        mbar::wait(&full[(it + 1) % ST], ((it + 1) / ST) & 1);
        mbar::fence_proxy_async();
        fp8_box_fragments<T>(ring + (it + 1) % ST * WF_STAGE_BYTES, next0);
      }
      wgmma::wait<0>();
      fence_fragments(a1);
    } else {
      fp8_box_fragments<T>(w, a0);
      fp8_box_fragments<T>(w + WF_BOX * WF_W_ROW_BYTES, a1);
      wgmma::fence();
#pragma unroll
      for (int k16 = 0; k16 < WF_BK / 16; ++k16) {
        mma_rA_m64nk16<BF16, BP>(d0, a0[k16], wgmma::desc_advance(db, k16), k16);
        mma_rA_m64nk16<BF16, BP>(d1, a1[k16], wgmma::desc_advance(db, k16), k16);
      }
      wgmma::commit();
      wgmma::wait<0>();
    }
    wgmma::fence_operands(d0);
    wgmma::fence_operands(d1);
    if (kt + 1 < KT && lane == 0) mbar::arrive(&empty[s]);
#pragma unroll
    for (int i = 0; i < BP / 2; ++i) {
      acc0[i] = fmaf(f0, d0[i], acc0[i]);
      acc1[i] = fmaf(f1, d1[i], acc1[i]);
    }
  }
  if (lane == 0) mbar::arrive(&empty[(it - 1) % ST]);
  if constexpr (WAIT) dsg::pdl_wait();
  wgmma_skinny_store<T, MODE, N, BP>(tl, order, acc0, acc1, out0, out1);
}

// Thread 0, before the wait: the first PRE weight slices of the walk's first tile (expert e, output
// columns from n0) into ring stages 0..PRE-1 (the producer then skips issuing them: `preissued`).
template <int MODE, int N, int PRE>
__device__ __forceinline__ void wgmma_fp8_issue_first(char* ring, const TensorMap* w0, const TensorMap* w1, int e,
                                                      int n0, unsigned long long* full) {
#pragma unroll
  for (int s = 0; s < PRE; ++s)
    wgmma_issue_weights<MODE, N, WgFp8Tiles>(ring + s * WF_STAGE_BYTES + WgFp8Tiles::WEIGHTS_AT,
                                             w0, w1, s * WF_BK, n0, e, &full[s]);
}

// SH shared experts (moe_wgmma_skinny.cuh's SH: experts 0..SH-1, every token one pair of each at
// t * K + K - SH + s): a CTA whose first tile is one of theirs runs it whole before the kernel's PDL
// wait, its pairs from T alone (num_pairs / K) in token order in `sorder`, its stores after the
// wait; returns the walk's tiles it took (1, else 0).  Tile t < SH * NCT is the walk's own tile t
// once the route's offsets are read (its shared experts come first, one row tile each).  Only while
// a shared expert is one row tile (T <= WF_BP): the walk's other row tiles of it would take their
// pairs from the route's `order`, whose order inside a segment follows atomics, not tokens, so
// tokens 0..31 by T and pairs 32.. by `order` could overlap.
template <typename T, int MODE, int N, int KD, int K, int ST, int SH, bool AHEAD>
__device__ __forceinline__ int wgmma_fp8_shared_first(const T* __restrict__ x, const TensorMap* w0,
                                                      const TensorMap* w1, const float* __restrict__ s0,
                                                      const float* __restrict__ s1, const i32* __restrict__ order,
                                                      i32* sorder, char* ring_p,
                                                      unsigned ring, unsigned long long* full,
                                                      unsigned long long* empty, T* __restrict__ out0,
                                                      T* __restrict__ out1, int num_pairs) {
  constexpr int KT = (KD + WF_BK - 1) / WF_BK, NCT = wgmma_skinny_col_tiles(MODE, N);
  constexpr int PRE = ST < KT ? ST : KT;
  const int tokens = num_pairs / K, t = blockIdx.x;
  if (tokens > WF_BP || t >= SH * NCT) return 0;          // (uniform)
  WgTile tl;
  tl.e = t / NCT;                                         // tile t: shared expert t / NCT, all its pairs
  tl.rows = tokens;
  tl.n0 = (t % NCT) * wgmma_skinny_cols(MODE);
  if (threadIdx.x == 0) wgmma_fp8_issue_first<MODE, N, PRE>(ring_p, w0, w1, tl.e, tl.n0, full);
  if ((int)threadIdx.x < tl.rows) sorder[threadIdx.x] = threadIdx.x * K + K - SH + tl.e;
  // its pairs: rows of sorder, from T alone; the route's `order` may not be written yet
  tl.pbeg = 0;
  const i32* pairs = sorder;
  __syncthreads();
  int it = 0;
  if (threadIdx.x < 128)
    wgmma_produce_tile<T, MODE, N, KD, K, ST, WgFp8Tiles>(x, w0, w1, pairs, tl, ring_p, full, empty,
                                                          aligned_to<16>(x), it, PRE);
  else if (tl.rows <= 16)
    wgmma_fp8_tile<T, MODE, N, KD, ST, 16, true, AHEAD>(tl, pairs, ring, full, empty, s0, s1, out0, out1, it);
  else
    wgmma_fp8_tile<T, MODE, N, KD, ST, 32, true>(tl, pairs, ring, full, empty, s0, s1, out0, out1, it);
  return 1;
}

// The walk of 4e's grouped_gemm_wgmma_skinny on the FP8 tiles.  GATE_UP* wait at entry (the
// routing says which weights), but with SH shared experts (Tuning.moe.fp8_shared_before_wait) a CTA
// whose first tile is a shared expert's runs it before its wait (wgmma_fp8_shared_first; num_pairs
// then gives T).  DOWN starts its first tile's first slices before its wait (the routing is two
// launches back: moe_wgmma_skinny.cuh), all ST of them: down's one-token launch (one CTA an SM,
// ST = 16) thus issues twice the two-CTA launch's bytes before the wait.
template <typename T, int MODE, int E, int N, int KD, int K, int ST, int SH = 0, bool AHEAD = false>
__device__ __forceinline__ void grouped_gemm_wgmma_fp8(const T* __restrict__ x, const TensorMap* w0,
                                                       const TensorMap* w1, const float* __restrict__ s0,
                                                       const float* __restrict__ s1, const i32* __restrict__ order,
                                                       const i32* __restrict__ offsets, T* __restrict__ out0,
                                                       T* __restrict__ out1, char* smem, int num_pairs = 0) {
  using L = WgFp8Tiles;
  static_assert(sizeof(T) == 2, "fp8 experts: 16-bit activations");
  static_assert(KD % 16 == 0, "fp8 experts: FP8 rows of whole 16-byte chunks (TMA strides)");
  static_assert(ST >= 2, "fp8 experts: a ring of at least two stages");
  // Two CTAs an SM at the 8-stage ring (_moe_fp8.fits); down's one-token launch, one CTA an SM,
  // runs a deeper one (_moe_fp8.one_token_stages).  (+ the shared tile's pairs, 128 bytes.)
  static_assert((ST <= WF_STAGES ? 2 : 1) * (wgmma_fp8_smem(ST) + 2 * ST * 8 + 4 * (E + 1) + 4 * WF_BP + 1024) <=
                    228 * 1024,
                "fp8 experts: two CTAs per SM at eight stages, one at more");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST];
  __shared__ int tiles[E + 1];
  constexpr bool EARLY = MODE == DOWN;
  constexpr bool SHARED_EARLY = !EARLY && SH > 0;
  __shared__ i32 shared_order[SHARED_EARLY ? WF_BP : 1];   // the early shared tile's pairs
  if constexpr (!EARLY && !SHARED_EARLY) {
    dsg::pdl_wait();
    dsg::pdl_launch_dependents();
  }
  const unsigned raw = smem_u32(smem);
  const unsigned ring = (raw + 1023u) & ~1023u;
  char* ring_p = smem + (ring - raw);
  if constexpr (!SHARED_EARLY) {
    if (threadIdx.x < 32) wgmma_row_tiles<E, WF_BP, EARLY>(offsets, tiles);
  }
  if (threadIdx.x == 0) wgmma_ring_init<ST>(full, empty, 4);   // one consumer warpgroup
  __syncthreads();
  constexpr int KT = (KD + WF_BK - 1) / WF_BK, NCT = wgmma_skinny_col_tiles(MODE, N);
  constexpr int PRE = EARLY ? (ST < KT ? ST : KT) : 0;
  int preissued = 0, skip = 0;
  if constexpr (SHARED_EARLY) {
    skip = wgmma_fp8_shared_first<T, MODE, N, KD, K, ST, SH, AHEAD>(x, w0, w1, s0, s1, order, shared_order, ring_p,
                                                                    ring, full, empty, out0, out1, num_pairs);
    dsg::pdl_wait();
    dsg::pdl_launch_dependents();
    if (threadIdx.x < 32) wgmma_row_tiles<E, WF_BP, false>(offsets, tiles);
    __syncthreads();
  }
  if constexpr (EARLY) {
    if ((int)blockIdx.x < tiles[E] * NCT) {
      preissued = PRE;
      const int t = blockIdx.x;
      if (threadIdx.x == 0)
        wgmma_fp8_issue_first<MODE, N, PRE>(ring_p, w0, w1, wgmma_tile_expert<E>(tiles, t / NCT),
                                            (t % NCT) * wgmma_skinny_cols(MODE), full);
    }
    dsg::pdl_wait();
    dsg::pdl_launch_dependents();
  }
  if (threadIdx.x < 128) {
    wgmma_produce<T, MODE, E, N, KD, K, ST, L>(x, w0, w1, order, offsets, tiles, ring_p, full, empty, preissued, skip);
  } else {
    const int total = tiles[E] * NCT;
    int it = skip * KT;                                  // `skip`: the walk's first tile done already
    for (int t = blockIdx.x + skip * gridDim.x; t < total; t += gridDim.x) {
      const WgTile tl = wgmma_tile<E, NCT, wgmma_skinny_cols(MODE), WF_BP>(tiles, offsets, t);
      if (tl.rows <= 16)
        wgmma_fp8_tile<T, MODE, N, KD, ST, 16, false, AHEAD>(tl, order, ring, full, empty, s0, s1, out0, out1, it);
      else
        wgmma_fp8_tile<T, MODE, N, KD, ST, 32>(tl, order, ring, full, empty, s0, s1, out0, out1, it);
    }
  }
}

}  // namespace moe
}  // namespace dsg
