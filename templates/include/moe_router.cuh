// DeepSeekMoE routing device code: router GEMV, scoring + top-k, and the alignment that groups the
// token-expert pairs by expert (one CTA, or count / scan / scatter for many pairs).  Semantics
// mirror ir/ops/moe.py (route_ref, align_ref).  Templates only fill in the constants; moe_route.cuh
// builds the fused route and the PDL-keeping three-launch form from these.
// Dimensions: moe_common.cuh's legend.
#pragma once
#include "common.cuh"
#include "moe_common.cuh"
#include "pdl.cuh"

namespace dsg {
namespace moe {

// ---- 1. router GEMV: logits[t, e] = sum_d float(x[t, d]) * gate[e, d]  (fp32, like x.float() @ gate.T)
// One CTA computes EPB experts x TT tokens; threads split D in VEC-wide slices, then a block
// reduction.  Decode (T = 1) spreads the E x D fp32 gate over cdiv(E, EPB) CTAs.
template <typename T, int E, int D, int EPB, int TT, int NT, int VEC>
__device__ __forceinline__ void router_logits_body(const T* __restrict__ x, const float* __restrict__ gate,
                                                   float* __restrict__ logits, int num_tokens,
                                                   float (*red)[EPB * TT]) {
  static_assert(D % VEC == 0, "router: D must be a multiple of the vector width");
  const int e0 = blockIdx.x * EPB, t0 = blockIdx.y * TT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc[EPB][TT];
#pragma unroll
  for (int i = 0; i < EPB; ++i)
#pragma unroll
    for (int j = 0; j < TT; ++j) acc[i][j] = 0.f;

  for (int d = threadIdx.x * VEC; d < D; d += NT * VEC) {
    float g[EPB][VEC];
#pragma unroll
    for (int i = 0; i < EPB; ++i) {
      if (e0 + i < E) load_f_ro<float, VEC>(gate + (i64)(e0 + i) * D + d, g[i]);
      else
#pragma unroll
        for (int v = 0; v < VEC; ++v) g[i][v] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < TT; ++j) {
      if (t0 + j < num_tokens) {
        float xv[VEC];
        load_f<T, VEC>(x + (i64)(t0 + j) * D + d, xv);
#pragma unroll
        for (int i = 0; i < EPB; ++i)
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[i][j] = fmaf(g[i][v], xv[v], acc[i][j]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < EPB; ++i)
#pragma unroll
    for (int j = 0; j < TT; ++j) {
      const float s = warp_sum(acc[i][j]);
      if (lane == 0) red[warp][i * TT + j] = s;
    }
  __syncthreads();
  for (int idx = threadIdx.x; idx < EPB * TT; idx += NT) {
    const int i = idx / TT, j = idx % TT;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) s += red[w][idx];
    if (e0 + i < E && t0 + j < num_tokens) logits[(i64)(t0 + j) * E + e0 + i] = s;
  }
}

// This CTA's EPB gate rows (contiguous, fp32) towards L2, before pdl_wait(): the gate is a weight.
// Only the first token tile's CTAs ask (the others read the same rows).
template <int E, int D, int EPB>
__device__ __forceinline__ void router_prefetch(const float* __restrict__ gate) {
  const int e0 = blockIdx.x * EPB;
  if (blockIdx.y == 0 && e0 < E) prefetch_l2(gate + (i64)e0 * D, (i64)min(EPB, E - e0) * D * (i64)sizeof(float));
}

// VEC-wide loads of x (act) and of the fp32 gate where both bases allow them, else VEC = 1.
template <typename T, int E, int D, int EPB, int TT, int NT, int VEC>
__device__ __forceinline__ void router_logits(const T* __restrict__ x, const float* __restrict__ gate,
                                              float* __restrict__ logits, int num_tokens) {
  static_assert(NT % 32 == 0 && NT <= 1024, "router: whole warps, at most 1024 threads");
  __shared__ float red[NT / 32][EPB * TT];
  if constexpr (VEC > 1) {
    if (aligned_to<vec_align<T, VEC>()>(x) && aligned_to<vec_align<float, VEC>()>(gate)) {
      router_logits_body<T, E, D, EPB, TT, NT, VEC>(x, gate, logits, num_tokens, red);
      return;
    }
  }
  router_logits_body<T, E, D, EPB, TT, NT, 1>(x, gate, logits, num_tokens, red);
}

// ---- 2. scoring + top-k: one warp per token ----------------------------------------------
enum Scoring { SOFTMAX = 0, SIGMOID = 1 };
enum Method { GREEDY = 0, GROUP_LIMITED_GREEDY = 1, NOAUX_TC = 2 };

// (value, index) argmax across the warp; ties go to the lower index, so equal scores pick
// experts in index order (torch.topk's order for exact ties is unspecified).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
}

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

// Routes one token from its logits in registers: lane owns experts e = lane + 32 * s, l[s] is
// logit e (-inf where e >= E).  `sc` and `ch` are this warp's shared scratch of E floats each
// (scores and selection values).  Writes ids[0..K) (descending by selection value, like
// torch.topk sorted) and weights[0..K), then S always-selected shared experts: ids[K + s] = s with
// weight 1, and the routed experts numbered from S (ir/passes/fuse_shared_experts.py stacks the
// shared experts first; a token's row of ids / weights is K + S wide).
// topk_token below loads the logits; the fused route (moe_route.cuh) loads them past L1, since
// other CTAs of its launch wrote them.
template <int E, int K, int G, int TG, int SCORING, int METHOD, bool NORM, bool HAS_BIAS, int S = 0>
__device__ __forceinline__ void topk_scored(float (&l)[(E + 31) / 32], const float* __restrict__ bias,
                                            float scaling, i64* __restrict__ ids, float* __restrict__ weights,
                                            float* sc, float* ch, int* id_copy = nullptr) {
  constexpr int SLOTS = (E + 31) / 32;   // experts a lane owns: e = lane + 32 * s
  constexpr int GS = E / G;              // experts per group (contiguous)
  static_assert(SLOTS <= 32, "moe top-k: at most 1024 experts");
  static_assert(E % G == 0, "moe top-k: experts must divide into groups");
  static_assert(K + S <= 32 && G <= 32 && S >= 0, "moe top-k: K + S and groups must fit a warp");
  const int lane = threadIdx.x & 31;

  // scores: softmax over E, or sigmoid
  float mx = -CUDART_INF_F;
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) mx = fmaxf(mx, l[s]);
  if constexpr (SCORING == SOFTMAX) {
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int e = lane + 32 * s;
      l[s] = (e < E) ? expf(l[s] - mx) : 0.f;
      sum += l[s];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) l[s] = l[s] / sum;
  } else {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) l[s] = 1.f / (1.f + expf(-l[s]));
  }
  // selection values: the score, or the score plus the correction bias (noaux_tc)
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int e = lane + 32 * s;
    if (e < E) {
      sc[e] = l[s];
      float c = l[s];
      if constexpr (METHOD == NOAUX_TC && HAS_BIAS) c += bias[e];
      ch[e] = c;
    }
  }
  __syncwarp();

  if constexpr (METHOD != GREEDY) {
    // group score (lane g < G): the group's max (V2) or the sum of its top two (V3)
    float gs = -CUDART_INF_F;
    if (lane < G) {
      float m1 = -CUDART_INF_F, m2 = -CUDART_INF_F;
      for (int i = 0; i < GS; ++i) {
        const float c = ch[lane * GS + i];
        if (c > m1) { m2 = m1; m1 = c; } else if (c > m2) { m2 = c; }
      }
      gs = (METHOD == GROUP_LIMITED_GREEDY) ? m1 : m1 + m2;
    }
    // keep the TG best groups
    bool keep = false;
    float cand = gs;
    for (int r = 0; r < TG; ++r) {
      float v = (lane < G && !keep) ? cand : -CUDART_INF_F;
      int i = (lane < G && !keep) ? lane : 0x7fffffff;
      warp_argmax(v, i);
      if (lane == i) keep = true;
    }
    const unsigned kept = __ballot_sync(0xffffffffu, keep);
    __syncwarp();
    // masked groups: 0 (group_limited_greedy) or -inf (noaux_tc)
    const float MASKED = (METHOD == GROUP_LIMITED_GREEDY) ? 0.f : -CUDART_INF_F;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int e = lane + 32 * s;
      if (e < E && !((kept >> (e / GS)) & 1u)) ch[e] = MASKED;
    }
    __syncwarp();
  }

  // top-K on the selection values, K rounds of a warp argmax
  float c[SLOTS];
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int e = lane + 32 * s;
    c[s] = (e < E) ? ch[e] : -CUDART_INF_F;
  }
  unsigned taken = 0u;
  int my_id = 0;
  float my_w = 0.f;
  for (int k = 0; k < K; ++k) {
    float bv = -CUDART_INF_F;
    int bi = 0x7fffffff;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int e = lane + 32 * s;
      if (e < E && !((taken >> s) & 1u) && better(c[s], e, bv, bi)) { bv = c[s]; bi = e; }
    }
    warp_argmax(bv, bi);
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    if (lane == k) my_id = bi;
  }
  // weights: the (unbiased) scores of the chosen experts
  if (lane < K) my_w = sc[my_id];
  if constexpr (NORM) {
    const float sum = warp_sum(lane < K ? my_w : 0.f);
    my_w = my_w / (sum + 1e-20f);
  }
  if (lane < K) {
    ids[lane] = (i64)(my_id + S);
    weights[lane] = my_w * scaling;
  } else if (lane < K + S) {
    ids[lane] = (i64)(lane - K);
    weights[lane] = 1.f;
  }
  // id_copy (shared memory; the fused route's one-tile path): the same ids, for its alignment
  if (id_copy != nullptr && lane < K + S) id_copy[lane] = lane < K ? my_id + S : lane - K;
}

template <int E, int K, int G, int TG, int SCORING, int METHOD, bool NORM, bool HAS_BIAS, int S = 0>
__device__ __forceinline__ void topk_token(const float* __restrict__ logits, const float* __restrict__ bias,
                                           float scaling, i64* __restrict__ ids, float* __restrict__ weights,
                                           float* sc, float* ch) {
  const int lane = threadIdx.x & 31;
  float l[(E + 31) / 32];
#pragma unroll
  for (int s = 0; s < (E + 31) / 32; ++s) {
    const int e = lane + 32 * s;
    l[s] = (e < E) ? logits[e] : -CUDART_INF_F;
  }
  topk_scored<E, K, G, TG, SCORING, METHOD, NORM, HAS_BIAS, S>(l, bias, scaling, ids, weights, sc, ch);
}

// ---- 3. alignment: pairs grouped by expert (one CTA) ---------------------------------------
// Exclusive scan of count[0..E) by warp 0, 32 experts a round: start[e] and offsets[e] get the
// first slot of expert e's segment, offsets[E] the total.  Every thread calls it; warp 0 works.
template <int E>
__device__ __forceinline__ void scan_counts(const int* count, int* start, i32* __restrict__ offsets) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int base = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const int c = (e < E) ? count[e] : 0;
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += n;
    }
    if (e < E) {
      start[e] = base + incl - c;
      offsets[e] = base + incl - c;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) offsets[E] = base;
}

// counts per expert -> exclusive scan -> offsets [E + 1], then each pair claims a slot in its
// expert's segment.  Order inside a segment follows the atomics (it does not change any result:
// every pair is computed on its own).  Id: i64 (the ids output of top-k), or int (the fused
// route's copy of them in shared memory).
template <int E, int NT, typename Id = i64>
__device__ __forceinline__ void align(const Id* __restrict__ ids, int num_pairs, i32* __restrict__ order,
                                      i32* __restrict__ offsets) {
  // Any NP: every loop strides by NT; the scan is warp 0's, 32 experts a round.
  static_assert(NT % 32 == 0 && NT <= 1024, "align: whole warps, at most 1024 threads");
  static_assert(E >= 1 && 2 * E * sizeof(int) <= 48 * 1024, "align: count[] and cursor[] must fit static shared memory");
  __shared__ int count[E];
  __shared__ int cursor[E];
  for (int e = threadIdx.x; e < E; e += NT) count[e] = 0;
  __syncthreads();
  // ids come from top-k and lie in [0, E); one that does not (a caller's bug) must not write
  // outside count[] / cursor[]: its pair is left out (offsets[E] < num_pairs then says so).
  for (int p = threadIdx.x; p < num_pairs; p += NT) {
    const i64 id = ids[p];
    if (id >= 0 && id < E) atomicAdd(&count[(int)id], 1);
  }
  __syncthreads();
  scan_counts<E>(count, cursor, offsets);
  __syncthreads();
  for (int p = threadIdx.x; p < num_pairs; p += NT) {
    const i64 id = ids[p];
    if (id < 0 || id >= E) continue;
    const int slot = atomicAdd(&cursor[(int)id], 1);
    order[slot] = p;
  }
}

// ---- 3b. alignment of many pairs (prefill): count, scan, scatter over CHUNK-pair chunks ----
// The one-CTA align serialises every pair on one SM's shared-memory atomics.  For ~100k pairs
// three launches spread the work, with the same contract (ids outside [0, E) are left out, and
// order inside a segment follows the atomics):
//   align_count:   CTA c counts the ids of pairs [c * CHUNK, (c + 1) * CHUNK) into hist[c][e];
//   align_scan:    one CTA turns hist[c][e] into chunk c's first slot within expert e's segment
//                  (an exclusive sum over chunks) and writes the offsets;
//   align_scatter: CTA c places its chunk's pairs from offsets[e] + hist[c][e] on.
template <int E, int NT, int CHUNK>
__device__ __forceinline__ void align_count(const i64* __restrict__ ids, int num_pairs, i32* __restrict__ hist) {
  static_assert(E >= 1 && E * sizeof(int) <= 48 * 1024, "align: count[] must fit static shared memory");
  __shared__ int count[E];
  for (int e = threadIdx.x; e < E; e += NT) count[e] = 0;
  __syncthreads();
  const int p1 = min(num_pairs, (int)(blockIdx.x + 1) * CHUNK);
  for (int p = blockIdx.x * CHUNK + threadIdx.x; p < p1; p += NT) {
    const i64 id = ids[p];
    if (id >= 0 && id < E) atomicAdd(&count[(int)id], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += NT) hist[(i64)blockIdx.x * E + e] = count[e];
}

template <int E, int NT>
__device__ __forceinline__ void align_scan(i32* __restrict__ hist, int chunks, i32* __restrict__ offsets) {
  static_assert(2 * E * sizeof(int) <= 48 * 1024, "align: total[] and start[] must fit static shared memory");
  __shared__ int total[E];
  __shared__ int start[E];
  for (int e = threadIdx.x; e < E; e += NT) {
    int run = 0;
    for (int c = 0; c < chunks; ++c) {
      const int v = hist[(i64)c * E + e];
      hist[(i64)c * E + e] = run;
      run += v;
    }
    total[e] = run;
  }
  __syncthreads();
  scan_counts<E>(total, start, offsets);
}

template <int E, int NT, int CHUNK>
__device__ __forceinline__ void align_scatter(const i64* __restrict__ ids, int num_pairs, const i32* __restrict__ hist,
                                              const i32* __restrict__ offsets, i32* __restrict__ order) {
  __shared__ int cursor[E];
  for (int e = threadIdx.x; e < E; e += NT) cursor[e] = offsets[e] + hist[(i64)blockIdx.x * E + e];
  __syncthreads();
  const int p1 = min(num_pairs, (int)(blockIdx.x + 1) * CHUNK);
  for (int p = blockIdx.x * CHUNK + threadIdx.x; p < p1; p += NT) {
    const i64 id = ids[p];
    if (id < 0 || id >= E) continue;
    order[atomicAdd(&cursor[(int)id], 1)] = p;
  }
}

}  // namespace moe
}  // namespace dsg
