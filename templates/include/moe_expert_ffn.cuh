// 4f. Decode's expert FFN in one persistent launch (sm_90a): gate_up_silu's tiles, then down's.
// a [NP, M] = silu(x Wg[e]^T) * (x Wu[e]^T) and out [NP, D] = a[p] Wd[e]^T per pair, as the two
// grouped launches of moe_wgmma_skinny.cuh compute them (the same tiles, the same rounding), but
// one grid walks both: tiles t < G = tiles[E] * NCT_GU are gate_up_silu's (row tile, column tile),
// the rest down's.  Why: one walk of both kernels' tiles leaves fewer part-empty
// rounds than two, a CTA goes from its last gate_up_silu tile to its first down tile without a
// launch between, and at decode's smallest batches down's tiles start their weights on the CTAs
// gate_up_silu's few tiles leave idle (1-4% on the expert kernels from 2 to 192 tokens).
//
// The walk: CTAs take tiles in order from a counter (`walk[0]`, a __device__ pair of the module,
// zero when it loads).  Producer thread 0 takes its next tile TAKE_LEAD slices before the current
// one's last (the atomic's round trip hides behind them; taken at a tile's start, the first CTAs
// hoarded two tiles each while others had none), hands it to its producer warpgroup through
// shared memory and to the consumer warpgroup through the ring (the tile of a stage's first slice
// sits beside the stage; the consumer reads it after that stage's full barrier, whose arrival by
// thread 0 releases it).  A tile past the last ends the CTA's walk; the CTA out last (`walk[1]`
// counts them) sets both back to 0 for the next launch.  Taken in order, a CTA that finishes early
// takes more (gate_up_silu's tiles read 1.45x down's bytes; a shared expert's second row tile
// reads its weights from L2), and no CTA waits for a tile that nobody has taken (below).
// Measured on the H200 against a fixed walk (tile b, b + grid, ...): 0.5-2%
// shorter decode steps from b=8 to 256, but slower where the tiles are about one round (b <= 4),
// which the lowering leaves to the two launches.
//
// A down tile reads the rows of `a` of its row tile, which all NCT_GU gate_up_silu tiles of that
// row tile write, on any CTA.  So each row tile has a counter in `ready` (a __device__ array of
// the kernel's module, zero when it loads):
//   * a gate_up_silu tile's consumer warpgroup stores its columns of `a`, meets at a named
//     barrier, and one thread hands the row tile to the CTA's publisher warp (warp 8) through a
//     small mbarrier queue in shared memory; the publisher adds 1 with a release reduction
//     (red.release.gpu: the barrier gathers the warpgroup's stores, the queue's arrive / wait
//     carry them to the publisher at CTA scope, its release orders them before the add).  The
//     release waits for the stores to reach L2; made by the consumer it held the next tile's
//     wgmma for that round trip (a relaxed add, timing only, gave the expert
//     kernels +0.04-0.05 TB/s from b=8 to 256), made by a warp of its own it holds nobody;
//   * a down tile's producer thread 0 reads the counter (ld.acquire.gpu); below NCT_GU it first
//     issues the weight boxes of the tile's first slices whose stages are free (no kernel writes
//     weights), then spins until it holds NCT_GU; the producer warpgroup meets at a named barrier
//     and only then gathers rows of `a` (cp.async.cg or ld.global.cg: through L2, never an L1
//     line).  A ready row tile (the usual case from b=32 up) costs one load: the ring stays full;
//   * once the tile is produced thread 0 adds 1 more; the row tile's last down tile (the add that
//     returns NCT_GU + NCT_D - 1) sets it back to 0 for the next launch (next layer, next graph
//     replay).  Launches of one kernel never overlap (stream order; under PDL every CTA waits
//     before it touches the counters).
// No deadlock, whatever number of CTAs the GPU runs at once (an MPS thread percentage, a green
// context, the next kernel's CTAs let in by PDL): a down tile waits only for gate_up_silu tiles,
// whose numbers are below its own, so every one of them has been taken by a CTA that runs.  A CTA
// holds its current tile and at most one taken ahead, numbered higher; so a gate_up_silu tile that
// is taken is a CTA's current tile or the next one after a current gate_up_silu tile, and a
// gate_up_silu tile waits for nothing but its own CTA's ring.  Within a CTA the consumer finishes
// a tile from stages already full while the producer waits for a row tile.
#pragma once
#include "moe_wgmma_skinny.cuh"
#include "tickets.cuh"

namespace dsg {
namespace moe {

// The producer's and the consumer's named barriers (bar.sync id, 128 threads; 0 is __syncthreads).
constexpr int FFN_CONSUMER_BAR = WS_CONSUMER_BAR, FFN_PRODUCER_BAR = 2;
constexpr int TAKE_LEAD = 2;          // slices before a tile's last at which its CTA takes the next
constexpr int FFN_THREADS = WS_THREADS + 32;   // producer warpgroup, consumer warpgroup, publisher warp
constexpr int FFN_PUB = 4;            // row tiles handed to the publisher and not yet published, at most

// The consumer's hand-offs to the publisher warp: entry q holds a row tile (-1: the walk's end).
struct PublishQueue {
  unsigned long long full[FFN_PUB], empty[FFN_PUB];
  int row_tile[FFN_PUB];
};

// One arrival at a counter that publishes the caller's (and, through the queue before it, the
// consumer warpgroup's) stores to the GPU: a release (fence.acq_rel, not __threadfence's fence.sc, which
// stalled the consumer warpgroup's next wgmma longer) and a reduction whose result no one awaits.
__device__ __forceinline__ void release_add(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(p) : "memory");
}

// Producer (warpgroup 0): tiles taken from the walk's counter; gate_up_silu's gather x, down's
// gather `a` once their row tile is ready.  `stage_tile[s]`: the tile whose first slice stage s
// holds (or `total`: the walk's end), for the consumer; `taken[2]`: thread 0's tile for its warpgroup.
template <typename T, int E, int M, int D, int K, int ST>
__device__ __forceinline__ void expert_ffn_produce(const T* __restrict__ x, const TensorMap* wg, const TensorMap* wu,
                                                   const TensorMap* wd, const i32* __restrict__ order,
                                                   const i32* __restrict__ offsets, const int* tiles, const T* a,
                                                   unsigned* ready, unsigned* walk, char* ring,
                                                   unsigned long long* full, unsigned long long* empty,
                                                   int* stage_tile, int* taken) {
  constexpr int NCT_GU = wgmma_skinny_col_tiles(GATE_UP_SILU, M), NCT_D = wgmma_skinny_col_tiles(DOWN, D);
  constexpr int KT_D = (M + WS_BK - 1) / WS_BK, PRE = ST < KT_D ? ST : KT_D;   // down's slices issued ahead, at most
  using L = WgSkinnyTiles;
  if (threadIdx.x == 0) {
    tma::prefetch(wg);
    tma::prefetch(wu);
    tma::prefetch(wd);
  }
  const bool vec_x = aligned_to<16>(x), vec_a = aligned_to<16>(a);
  const int gu_total = tiles[E] * NCT_GU, total = gu_total + tiles[E] * NCT_D;
  int it = 0, ahead = 0;
  bool downs = false;                                    // thread 0's: this CTA has had a down tile
  if (threadIdx.x == 0) ahead = (int)atomicAdd(walk, 1u);
  auto take_next = [&](int kt, int kts) {                // thread 0, TAKE_LEAD slices before the tile's last
    if (threadIdx.x == 0 && kt == max(kts - 1 - TAKE_LEAD, 0)) ahead = (int)atomicAdd(walk, 1u);
  };
  for (int j = 0;; ++j) {
    int pre = 0;                                         // (thread 0's alone: only it issues weights)
    if (threadIdx.x == 0) {
      const int t = min(ahead, total), s = it % ST;
      mbar::wait(&empty[s], ((it / ST) & 1) ^ 1);        // the consumer has read the stage's last tile
      stage_tile[s] = t;                                 // released to the consumer by thread 0's arrival
      if (t >= gu_total && t < total) {
        const int u = t - gu_total, rt = u / NCT_D;
        // The CTA's first down tile lets the next kernel's CTAs in (pdl.cuh); at its start or at
        // its exit measured the same.
        if (!downs) dsg::pdl_launch_dependents();
        downs = true;
        if (ld_acquire_gpu(ready + rt) < (unsigned)NCT_GU) {
          // Not ready: the weight boxes of the stages free now first (no kernel writes weights),
          // then wait.  Ready (the usual case from b=32 up): straight on, the ring never drains.
          const WgTile tl = wgmma_tile<E, NCT_D, wgmma_skinny_cols(DOWN), WS_BP>(tiles, offsets, u);
          pre = wgmma_issue_free<DOWN, D, ST, L>(wd, wd, tl, ring, full, empty, it, PRE);
          while (ld_acquire_gpu(ready + rt) < (unsigned)NCT_GU) __nanosleep(32);
        }
      }
      taken[j & 1] = t;                                  // two slots: a slow thread may still read the last
    }
    wgmma::warpgroup_sync(FFN_PRODUCER_BAR);             // the tile is known (and, for down, its `a` whole)
    const int t = taken[j & 1];
    if (t >= total) {                                    // the end, to the consumer: the stage's 128 + 1 arrivals
      mbar::arrive(&full[it % ST]);
      if (threadIdx.x == 0) mbar::arrive(&full[it % ST]);
      break;
    }
    if (t < gu_total) {
      const WgTile tl = wgmma_tile<E, NCT_GU, wgmma_skinny_cols(GATE_UP_SILU), WS_BP>(tiles, offsets, t);
      wgmma_produce_tile<T, GATE_UP_SILU, M, D, K, ST, L>(x, wg, wu, order, tl, ring, full, empty, vec_x, it, 0,
                                                          take_next);
    } else {
      const int u = t - gu_total, rt = u / NCT_D;
      const WgTile tl = wgmma_tile<E, NCT_D, wgmma_skinny_cols(DOWN), WS_BP>(tiles, offsets, u);
      wgmma_produce_tile<T, DOWN, D, M, 1, ST, L>(a, wd, wd, order, tl, ring, full, empty, vec_a, it, pre, take_next);
      // Past its wait: the row tile's last down tile sets the counter back to 0 for the next launch.
      if (threadIdx.x == 0 && atomicAdd(ready + rt, 1u) == (unsigned)(NCT_GU + NCT_D - 1)) atomicExch(ready + rt, 0u);
    }
  }
  // Every CTA takes one tile past the last, then counts itself out; the last out resets the walk
  // (every take of this launch is done by then: each CTA's last one came back before its count).
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(walk + 1, 1u) == gridDim.x - 1u) {
      atomicExch(walk, 0u);
      atomicExch(walk + 1, 0u);
    }
  }
  dsg::mma::cp_async_wait<0>();                          // nothing of this thread's left in flight at exit
}

// Consumer (warpgroup 1): the tiles the producer took, read beside each tile's first stage; a
// gate_up_silu tile then hands its row tile to the publisher (thread 128, one queue entry).
template <typename T, int E, int M, int D, int ST>
__device__ __forceinline__ void expert_ffn_consume(const i32* __restrict__ order, const i32* __restrict__ offsets,
                                                   const int* tiles, unsigned ring, unsigned long long* full,
                                                   unsigned long long* empty, T* a, T* __restrict__ out,
                                                   PublishQueue* pub, const int* stage_tile) {
  constexpr int NCT_GU = wgmma_skinny_col_tiles(GATE_UP_SILU, M), NCT_D = wgmma_skinny_col_tiles(DOWN, D);
  const int gu_total = tiles[E] * NCT_GU, total = gu_total + tiles[E] * NCT_D;
  int it = 0, np = 0;                                    // np: thread 128's hand-offs so far
  auto hand_off = [&](int row_tile) {
    const int q = np % FFN_PUB;
    mbar::wait(&pub->empty[q], ((np / FFN_PUB) & 1) ^ 1);   // the publisher has taken the entry's last
    pub->row_tile[q] = row_tile;
    mbar::arrive(&pub->full[q]);                         // (release, CTA scope: the warpgroup's stores with it)
    ++np;
  };
  for (;;) {
    mbar::wait(&full[it % ST], (it / ST) & 1);           // (the tile's K loop waits on it again: at once)
    const int t = stage_tile[it % ST];
    if (t >= total) break;
    if (t < gu_total) {
      const WgTile tl = wgmma_tile<E, NCT_GU, wgmma_skinny_cols(GATE_UP_SILU), WS_BP>(tiles, offsets, t);
      wgmma_skinny_tile_fit<T, GATE_UP_SILU, M, D, ST>(tl, order, ring, full, empty, a, a, it);
      wgmma::warpgroup_sync(FFN_CONSUMER_BAR);          // every column of this tile is stored
      if (threadIdx.x == 128) hand_off(t / NCT_GU);
    } else {
      const WgTile tl = wgmma_tile<E, NCT_D, wgmma_skinny_cols(DOWN), WS_BP>(tiles, offsets, t - gu_total);
      wgmma_skinny_tile_fit<T, DOWN, D, M, ST>(tl, order, ring, full, empty, out, out, it);
    }
  }
  if (threadIdx.x == 128) hand_off(-1);
}

// Publisher (warp 8, lane 0): each row tile the consumer hands over, published to its counter.
// Its release waits for the consumer warpgroup's stores to reach L2; nobody waits for it here.
__device__ __forceinline__ void expert_ffn_publish(PublishQueue* pub, unsigned* ready) {
  if ((threadIdx.x & 31) != 0) return;
  for (int n = 0;; ++n) {
    const int q = n % FFN_PUB;
    mbar::wait(&pub->full[q], (n / FFN_PUB) & 1);        // (acquire, CTA scope)
    const int rt = pub->row_tile[q];
    if (rt < 0) return;
    release_add(ready + rt);
    mbar::arrive(&pub->empty[q]);
  }
}

// RT: the `ready` array's length, the most row tiles a launch may have (the lowering's bound for
// the tokens it runs at); a launch with more traps rather than count past the array.  `walk`: the
// tile counter and the count of CTAs out (a __device__ pair of the module, zero when it loads).
template <typename T, int E, int M, int D, int K, int ST, int RT>
__device__ __forceinline__ void expert_ffn_wgmma_skinny(const T* __restrict__ x, const TensorMap* wg,
                                                        const TensorMap* wu, const TensorMap* wd,
                                                        const i32* __restrict__ order, const i32* __restrict__ offsets,
                                                        T* a, T* __restrict__ out, unsigned* ready, unsigned* walk,
                                                        char* smem) {
  static_assert(sizeof(T) == 2, "expert ffn: 16-bit operands");
  static_assert(D % 8 == 0 && M % 8 == 0, "expert ffn: rows of whole 16-byte chunks (TMA strides, cp.async)");
  static_assert(ST >= 2, "expert ffn: a ring of at least two stages");
  static_assert(2 * (wgmma_skinny_smem(ST) + 2 * ST * 8 + 4 * (E + 1 + ST + 2) + (int)sizeof(PublishQueue) + 1024) <=
                    228 * 1024,
                "expert ffn: two CTAs per SM (its grid is sized for two)");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST];
  __shared__ int tiles[E + 1], stage_tile[ST], taken[2];
  __shared__ PublishQueue pub;
  // Every read below (offsets, order, x, a, ready, walk) is of another kernel's output or this
  // launch's; a CTA without a down tile lets the next kernel in at its exit.
  dsg::pdl_wait();
  const unsigned raw = smem_u32(smem);
  const unsigned ring = (raw + 1023u) & ~1023u;         // 128B-swizzle tiles start on 1024-byte boundaries
  if (threadIdx.x < 32) wgmma_row_tiles<E, WS_BP>(offsets, tiles);
  if (threadIdx.x == 0) {
    wgmma_ring_init<ST>(full, empty, 4);                 // one consumer warpgroup
#pragma unroll
    for (int q = 0; q < FFN_PUB; ++q) {
      mbar::init(&pub.full[q], 1);
      mbar::init(&pub.empty[q], 1);
    }
  }
  __syncthreads();
  if (tiles[E] > RT) __trap();                           // the lowering's bound broken: a compiler bug
  if (threadIdx.x < 128)
    expert_ffn_produce<T, E, M, D, K, ST>(x, wg, wu, wd, order, offsets, tiles, a, ready, walk, smem + (ring - raw),
                                          full, empty, stage_tile, taken);
  else if (threadIdx.x < WS_THREADS)
    expert_ffn_consume<T, E, M, D, ST>(order, offsets, tiles, ring, full, empty, a, out, &pub, stage_tile);
  else
    expert_ffn_publish(&pub, ready);
}

}  // namespace moe
}  // namespace dsg
