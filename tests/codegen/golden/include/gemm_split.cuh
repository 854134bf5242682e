// Split K for the persistent wgmma GEMMs (gemm_fp8.cuh, gemm_int8.cuh): at decode batches (T = 17..256)
// a linear has a few 128 x 128 tiles (V2-Lite's kv_a 5, o_proj 16, q 24 at T <= 128), so a grid of one
// CTA a tile streams the weight on a few of the SMs.  There the lowering splits K
// (codegen/families/_gemm_split.py): `splits` S CTAs a tile, the grid tiles * S, both derived from T
// at run time.  Work item i is tile i % tiles, split i / tiles; split z takes the contiguous K blocks
// [z KB / S, (z + 1) KB / S).  Each split writes its partial tile (the rows below T) to a `partials`
// workspace; the tile's CTA that arrives last (a self-resetting ticket, tickets.cuh) adds the S
// partials in the order z = 0, 1, ..., S - 1 -- the same sums whichever CTA is last, so fp32 partials
// give one result at every launch, and int32 partials (exact integer sums) the unsplit result bit for
// bit -- and runs the epilogue.  S = 1 is the unsplit walk.
#pragma once
#include "common.cuh"
#include "tickets.cuh"

namespace dsg {
namespace gemm_split {

constexpr int CONSUMERS = 256;                          // the two consumer warpgroups' threads
constexpr int PARTIAL_WORDS = CONSUMERS * 64;           // a split's partial tile: each consumer's 64 sums
constexpr int CONSUMER_BARRIER = 3;                     // named barrier of both consumers (1, 2: each one's)

// The K blocks [first, end) of split z of `splits`: contiguous, every split one or more (splits <= KB).
struct KRange {
  int first, end;
};
__device__ __forceinline__ KRange k_range(int z, int splits, int kb) {
  return {z * kb / splits, (z + 1) * kb / splits};
}

// Work item i of the walk: tile i % tiles, split i / tiles (split 0 of every tile first).
struct Item {
  int tile, split;
};
__device__ __forceinline__ Item item_of(int i, int tiles) { return {i % tiles, i / tiles}; }

// Both consumer warpgroups (256 threads) meet at their named barrier; the producer is elsewhere.
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(CONSUMER_BARRIER), "n"(CONSUMERS) : "memory");
}

// The 16-byte vector of four accumulator words: float4 for fp32 sums, int4 for int32 ones.
template <typename A> struct Vec4;
template <> struct Vec4<float> {
  using type = float4;
  static __device__ __forceinline__ float4 make(float a, float b, float c, float d) { return make_float4(a, b, c, d); }
};
template <> struct Vec4<int> {
  using type = int4;
  static __device__ __forceinline__ int4 make(int a, int b, int c, int d) { return make_int4(a, b, c, d); }
};

// A split's end of its tile (consumer threads; acc[4j + 2h + c]: this thread's rows a (h = 0) and
// b (h = 1), row_ok[h]: the row is below T).  The partial goes to its slot of `partials` as 16
// 16-byte vectors a thread (vector (8h + i) of consumer thread ct at (8h + i) * 256 + ct: a warp
// stores 512 contiguous bytes), rows at or past T neither written nor read; then the tile's ticket.
// True in the tile's last CTA, whose acc then holds the sum of the S partials in split order.
template <typename A>
__device__ __forceinline__ bool split_arrive(A (&acc)[64], A* __restrict__ partials,
                                             unsigned int* __restrict__ tickets, Item w, int tiles, int splits,
                                             const bool (&row_ok)[2], int* last) {
  using V = typename Vec4<A>::type;
  const int ct = threadIdx.x - 128;
  const auto slot = [&](int z) {
    return reinterpret_cast<V*>(partials) + ((i64)z * tiles + w.tile) * (PARTIAL_WORDS / 4) + ct;
  };
  V* mine = slot(w.split);
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (row_ok[h])
#pragma unroll
      for (int i = 0; i < 8; ++i)
        __stcg(mine + (8 * h + i) * CONSUMERS, Vec4<A>::make(acc[8 * i + 2 * h], acc[8 * i + 2 * h + 1],
                                                             acc[8 * i + 4 + 2 * h], acc[8 * i + 5 + 2 * h]));
  consumers_sync();                                    // every consumer's partial, gathered to thread ct 0
  if (ct == 0) *last = take_ticket(&tickets[w.tile], splits);
  consumers_sync();
  if (!*last) return false;
  A sum[64];
#pragma unroll
  for (int k = 0; k < 64; ++k) sum[k] = 0;
  for (int z = 0; z < splits; ++z) {
    if (z == w.split) {
#pragma unroll
      for (int k = 0; k < 64; ++k) sum[k] += acc[k];
    } else {
      const V* p = slot(z);
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (row_ok[h])
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const V v = __ldcg(p + (8 * h + i) * CONSUMERS);   // other SMs wrote it: past L1
            sum[8 * i + 2 * h] += v.x;
            sum[8 * i + 2 * h + 1] += v.y;
            sum[8 * i + 4 + 2 * h] += v.z;
            sum[8 * i + 5 + 2 * h] += v.w;
          }
    }
  }
#pragma unroll
  for (int k = 0; k < 64; ++k) acc[k] = sum[k];
  return true;
}

}  // namespace gemm_split
}  // namespace dsg
