// 4e. Decode's grouped expert GEMM on wgmma + TMA (sm_90a): experts with a few pairs each.
// Same contract as grouped_gemm (moe.cuh 4b / 4c): pairs grouped by expert through `order` /
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
#include "moe_wgmma.cuh"
#include "tickets.cuh"

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

// Output columns a tile covers.
__host__ __device__ constexpr int wgmma_skinny_cols(int mode) { return mode == DOWN ? WS_ROWS : WS_ROWS / 2; }
// Dynamic shared memory: the ring plus slack to start it on a 1024-byte boundary (128B swizzle;
// every stage, and its pair rows 16 KB in, stay on one).  4 stages: 97 KB, two CTAs per SM.
__host__ __device__ constexpr int wgmma_skinny_smem(int stages) { return stages * WS_STAGE_BYTES + 1024; }

// The decode tile for moe_wgmma.cuh's producer (which gathers the pair rows and issues the boxes):
// 64 pairs, 64-row boxes, the weights first in a stage and the pair rows after them.
struct WgSkinnyTiles {
  static constexpr int BM = WS_BP, BOX = WS_BOX, STAGE_BYTES = WS_STAGE_BYTES;
  static constexpr int ROWS_AT = WS_W_BYTES, WEIGHTS_AT = 0;
  __host__ __device__ static constexpr int cols(int mode) { return wgmma_skinny_cols(mode); }
};

// Stream-K (SPLIT > 0, PERF_NOTES v17).  Whole tiles dealt round the grid leave a last partial
// round: at b=128, down's 1088 tiles over 264 CTAs are 4.1 rounds, and 32 CTAs stream the fifth
// alone.  Instead the first `ctas` CTAs split the walk's units (tile, K slice), total x KT of
// them, evenly: CTA c takes a run of U / ctas or one more in walk order, so a tile may
// span CTAs c0 < c1 < ... .  Each ci > c0 starts its range inside the tile: it publishes its fp32
// partial sums (its first item) to its slot and raises its flag; c0 (the tile's K slice 0, its
// last item) waits for c0 + 1, c0 + 2, ... in that order, adds their partials to its own and runs
// the epilogue.  The sum's order is fixed by the split, so a launch's output does not depend on
// timing.  No deadlock: a CTA waits only for CTAs after it, which wait for nothing before it,
// and PDL lets the next kernel's CTAs in only after every CTA of this grid has started.
// ctas = min(grid, WS_SLOTS, U / SPLIT): every CTA gets at least SPLIT slices.
constexpr int WS_SLOTS = 264;         // partial slots: 2 CTAs an SM x 132 SMs, the largest sm_90 part
constexpr int WS_PARTIAL = WS_BP * 128;   // floats of one CTA's partial: BP accumulators x 128 threads
__device__ float wgs_partials[WS_SLOTS * WS_PARTIAL];
__device__ int wgs_ready[WS_SLOTS];   // zero when the module loads; each launch leaves them at zero

// The decode walk.  SPLIT 0: whole tiles, cyclic (WgCyclicWalk's order); else stream-K as above,
// the first units % ctas CTAs one slice more than the others.  32-bit: units is at most a few
// hundred thousand (tiles x K slices), and no 64-bit division (a CALL) runs before DOWN's wait.
template <int SPLIT, int KT>
struct WgSkinnyWalk {
  int units, ctas, each, extra, u, end;
  __device__ __forceinline__ WgSkinnyWalk(int total) {
    units = total * KT;
    if constexpr (SPLIT == 0) {
      ctas = gridDim.x;
      each = extra = 0;
      u = blockIdx.x;                                    // a tile number here
      end = total;
    } else {
      ctas = min(min((int)gridDim.x, WS_SLOTS), max(1, units / SPLIT));
      each = units / ctas;
      extra = units - each * ctas;
      u = begin(blockIdx.x);
      end = begin(blockIdx.x + 1);
    }
  }
  // First unit of CTA c's range (the end of every range past the last CTA's).
  __device__ __forceinline__ int begin(int c) const { return c >= ctas ? units : c * each + min(c, extra); }
  __device__ __forceinline__ bool next(WgItem& w) {
    if (u >= end) return false;
    if constexpr (SPLIT == 0) {
      w = {u, 0, KT};
      u += gridDim.x;
    } else {
      const int t = u / KT, lo = u - t * KT, hi = min(KT, lo + (end - u));
      w = {t, lo, hi};
      u += hi - lo;
    }
    return true;
  }
};

// A continuation's partial sums to this CTA's slot, then its flag (the consumer warpgroup).
template <int BP>
__device__ __forceinline__ void wgmma_skinny_publish(const float (&acc0)[BP / 2], const float (&acc1)[BP / 2]) {
  const int tid = threadIdx.x & 127;
  float* slot = wgs_partials + (i64)blockIdx.x * WS_PARTIAL;
#pragma unroll
  for (int i = 0; i < BP / 2; ++i) {
    slot[i * 128 + tid] = acc0[i];                       // 128 threads: one 512-byte run per i
    slot[(BP / 2 + i) * 128 + tid] = acc1[i];
  }
  wgmma::warpgroup_sync(1);                              // every thread's partial, gathered to thread 0
  if (tid == 0) flag_raise(&wgs_ready[blockIdx.x]);
}

// The owner of tile `item.t` (its slice 0, this CTA's last item): adds the partials of the CTAs
// after it that hold the tile's other slices, in CTA order.
template <int BP, typename Walk>
__device__ __forceinline__ void wgmma_skinny_add_partials(float (&acc0)[BP / 2], float (&acc1)[BP / 2],
                                                          const Walk& walk, const WgItem& item, int kt) {
  const int tid = threadIdx.x & 127;
  const int tile_end = (item.t + 1) * kt;
  for (int c = blockIdx.x + 1; walk.begin(c) < tile_end; ++c) {
    if (tid == 0) flag_await_and_lower(&wgs_ready[c]);
    wgmma::warpgroup_sync(1);                            // the flag seen before any thread reads the slot
    const float* slot = wgs_partials + (i64)c * WS_PARTIAL;
#pragma unroll
    for (int i = 0; i < BP / 2; ++i) {
      acc0[i] += __ldcg(slot + i * 128 + tid);
      acc1[i] += __ldcg(slot + (BP / 2 + i) * 128 + tid);
    }
  }
}

// One item's K loop (slices item.k_lo .. k_hi of tile tl) and, where it holds slice 0, the tile's
// epilogue, on the consumer warpgroup, BP pairs wide (the tile has <= BP).  `it` is the ring
// position of the item's first slice (advanced past its last).
template <typename T, int MODE, int N, int KD, int ST, int BP, typename Walk>
__device__ __forceinline__ void wgmma_skinny_tile(const WgTile& tl, const WgItem& item, const Walk& walk,
                                                  const i32* __restrict__ order, unsigned ring,
                                                  unsigned long long* full, unsigned long long* empty,
                                                  T* __restrict__ out0, T* __restrict__ out1, int& it) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int KT = (KD + WS_BK - 1) / WS_BK;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float acc0[BP / 2], acc1[BP / 2];                      // stage rows 0-63, 64-127
#pragma unroll
  for (int i = 0; i < BP / 2; ++i) acc0[i] = acc1[i] = 0.f;
  wgmma::fence_operands(acc0);
  wgmma::fence_operands(acc1);
  for (int kt = item.k_lo; kt < item.k_hi; ++kt, ++it) {
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
    wgmma::wait<1>();                                    // the slice before this one is read: free it
    if (kt > item.k_lo && lane == 0) mbar::arrive(&empty[(it - 1) % ST]);
  }
  wgmma::wait<0>();
  wgmma::fence_operands(acc0);
  wgmma::fence_operands(acc1);
  if (lane == 0) mbar::arrive(&empty[(it - 1) % ST]);
  if (item.k_lo > 0) {                                   // a continuation: the owner stores the tile
    wgmma_skinny_publish<BP>(acc0, acc1);
    return;
  }
  if (item.k_hi < KT) wgmma_skinny_add_partials<BP>(acc0, acc1, walk, item, KT);

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
          if (col < N) out0[orow + col] = from_float<T>(acc0[i]);
          if (col + WS_BOX < N) out0[orow + col + WS_BOX] = from_float<T>(acc1[i]);
        } else if (col < N) {
          if constexpr (MODE == GATE_UP_SILU) {
            // silu(g) * u rounded where the unfused ops round (moe.cuh 4c's epilogue)
            const float gr = round_to<T>(acc0[i]), ur = round_to<T>(acc1[i]);
            out0[orow + col] = from_float<T>(round_to<T>(gr / (1.f + expf(-gr))) * ur);
          } else {
            out0[orow + col] = from_float<T>(acc0[i]);
            out1[orow + col] = from_float<T>(acc1[i]);
          }
        }
      }
    }
}

// Consumer: warpgroup 1.  Each tile at the narrowest of BP = 16 / 32 / 64 that holds its pairs.
template <typename T, int MODE, int E, int N, int KD, int ST, typename Walk>
__device__ __forceinline__ void wgmma_skinny_consume(const i32* __restrict__ order, const i32* __restrict__ offsets,
                                                     const int* tiles, unsigned ring, unsigned long long* full,
                                                     unsigned long long* empty, T* __restrict__ out0,
                                                     T* __restrict__ out1, const Walk& walk) {
  constexpr int BNO = wgmma_skinny_cols(MODE), NCT = (N + BNO - 1) / BNO;
  int it = 0;
  Walk mine = walk;
  WgItem item;
  while (mine.next(item)) {
    const WgTile tl = wgmma_tile<E, NCT, BNO, WS_BP>(tiles, offsets, item.t);
    if (tl.rows <= 16) wgmma_skinny_tile<T, MODE, N, KD, ST, 16>(tl, item, walk, order, ring, full, empty, out0, out1, it);
    else if (tl.rows <= 32) wgmma_skinny_tile<T, MODE, N, KD, ST, 32>(tl, item, walk, order, ring, full, empty, out0, out1, it);
    else wgmma_skinny_tile<T, MODE, N, KD, ST, 64>(tl, item, walk, order, ring, full, empty, out0, out1, it);
  }
}

template <typename T, int MODE, int E, int N, int KD, int K, int ST, int SPLIT>
__device__ __forceinline__ void grouped_gemm_wgmma_skinny(const T* __restrict__ x, const TensorMap* w0,
                                                          const TensorMap* w1, const i32* __restrict__ order,
                                                          const i32* __restrict__ offsets, T* __restrict__ out0,
                                                          T* __restrict__ out1, char* smem) {
  static_assert(sizeof(T) == 2, "wgmma skinny gemm: 16-bit operands");
  static_assert(KD % 8 == 0, "wgmma skinny gemm: rows of whole 16-byte chunks (TMA strides, cp.async)");
  static_assert(ST >= 2, "wgmma skinny gemm: a ring of at least two stages");
  static_assert(SPLIT >= 0, "wgmma skinny gemm: SPLIT is the fewest K slices a CTA takes (0: whole tiles)");
  static_assert(2 * (wgmma_skinny_smem(ST) + 2 * ST * 8 + 4 * (E + 1) + 1024) <= 228 * 1024,
                "wgmma skinny gemm: two CTAs per SM (_moe_wgmma_skinny.applies)");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST];
  __shared__ int tiles[E + 1];
  // DOWN follows gate_up_silu, which waits for the route before it lets DOWN launch: the route's
  // `offsets` are complete before DOWN's first CTA runs (pdl.cuh, two launches back), so DOWN
  // builds its tile table and starts its first item's first ST weight slices (no kernel writes
  // weights) before its wait, into the tail of gate_up_silu (PERF_NOTES v16: that boundary cost
  // ~1.9 us a layer).  The pairs' rows (x, gate_up_silu's output) are gathered after it, and
  // the partials and flags of stream-K are written after it (the previous launch of this kernel
  // has then finished).  GATE_UP* follows the route itself: every read of another kernel's
  // output after the wait.
  constexpr bool EARLY = MODE == DOWN;
  if constexpr (!EARLY) {
    dsg::pdl_wait();
    dsg::pdl_launch_dependents();
  }
  const unsigned raw = smem_u32(smem);
  const unsigned ring = (raw + 1023u) & ~1023u;         // 128B-swizzle tiles start on 1024-byte boundaries
  if (threadIdx.x < 32) wgmma_row_tiles<E, WS_BP, EARLY>(offsets, tiles);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      mbar::init(&full[s], 128 + 1);                     // the producer's 128 copy arrivals + its expect_tx
      mbar::init(&empty[s], 4);                          // one per consumer warp
    }
    mbar::init_fence();
  }
  __syncthreads();
  constexpr int KT = (KD + WS_BK - 1) / WS_BK, NCT = (N + wgmma_skinny_cols(MODE) - 1) / wgmma_skinny_cols(MODE);
  const WgSkinnyWalk<SPLIT, KT> walk(tiles[E] * NCT);
  int preissued = 0;                                     // slices of the walk's first item issued early
  if constexpr (EARLY) {
    WgSkinnyWalk<SPLIT, KT> first = walk;
    WgItem item;
    if (first.next(item)) {
      preissued = min(ST, item.k_hi - item.k_lo);
      if (threadIdx.x == 0) {
        const int e = wgmma_tile_expert<E>(tiles, item.t / NCT), n0 = (item.t % NCT) * wgmma_skinny_cols(MODE);
        char* ring_p = smem + (ring - raw);
#pragma unroll
        for (int s = 0; s < ST; ++s)
          if (s < preissued)
            wgmma_issue_weights<MODE, N, WgSkinnyTiles>(ring_p + s * WS_STAGE_BYTES + WgSkinnyTiles::WEIGHTS_AT, w0,
                                                        w1, (item.k_lo + s) * WS_BK, n0, e, &full[s]);
      }
    }
    dsg::pdl_wait();
    dsg::pdl_launch_dependents();
  }
  if (threadIdx.x < 128)
    wgmma_produce<T, MODE, E, N, KD, K, ST, WgSkinnyTiles>(x, w0, w1, order, offsets, tiles, smem + (ring - raw),
                                                           full, empty, walk, preissued);
  else
    wgmma_skinny_consume<T, MODE, E, N, KD, ST>(order, offsets, tiles, ring, full, empty, out0, out1, walk);
}

}  // namespace moe
}  // namespace dsg
