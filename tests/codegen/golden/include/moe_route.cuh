// moe_route device code: the router in one launch at decode sizes, and the PDL-keeping kernels of
// its three-launch form (router GEMV or GEMM, top-k, align).  The math is moe_router.cuh's
// (router_logits, topk_scored, align); this header adds how one launch hands the work from stage
// to stage.
//
// Dimension legend: T tokens, D hidden, E routed experts, K experts per token, G expert groups,
// S shared experts (0 unless ir/passes/fuse_shared_experts.py made them pairs), NP = T*(K+S)
// token-expert pairs (pair p = t*(K+S) + k), TT tokens per token tile.
//
// The fused launch (route_fused): grid (cdiv(E, EPB), cdiv(T, TT)), the router GEMV's geometry.
//   1. every CTA computes its EPB experts' logits for its tile's TT tokens (fp32 workspace);
//   2. the CTA of a token tile that finishes last (a ticket per tile) runs top-k for the tile's
//      tokens, one warp per token, on the logits the tile's other CTAs wrote;
//   3. the tile that finishes top-k last (one more ticket) aligns all NP pairs in that CTA.
// The tickets (tickets.cuh) reset themselves, so graph replays need no memset launch.
//
// Above the fused bound the router logits come from the GEMV below (router_logits) or, at
// prefill sizes, from the tiled GEMM of router_gemm.cuh.
#pragma once
#include "moe_router.cuh"
#include "pdl.cuh"
#include "tickets.cuh"

namespace dsg {
namespace moe {

// Top-k of the three-launch form: one warp per token, WARPS tokens per CTA.  S: the shared experts
// each token also selects (moe_router.cuh topk_scored); a token's ids / weights row is K + S wide.
template <int E, int K, int G, int TG, int SCORING, int METHOD, bool NORM, bool HAS_BIAS, int WARPS, int S = 0>
__device__ __forceinline__ void topk_rows(const float* __restrict__ logits, const float* __restrict__ bias,
                                          float scaling, i64* __restrict__ ids, float* __restrict__ weights,
                                          int num_tokens) {
  static_assert(2 * WARPS * E * sizeof(float) <= 48 * 1024, "top-k scratch must fit static shared memory");
  __shared__ float scores[WARPS][E];
  __shared__ float choice[WARPS][E];
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * WARPS + warp;
  if (t >= num_tokens) return;
  topk_token<E, K, G, TG, SCORING, METHOD, NORM, HAS_BIAS, S>(logits + (i64)t * E, bias, scaling,
                                                             ids + (i64)t * (K + S), weights + (i64)t * (K + S),
                                                             scores[warp], choice[warp]);
}

// The whole route in one launch (see the top of this file).  `tickets`: TILES + 1 counters, one per
// token tile and one for the tiles; `smem`: dynamic shared memory of max(2 * WARPS * E floats,
// TILES * TT * (K + S) ints) (the top-k scratch, then the pairs' ids: one CTA uses them one after the
// other).  The lowering runs it only while T <= TILES * TT.  S: shared experts, aligned as experts
// 0..S-1 with the routed ones after them (topk_scored).
template <typename T, int E, int D, int EPB, int TT, int NT, int VEC, int K, int G, int TG, int SCORING,
          int METHOD, bool NORM, bool HAS_BIAS, int TILES, int S = 0>
__device__ __forceinline__ void route_fused(const T* __restrict__ x, const float* __restrict__ gate,
                                            const float* __restrict__ bias, float scaling, float* __restrict__ logits,
                                            i64* __restrict__ ids, float* __restrict__ weights,
                                            i32* __restrict__ order, i32* __restrict__ offsets, int num_tokens,
                                            unsigned int* __restrict__ tickets, float* smem) {
  constexpr int WARPS = NT / 32;
  constexpr int SLOTS = (E + 31) / 32;
  static_assert(TT == WARPS, "fused route: one warp per token of a tile");
  router_prefetch<E, D, EPB>(gate);   // moe_router.cuh: weights before pdl_wait
  pdl_wait();
  pdl_launch_dependents();
  // The lowering bounds T by TILES * TT; past it the tickets would be out of bounds (uniform).
  if (gridDim.y > TILES) return;

  // 1. logits [T, E] of this CTA's experts and tokens
  router_logits<T, E, D, EPB, TT, NT, VEC>(x, gate, logits, num_tokens);
  DSG_PHASE(4);   // phases.cuh: this CTA's logits issued

  // 2. the tile's last CTA: top-k of its TT tokens, a warp each
  if (!last_arrival(&tickets[blockIdx.y], gridDim.x)) return;
  DSG_PHASE(5);   // the tile's last CTA: every logit of the tile written
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.y * TT + warp;
  // One token tile (T <= TT, every decode step up to TT tokens): its CTA that ran top-k is the
  // last tile by construction, so it aligns without taking the tiles' ticket (an atomic on b=1's
  // critical path), and takes the pairs' ids from its own top-k warps through shared memory
  // instead of reading back from L2 the ids those warps just stored (one L2 round trip less
  // between the route's top-k and the expert GEMM's start).
  const bool one_tile = gridDim.y == 1;   // uniform
  __shared__ int tile_ids[TT * (K + S)];   // one tile's pairs' ids
  if (t < num_tokens) {
    float l[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int e = lane + 32 * s;
      l[s] = (e < E) ? __ldcg(logits + (i64)t * E + e) : -CUDART_INF_F;
    }
    float* sc = smem + warp * 2 * E;
    topk_scored<E, K, G, TG, SCORING, METHOD, NORM, HAS_BIAS, S>(
        l, bias, scaling, ids + (i64)t * (K + S), weights + (i64)t * (K + S), sc, sc + E,
        one_tile ? tile_ids + warp * (K + S) : nullptr);
  }

  // 3. the last tile's CTA: align every pair (ids copied to shared memory past L1)
  if (one_tile) __syncthreads();   // (this CTA's top-k wrote the ids)
  else if (!last_arrival(&tickets[TILES], gridDim.y)) return;
  const int num_pairs = num_tokens * (K + S);
  DSG_PHASE(6);   // the aligning CTA: every top-k done
  const int* pair_ids = tile_ids;                // one tile: pair p = t * (K + S) + k is tile_ids[p]
  if (!one_tile) {
    int* sid = reinterpret_cast<int*>(smem);
    for (int p = threadIdx.x; p < num_pairs; p += NT) sid[p] = (int)__ldcg(ids + p);
    __syncthreads();
    pair_ids = sid;
  }
  align<E + S, NT, int>(pair_ids, num_pairs, order, offsets);
  DSG_PHASE_EXIT();
}

}  // namespace moe
}  // namespace dsg
