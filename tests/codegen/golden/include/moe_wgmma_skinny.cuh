// 4e. Decode's grouped expert GEMM on wgmma + TMA (sm_90a): experts with a few pairs each.
// Same contract as grouped_gemm (moe_grouped.cuh 4b / 4c): pairs grouped by expert through `order` /
// `offsets`, the same outputs rounded at the same points, no host sync.  It is the swapped tile of
// 4c (the weight rows as the MMA's M side, the pairs as N) fed the way the prefill GEMM
// (moe_wgmma.cuh) is fed, because at decode the kernel's whole job is streaming weight bytes:
//   * tile = (expert, a row tile of up to 64 of its pairs, a column tile of 128 weight rows:
//     64 gate + the same 64 up rows, or 128 down rows); a persistent grid (two CTAs per SM) walks
//     the tiles t = blockIdx.x, + gridDim.x, ... in (row tile, column tile) order, the row tiles
//     numbered over the experts from `offsets` (wgmma_row_tiles), so an expert without pairs costs
//     nothing and one with 1 pair costs one read of its rows;
//   * a stage is one 64-wide K slice: the weight rows as two TMA boxes of 64 rows (128B swizzle,
//     16 KB: one request each, where 4c's cp.async ring made 1024 16-byte requests) and the
//     tile's pair rows gathered through `order` with 16-byte cp.async (moe_wgmma.cuh's gather);
//   * warpgroup 0 produces, warpgroup 1 consumes: two wgmma m64nBPk16 a 16-wide K step (rows
//     0-63 and 64-127 of the stage) with BP = 16 / 32 / 64 picked per tile from its pair count;
//   * the epilogue stores straight from the accumulators (a decode step writes ~MBs, reads ~GBs):
//     GATE_UP_SILU: a thread holds the gate and the up accumulator of one output column and pair.
// Needs 16-bit T and KD % 8 == 0, like the prefill GEMM; the lowering emits it only then
// (codegen/families/_moe_wgmma_skinny.py).  An x base that is not 16-byte aligned takes element
// loads into the same layout; outputs are stored element by element at any alignment.
#pragma once
#include "cluster.cuh"
#include "moe_wgmma.cuh"

namespace dsg {
namespace moe {

constexpr int WS_BP = 64;             // pairs per row tile: the widest N of the decode wgmma
constexpr int WS_ROWS = 128;          // weight rows per tile: two 64-row TMA boxes
constexpr int WS_BOX = 64;            // weight rows per TMA box
constexpr int WS_BK = WG_BK;          // K slice: one 128-byte swizzled row
constexpr int WS_THREADS = 256;       // producer warpgroup + consumer warpgroup
constexpr int WS_ROW_BYTES = WG_ROW_BYTES;
constexpr int WS_W_BYTES = WS_ROWS * WS_ROW_BYTES;               // 16 KB of weights a stage
constexpr int WS_STAGE_BYTES = WS_W_BYTES + WS_BP * WS_ROW_BYTES;  // + 8 KB of pair rows: 24 KB

// Output columns a tile covers, and the column tiles of N output columns.
__host__ __device__ constexpr int wgmma_skinny_cols(int mode) { return mode == DOWN ? WS_ROWS : WS_ROWS / 2; }
__host__ __device__ constexpr int wgmma_skinny_col_tiles(int mode, int n) {
  return (n + wgmma_skinny_cols(mode) - 1) / wgmma_skinny_cols(mode);
}
// Dynamic shared memory: the ring plus slack to start it on a 1024-byte boundary (128B swizzle;
// every stage, and its pair rows 16 KB in, stay on one).  4 stages: 97 KB, two CTAs per SM.
__host__ __device__ constexpr int wgmma_skinny_smem(int stages) { return stages * WS_STAGE_BYTES + 1024; }

// The decode tile for moe_wgmma.cuh's producer (which gathers the pair rows and issues the boxes):
// 64 pairs, 64-row boxes, the weights first in a stage and the pair rows after them.
struct WgSkinnyTiles {
  static constexpr int BM = WS_BP, BOX = WS_BOX, STAGE_BYTES = WS_STAGE_BYTES;
  static constexpr int ROWS_AT = WS_W_BYTES, WEIGHTS_AT = 0, W_ROW_BYTES = WS_ROW_BYTES;
  // Weight boxes with L2's evict_first policy: read once a step, they go first, and the lines of
  // `a` and of the outputs stay (+0.03-0.05 TB/s at b=128 and 256 on the H200, even below).
  static constexpr bool W_EVICT_FIRST = true;
  __host__ __device__ static constexpr int cols(int mode) { return wgmma_skinny_cols(mode); }
};

// A tile's epilogue, stored straight from the accumulators (acc0 / acc1: stage rows 0-63 / 64-127
// against the tile's pairs; a decode step writes ~MBs, reads ~GBs).
template <typename T, int MODE, int N, int BP>
__device__ __forceinline__ void wgmma_skinny_store(const WgTile& tl, const i32* __restrict__ order,
                                                   const float (&acc0)[BP / 2], const float (&acc1)[BP / 2],
                                                   T* __restrict__ out0, T* __restrict__ out1) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  auto st = [&](T* p, float v) { *p = from_float<T>(v); };
  // acc[4j + 2h + c]: stage row 16 warp + lane / 4 + 8h (an output column), pair 8j + 2 (lane % 4) + c.
#pragma unroll
  for (int j = 0; j < BP / 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = 8 * j + 2 * (lane & 3) + c;          // pair within the tile
      if (r >= tl.rows) continue;
      const i64 orow = (i64)order[tl.pbeg + r] * N;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * j + 2 * h + c;
        const int col = tl.n0 + 16 * warp + (lane >> 2) + 8 * h;
        if constexpr (MODE == DOWN) {
          if (col < N) st(out0 + orow + col, acc0[i]);
          if (col + WS_BOX < N) st(out0 + orow + col + WS_BOX, acc1[i]);
        } else if (col < N) {
          if constexpr (MODE == GATE_UP_SILU) {
            // silu(g) * u rounded where the unfused ops round (moe_grouped.cuh 4c's epilogue)
            const float gr = round_to<T>(acc0[i]), ur = round_to<T>(acc1[i]);
            st(out0 + orow + col, round_to<T>(gr / (1.f + expf(-gr))) * ur);
          } else {
            st(out0 + orow + col, acc0[i]);
            st(out1 + orow + col, acc1[i]);
          }
        }
      }
    }
}

// ---- The epilogue through shared memory (DSG_WS_STAGED_FROM_BP, from the lowering) ----------------
// The element stores above scatter 2-byte values (a thread holds one output column of BP / 4
// pairs).  At b=256 the tiles' stores cost the expert kernels 0.36 ms a decode step, at b=128 0.08
// (on the H200 the same kernels with the stores of the tiles of 17+ pairs left out went from
// 3.91 to 4.10 TB/s at b=256).  Tiles of at least WS_STAGED_FROM_BP pairs (0: none) instead keep
// the ring stage of their last K slice (24 KB; a DOWN tile's 64 pairs x 128 columns are 16 KB),
// write the rounded outputs into it as [pair][column] rows (16-byte chunk k of row r at
// k ^ (r % 8): conflict-free), meet at the consumer warpgroup's named barrier, store whole 16-byte
// chunks of each pair's row (a warp writes 512 contiguous bytes of two rows), and only then free
// the stage.  DOWN and GATE_UP_SILU (one output each); GATE_UP keeps the element stores.  The
// kernel's source defines DSG_WS_STAGED_FROM_BP before it includes this header (the lowering's:
// Tuning.moe.expert_ffn_staged_from / decode_staged_from); without it, 0.
#ifndef DSG_WS_STAGED_FROM_BP
#define DSG_WS_STAGED_FROM_BP 0
#endif
constexpr int WS_STAGED_FROM_BP = DSG_WS_STAGED_FROM_BP;
constexpr int WS_CONSUMER_BAR = 1;    // the consumer warpgroup's named barrier (moe_expert_ffn.cuh's too)

__device__ __forceinline__ void sts_u16(unsigned addr, unsigned short v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}

// `st`: the shared address of the stage the outputs go through (1024-byte aligned).
template <typename T, int MODE, int N, int BP>
__device__ __forceinline__ void wgmma_skinny_store_staged(const WgTile& tl, const i32* __restrict__ order,
                                                          const float (&acc0)[BP / 2], const float (&acc1)[BP / 2],
                                                          T* __restrict__ out0, unsigned st) {
  static_assert(MODE == DOWN || MODE == GATE_UP_SILU, "staged epilogue: one output");
  constexpr int COLS = wgmma_skinny_cols(MODE), RB = COLS * 2, CH = COLS / 8;
  static_assert(BP * RB <= WS_STAGE_BYTES, "staged epilogue: the tile's outputs fit one ring stage");
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, tid = threadIdx.x & 127;
  auto put = [&](int r, int col, float v) {
    const T e = from_float<T>(v);
    sts_u16(st + r * RB + (((col >> 3) ^ (r & 7)) << 4) + ((col & 7) << 1),
            *reinterpret_cast<const unsigned short*>(&e));
  };
  // acc[4j + 2h + c]: stage row 16 warp + lane / 4 + 8h (an output column), pair 8j + 2 (lane % 4) + c.
#pragma unroll
  for (int j = 0; j < BP / 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = 8 * j + 2 * (lane & 3) + c;          // rows past the tile's pairs: written, never stored
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * j + 2 * h + c, col = 16 * warp + (lane >> 2) + 8 * h;
        if constexpr (MODE == DOWN) {
          put(r, col, acc0[i]);
          put(r, col + WS_BOX, acc1[i]);
        } else {
          // silu(g) * u rounded where the unfused ops round (moe_grouped.cuh 4c's epilogue)
          const float gr = round_to<T>(acc0[i]), ur = round_to<T>(acc1[i]);
          put(r, col, round_to<T>(gr / (1.f + expf(-gr))) * ur);
        }
      }
    }
  wgmma::warpgroup_sync(WS_CONSUMER_BAR);                // every row of the stage is written
  const bool vec = N % 8 == 0 && aligned_to<16>(out0);   // (uniform) whole 16-byte chunks, else elements
#pragma unroll 4
  for (int q = tid; q < BP * CH; q += 128) {
    const int r = q / CH, k = q % CH, col = tl.n0 + 8 * k;
    if (r >= tl.rows || col >= N) continue;
    const float4 bits = dsg::cluster::ld4<false>(st + r * RB + ((k ^ (r & 7)) << 4));   // 8 elements, as bits
    store_chunk<T, N>(out0 + (i64)order[tl.pbeg + r] * N + col, *reinterpret_cast<const uint4*>(&bits), col, vec);
  }
}

// One tile's K loop and epilogue on the consumer warpgroup, BP pairs wide (the tile has <= BP).
// `it` is the ring position of the tile's first slice (advanced past its last).  WAIT: the tile
// ran before the kernel's PDL wait, which comes between its K loop and its stores (pdl.cuh: no
// global write before it).
template <typename T, int MODE, int N, int KD, int ST, int BP, bool WAIT = false>
__device__ __forceinline__ void wgmma_skinny_tile(const WgTile& tl, const i32* __restrict__ order, unsigned ring,
                                                  unsigned long long* full, unsigned long long* empty,
                                                  T* __restrict__ out0, T* __restrict__ out1, int& it) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int KT = (KD + WS_BK - 1) / WS_BK;
  const int lane = threadIdx.x & 31;
  float acc0[BP / 2], acc1[BP / 2];                      // stage rows 0-63, 64-127
#pragma unroll
  for (int i = 0; i < BP / 2; ++i) acc0[i] = acc1[i] = 0.f;
  wgmma::fence_operands(acc0);
  wgmma::fence_operands(acc1);
  for (int kt = 0; kt < KT; ++kt, ++it) {
    const int s = it % ST;
    mbar::wait(&full[s], (it / ST) & 1);
    mbar::fence_proxy_async();                           // the gathered rows were cp.async (generic) writes
    const unsigned w = ring + s * WS_STAGE_BYTES;
    const unsigned long long d0 = wgmma::desc_sw128(w), d1 = wgmma::desc_sw128(w + WS_BOX * WS_ROW_BYTES),
                             db = wgmma::desc_sw128(w + WS_W_BYTES);
    wgmma::fence();
#pragma unroll
    for (int k16 = 0; k16 < WS_BK / 16; ++k16) {
      wgmma::mma_m64nk16<BF16, BP>(acc0, wgmma::desc_advance(d0, k16), wgmma::desc_advance(db, k16));
      wgmma::mma_m64nk16<BF16, BP>(acc1, wgmma::desc_advance(d1, k16), wgmma::desc_advance(db, k16));
    }
    wgmma::commit();
    // Free this slice's stage as soon as its wgmma have read it, not once the next slice is issued
    // (wait<1>): the producer keeps all ST stages ahead of the slice being read, not ST - 1.
    // Measured on the H200: the expert kernels +0.7-0.9% at every batch.  The
    // tile's last stage is freed after the epilogue (the staged one stores through it).
    wgmma::wait<0>();
    if (kt + 1 < KT && lane == 0) mbar::arrive(&empty[s]);
  }
  wgmma::wait<0>();
  wgmma::fence_operands(acc0);
  wgmma::fence_operands(acc1);
  if constexpr (WAIT) dsg::pdl_wait();
  constexpr bool STAGED = WS_STAGED_FROM_BP > 0 && BP >= WS_STAGED_FROM_BP && MODE != GATE_UP;
  const int last = (it - 1) % ST;                        // the stage of the tile's last K slice
  if constexpr (STAGED) {
    wgmma_skinny_store_staged<T, MODE, N, BP>(tl, order, acc0, acc1, out0, ring + last * WS_STAGE_BYTES);
    mbar::fence_proxy_async();                           // this stage's generic accesses before the next TMA
    __syncwarp();
  }
  if (lane == 0) mbar::arrive(&empty[last]);
  if constexpr (!STAGED) wgmma_skinny_store<T, MODE, N, BP>(tl, order, acc0, acc1, out0, out1);
}

// One tile on the consumer at the narrowest of BP = 16 / 32 / 64 that holds its pairs.
template <typename T, int MODE, int N, int KD, int ST, bool WAIT = false>
__device__ __forceinline__ void wgmma_skinny_tile_fit(const WgTile& tl, const i32* __restrict__ order, unsigned ring,
                                                      unsigned long long* full, unsigned long long* empty,
                                                      T* __restrict__ out0, T* __restrict__ out1, int& it) {
  if (tl.rows <= 16) wgmma_skinny_tile<T, MODE, N, KD, ST, 16, WAIT>(tl, order, ring, full, empty, out0, out1, it);
  else if (tl.rows <= 32) wgmma_skinny_tile<T, MODE, N, KD, ST, 32, WAIT>(tl, order, ring, full, empty, out0, out1, it);
  else wgmma_skinny_tile<T, MODE, N, KD, ST, 64, WAIT>(tl, order, ring, full, empty, out0, out1, it);
}

// Consumer: warpgroup 1, the walk's tiles.
template <typename T, int MODE, int E, int N, int KD, int ST>
__device__ __forceinline__ void wgmma_skinny_consume(const i32* __restrict__ order, const i32* __restrict__ offsets,
                                                     const int* tiles, unsigned ring, unsigned long long* full,
                                                     unsigned long long* empty, T* __restrict__ out0,
                                                     T* __restrict__ out1, int skip = 0) {
  constexpr int NCT = wgmma_skinny_col_tiles(MODE, N), KT = (KD + WS_BK - 1) / WS_BK;
  const int total = tiles[E] * NCT;
  int it = skip * KT;                                    // `skip`: the walk's first tiles done already
  for (int t = blockIdx.x + skip * gridDim.x; t < total; t += gridDim.x)
    wgmma_skinny_tile_fit<T, MODE, N, KD, ST>(wgmma_tile<E, NCT, wgmma_skinny_cols(MODE), WS_BP>(tiles, offsets, t),
                                              order, ring, full, empty, out0, out1, it);
}

// Thread 0, before the wait: the first PRE weight slices of the walk's first tile (expert e, output
// columns from n0) into ring stages 0..PRE-1 (wgmma_produce then skips issuing them: `preissued`).
template <int MODE, int N, int PRE>
__device__ __forceinline__ void wgmma_skinny_issue_first(char* ring, const TensorMap* w0, const TensorMap* w1, int e,
                                                         int n0, unsigned long long* full) {
#pragma unroll
  for (int s = 0; s < PRE; ++s)
    wgmma_issue_weights<MODE, N, WgSkinnyTiles>(ring + s * WS_STAGE_BYTES + WgSkinnyTiles::WEIGHTS_AT, w0, w1,
                                                s * WS_BK, n0, e, &full[s]);
}

// SH: the shared experts among the pairs (moe_route's shared_experts: experts 0..SH-1, every token
// one pair of each, so offsets[s] = s * T for s <= SH), whose first slices GATE_UP* starts before
// its wait; num_pairs (NP = T * K) then gives T.  0: none (DOWN's early start is its own).  A CTA
// whose first tile is a shared expert's runs that whole tile before its wait (see below).
template <typename T, int MODE, int E, int N, int KD, int K, int ST, int SH = 0>
__device__ __forceinline__ void grouped_gemm_wgmma_skinny(const T* __restrict__ x, const TensorMap* w0,
                                                          const TensorMap* w1, const i32* __restrict__ order,
                                                          const i32* __restrict__ offsets, T* __restrict__ out0,
                                                          T* __restrict__ out1, char* smem, int num_pairs = 0) {
  static_assert(sizeof(T) == 2, "wgmma skinny gemm: 16-bit operands");
  static_assert(KD % 8 == 0, "wgmma skinny gemm: rows of whole 16-byte chunks (TMA strides, cp.async)");
  static_assert(ST >= 2, "wgmma skinny gemm: a ring of at least two stages");
  // Two CTAs an SM at the 4-stage ring (_moe_wgmma_skinny.fits); down's one-token launch, one
  // CTA an SM, runs a deeper one (Tuning.moe.one_token_down_stages).
  static_assert((ST <= 4 ? 2 : 1) * (wgmma_skinny_smem(ST) + 2 * ST * 8 + 4 * (E + 1) + 4 * WS_BP + 1024) <=
                    228 * 1024,
                "wgmma skinny gemm: two CTAs per SM at four stages, one at more");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST];
  __shared__ int tiles[E + 1];
  __shared__ i32 shared_order[SH > 0 ? WS_BP : 1];       // the early shared tile's pairs
  // DOWN follows gate_up_silu, which waits for the route before it lets DOWN launch: the route's
  // `offsets` are complete before DOWN's first CTA runs (pdl.cuh, two launches back), so DOWN
  // builds its tile table and starts its first tile's first ST weight slices (no kernel writes
  // weights) before its wait, into the tail of gate_up_silu (that boundary cost
  // ~1.9 us a layer).  The pairs' rows (x, gate_up_silu's output) are gathered after it.
  // GATE_UP* follows the route itself: every read of another kernel's output after the wait.  But
  // with SH shared experts the walk's first SH * cdiv(T, WS_BP) row tiles are theirs whatever the
  // route says (experts 0..SH-1 hold T pairs each: wgmma_row_tiles makes the same table from the
  // offsets after the wait), so a CTA whose first tile is one of them runs that first tile's whole
  // K loop before its wait, while the route runs, its pair rows gathered too; the
  // consumer waits only before it stores the tile's outputs (no write before the wait: a workspace
  // freed by the route, which still runs, may hold them).  Its pairs are known from T alone (token
  // t's shared pair s is t * K + K - SH + s: moe_route's layout, moe_router.cuh topk_scored), so
  // the tile takes them in token order from shared_order instead of `order` (the route's, whose
  // order inside a segment follows its atomics: each pair is computed on its own, so the outputs
  // are the same bits).  x, the pair rows, is read through L2 (cp.async.cg) as DOWN reads
  // `offsets`: the kernel before the route wrote it, and the route waited for that kernel before it
  // let this launch start.
  constexpr bool EARLY = MODE == DOWN;
  constexpr bool SHARED_EARLY = !EARLY && SH > 0;
  if constexpr (!EARLY && !SHARED_EARLY) {
    dsg::pdl_wait();
    dsg::pdl_launch_dependents();
  }
  const unsigned raw = smem_u32(smem);
  const unsigned ring = (raw + 1023u) & ~1023u;         // 128B-swizzle tiles start on 1024-byte boundaries
  if constexpr (!SHARED_EARLY) {
    if (threadIdx.x < 32) wgmma_row_tiles<E, WS_BP, EARLY>(offsets, tiles);
  }
  if (threadIdx.x == 0) wgmma_ring_init<ST>(full, empty, 4);   // one consumer warpgroup
  __syncthreads();
  constexpr int KT = (KD + WS_BK - 1) / WS_BK, NCT = wgmma_skinny_col_tiles(MODE, N);
  constexpr int PRE = EARLY || SHARED_EARLY ? (ST < KT ? ST : KT) : 0;   // slices of the walk's first tile issued early
  int preissued = 0, skip = 0;
  if constexpr (SHARED_EARLY) {
    const int tokens = num_pairs / K;
    const int per = (tokens + WS_BP - 1) / WS_BP;         // row tiles of one shared expert (T pairs)
    if ((int)blockIdx.x < SH * per * NCT) {               // (uniform)
      preissued = PRE;
      const int t = blockIdx.x, rt = (t / NCT) % per;     // tile t: shared expert t / NCT / per, row tile rt
      WgTile tl;
      tl.e = t / NCT / per;
      tl.pbeg = 0;                                        // (rows of shared_order)
      tl.rows = min(WS_BP, tokens - rt * WS_BP);
      tl.n0 = (t % NCT) * wgmma_skinny_cols(MODE);
      if (threadIdx.x == 0) wgmma_skinny_issue_first<MODE, N, PRE>(smem + (ring - raw), w0, w1, tl.e, tl.n0, full);
      if ((int)threadIdx.x < tl.rows) shared_order[threadIdx.x] = (rt * WS_BP + threadIdx.x) * K + K - SH + tl.e;
      __syncthreads();
      int it = 0;
      if (threadIdx.x < 128)
        wgmma_produce_tile<T, MODE, N, KD, K, ST, WgSkinnyTiles>(x, w0, w1, shared_order, tl, smem + (ring - raw),
                                                                 full, empty, aligned_to<16>(x), it, PRE);
      else
        wgmma_skinny_tile_fit<T, MODE, N, KD, ST, true>(tl, shared_order, ring, full, empty, out0, out1, it);
      preissued = 0;
      skip = 1;
    }
    dsg::pdl_wait();
    dsg::pdl_launch_dependents();
    if (threadIdx.x < 32) wgmma_row_tiles<E, WS_BP, false>(offsets, tiles);
    __syncthreads();
  }
  if constexpr (EARLY) {
    if (blockIdx.x < tiles[E] * NCT) {
      preissued = PRE;
      const int t = blockIdx.x;
      if (threadIdx.x == 0)
        wgmma_skinny_issue_first<MODE, N, PRE>(smem + (ring - raw), w0, w1, wgmma_tile_expert<E>(tiles, t / NCT),
                                               (t % NCT) * wgmma_skinny_cols(MODE), full);
    }
    dsg::pdl_wait();
    dsg::pdl_launch_dependents();
  }
  DSG_PHASE(4);   // phases.cuh: the walk starts (its tile table built)
  if (threadIdx.x < 128)
    wgmma_produce<T, MODE, E, N, KD, K, ST, WgSkinnyTiles>(x, w0, w1, order, offsets, tiles, smem + (ring - raw),
                                                           full, empty, preissued, skip);
  else
    wgmma_skinny_consume<T, MODE, E, N, KD, ST>(order, offsets, tiles, ring, full, empty, out0, out1, skip);
  DSG_PHASE_EXIT();
}

}  // namespace moe
}  // namespace dsg
