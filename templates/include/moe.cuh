// DeepSeekMoE device code: router GEMV, scoring + top-k, alignment, grouped expert GEMV, combine.
// Semantics mirror ir/ops/moe.py (route_ref, align_ref, grouped_linear, combine_ref), including
// where results are rounded to the activation type.  Templates only fill in the constants.
//
// Dimension legend: T tokens, D hidden, E routed experts, K experts per token, G expert groups,
// M expert intermediate size, NP = T*K token-expert pairs (pair p = t*K + k).
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "bulk.cuh"
#include "pdl.cuh"

namespace dsg {
namespace moe {

// ---- alignment -------------------------------------------------------------------------------
// Every vector access below is safe by two facts, one per side:
//   * lowering (codegen/families/_moe.py): a row of n elements is read VEC at a time only where
//     n % VEC == 0, and every operand is a dense buffer (a strided view is refused), so row r,
//     element d (d % VEC == 0) sits at base + (r * n + d) * sizeof(T): a multiple of the vector
//     size past the base;
//   * run time: the bases are tested once per CTA (aligned_to below, uniform across the CTA);
//     where one is not aligned the kernel runs its scalar instantiation instead.

// Bytes load_f / store_f of N elements of T need their pointer aligned to: the access size where
// it is one 16- or 8-byte transaction, else one element's (scalar accesses).
template <typename T, int N>
__host__ __device__ constexpr int vec_align() {
  return (int(sizeof(T)) * N == 16 || int(sizeof(T)) * N == 8) ? int(sizeof(T)) * N : int(sizeof(T));
}

// p is aligned to BYTES (a power of two).  A null pointer (an operand the mode does not use) is.
template <int BYTES>
__device__ __forceinline__ bool aligned_to(const void* p) {
  static_assert(BYTES > 0 && (BYTES & (BYTES - 1)) == 0, "alignment must be a power of two");
  return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(BYTES - 1)) == 0;
}

// ---- vector loads / stores: N elements of T <-> N floats ----------------------------------
// One 16/8-byte transaction when N*sizeof(T) is that size (p aligned to vec_align<T, N>()),
// else element accesses.  The staging registers are a uint4 / uint2 (never a T array cast to
// one: a T array is only sizeof(T)-aligned if it lands in local memory).

template <typename T, int N>
__device__ __forceinline__ void load_f(const T* __restrict__ p, float (&out)[N]) {
  constexpr int BYTES = int(sizeof(T)) * N;
  if constexpr (BYTES == 16) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
  } else if constexpr (BYTES == 8) {
    uint2 v = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
  }
}

// Weights are read once per step and never written: the read-only (non-coherent) path.
template <typename T, int N>
__device__ __forceinline__ void load_f_ro(const T* __restrict__ p, float (&out)[N]) {
  constexpr int BYTES = int(sizeof(T)) * N;
  if constexpr (BYTES == 16) {
    uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
  } else if constexpr (BYTES == 8) {
    uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_f(T* __restrict__ p, const float (&v)[N]) {
  constexpr int BYTES = int(sizeof(T)) * N;
  if constexpr (BYTES == 16) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = from_float<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else if constexpr (BYTES == 8) {
    uint2 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = from_float<T>(v[i]);
    *reinterpret_cast<uint2*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(v[i]);
  }
}

// Element-wise forms of load_f / store_f (the fallbacks when a base is not aligned).
template <typename T, int N>
__device__ __forceinline__ void load_f_scalar(const T* __restrict__ p, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
}
template <typename T, int N>
__device__ __forceinline__ void store_f_scalar(T* __restrict__ p, const float (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) p[i] = from_float<T>(v[i]);
}

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
                                            float* sc, float* ch) {
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

// BULK: a stage's weight and x rows arrive as one bulk copy per row (bulk.cuh), counted on the
// stage's mbarrier, issued by warp 0; only for shapes where every slice is whole (KD % SBK == 0,
// N % BN == 0, 16-byte rows), else the cp.async ring with its zero fill.
template <int N, int KD, int MODE, int SBK>
__host__ __device__ constexpr bool skinny_bulk_ok() {
  return KD % 8 == 0 && KD % SBK == 0 && N % ((MODE == DOWN) ? GEMM_BNW : GEMM_BNW / 2) == 0;
}

template <typename T, int MODE, int N, int KD, int K, int SBK, int SST, int BP, bool BULK>
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

  if constexpr (BULK) {
    static_assert(skinny_bulk_ok<N, KD, MODE, SBK>(), "skinny gemm: bulk copies need whole 16-byte slices");
    constexpr unsigned ROW_BYTES = BK * sizeof(T), STAGE_BYTES = (BNW + BP) * ROW_BYTES;
    __shared__ __align__(8) unsigned long long bars[SST];
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < SST; ++s) dsg::mbar::init(&bars[s], 1);
      dsg::mbar::init_fence();
    }
    __syncthreads();
    // warp 0 announces the stage's bytes, then its lanes copy 4 weight rows and BP / 32 x rows each
    auto issue = [&](int stage, int kt) {
      const int k0 = kt * BK;
      T* w = Ws + stage * BNW * P;
      T* a = Xs + stage * BP * P;
      if (lane == 0) dsg::mbar::arrive_expect_tx(&bars[stage], STAGE_BYTES);
      __syncwarp();
      dsg::mbar::fence_proxy_async();
#pragma unroll
      for (int i = 0; i < BNW / 32; ++i) {
        const int r = lane + 32 * i;
        int n;
        const T* Wm;
        skinny_weight_row<MODE>(n0, r, W0, W1, n, Wm);
        dsg::bulk::copy(w + r * P, Wm + (i64)n * KD + k0, ROW_BYTES, &bars[stage]);
      }
      for (int r = lane; r < BP; r += 32) dsg::bulk::copy(a + r * P, x + (i64)s_row[r] * KD + k0, ROW_BYTES, &bars[stage]);
    };
    if (warp == 0)
      for (int s = 0; s < SST - 1 && s < KT; ++s) issue(s, s);
    for (int kt = 0; kt < KT; ++kt) {
      dsg::mbar::wait(&bars[kt % SST], (kt / SST) & 1);
      __syncthreads();        // every warp is done with the stage refilled below (slice kt - 1's)
      if (warp == 0 && kt + SST - 1 < KT) issue((kt + SST - 1) % SST, kt + SST - 1);
      compute(kt % SST);
    }
  } else {
    dsg::mma::cp_async_ring<SST>(KT, load_stage, compute);
  }

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
          int LRPW, int VEC, bool BULK>
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
  constexpr bool SKINNY_BULK = BULK && skinny_bulk_ok<N, KD, MODE, SBK>();
  // rows is uniform across the CTA, so every thread takes the same branch.
  if constexpr (SK >= 16) {
    if (rows <= 16) {
      grouped_gemm_skinny<T, MODE, N, KD, K, SBK, SST, 16, SKINNY_BULK>(x, W0, W1, order, s_row, pbeg, rows, n0, out0, out1, smem);
      return;
    }
  }
  if constexpr (SK >= 32) {
    if (rows <= 32) {
      grouped_gemm_skinny<T, MODE, N, KD, K, SBK, SST, 32, SKINNY_BULK>(x, W0, W1, order, s_row, pbeg, rows, n0, out0, out1, smem);
      return;
    }
  }
  if constexpr (SK >= 64) {
    if (rows <= 64) {
      grouped_gemm_skinny<T, MODE, N, KD, K, SBK, SST, 64, SKINNY_BULK>(x, W0, W1, order, s_row, pbeg, rows, n0, out0, out1, smem);
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

// ---- 5. combine: out[t] = round(sum_k w[t, k] * eo[t*K + k])  (+ shared, + residual) --------
// Pairs of weight 0 are skipped, not multiplied (their rows may be unwritten).
// Grid (T, cdiv(D, NT * VEC)): each thread owns one VEC-wide slice of one token's row.
// RESID mirrors the reference's rounding (plus_shared, plus_residual).
// VECTOR: one load / store per slice (bases aligned), else element accesses of the same slice.
// S > 0: a token's last S of its K pairs are the shared experts (ir/passes/fuse_shared_experts.py;
// `shared` is unused): their rows, summed and rounded once (shared_rows), are the shared output;
// the weighted sum runs over the first K - S pairs.

// The MoE layer's output where the unfused chain rounds, in its two steps: y = round(routed) +
// shared (moe_combine's output, then the shared experts' add), then residual + round(y); the caller
// rounds that to T as it stores it.
template <typename T>
__device__ __forceinline__ float plus_shared(float routed, float shared) { return round_to<T>(routed) + shared; }
template <typename T>
__device__ __forceinline__ float plus_residual(float y, float residual) { return residual + round_to<T>(y); }

// The shared experts' output from a token's last S pair rows (N elements at `row`, rows D apart):
// their sum, rounded to T as the shared MLP's down projection rounds its output.
template <typename T, int D, int K, int S, int N, bool VECTOR>
__device__ __forceinline__ void shared_rows(const T* __restrict__ eo, int t, int d, float (&sh)[N]) {
#pragma unroll
  for (int v = 0; v < N; ++v) sh[v] = 0.f;
#pragma unroll
  for (int k = K - S; k < K; ++k) {
    float ev[N];
    if constexpr (VECTOR) load_f<T, N>(eo + ((i64)t * K + k) * D + d, ev);
    else load_f_scalar<T, N>(eo + ((i64)t * K + k) * D + d, ev);
#pragma unroll
    for (int v = 0; v < N; ++v) sh[v] += ev[v];
  }
#pragma unroll
  for (int v = 0; v < N; ++v) sh[v] = round_to<T>(sh[v]);
}

template <typename T, int D, int K, int VEC, bool RESID, bool VECTOR, int S = 0>
__device__ __forceinline__ void combine_slice(const T* __restrict__ eo, const float* __restrict__ w,
                                              const T* __restrict__ shared, const T* __restrict__ residual,
                                              T* __restrict__ out, int t, int d) {
  static_assert(S >= 0 && S < K && (RESID || S == 0), "combine: shared pairs only in the residual combine");
  float s[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) s[v] = 0.f;
#pragma unroll
  for (int k = 0; k < K - S; ++k) {
    const float wk = w[(i64)t * K + k];
    // a pair of weight 0 adds nothing; its row may never have been written (another rank's
    // expert, which alignment left out: ir/ops/moe.py combine_ref)
    if (wk == 0.f) continue;
    float ev[VEC];
    if constexpr (VECTOR) load_f<T, VEC>(eo + ((i64)t * K + k) * D + d, ev);
    else load_f_scalar<T, VEC>(eo + ((i64)t * K + k) * D + d, ev);
#pragma unroll
    for (int v = 0; v < VEC; ++v) s[v] += ev[v] * wk;
  }
  if constexpr (RESID) {
    float sh[VEC], re[VEC];
    if constexpr (S > 0) shared_rows<T, D, K, S, VEC, VECTOR>(eo, t, d, sh);
    else if constexpr (VECTOR) load_f<T, VEC>(shared + (i64)t * D + d, sh);
    else load_f_scalar<T, VEC>(shared + (i64)t * D + d, sh);
    if constexpr (VECTOR) load_f<T, VEC>(residual + (i64)t * D + d, re);
    else load_f_scalar<T, VEC>(residual + (i64)t * D + d, re);
#pragma unroll
    for (int v = 0; v < VEC; ++v) s[v] = plus_residual<T>(plus_shared<T>(s[v], sh[v]), re[v]);
  }
  if constexpr (VECTOR) store_f<T, VEC>(out + (i64)t * D + d, s);
  else store_f_scalar<T, VEC>(out + (i64)t * D + d, s);
}

template <typename T, int D, int K, int NT, int VEC, bool RESID, int S = 0>
__device__ __forceinline__ void combine(const T* __restrict__ eo, const float* __restrict__ w,
                                        const T* __restrict__ shared, const T* __restrict__ residual,
                                        T* __restrict__ out) {
  static_assert(D % VEC == 0, "combine: D must be a multiple of the vector width");
  const int t = blockIdx.x;
  const int d = (blockIdx.y * NT + threadIdx.x) * VEC;
  if (d >= D) return;                         // D % VEC == 0: a slice is whole or absent
  if constexpr (VEC > 1) {
    // Rows are D (a multiple of VEC) elements apart: aligned bases keep every slice aligned.
    constexpr int A = vec_align<T, VEC>();
    if (aligned_to<A>(eo) && aligned_to<A>(out) &&
        (!RESID || ((S > 0 || aligned_to<A>(shared)) && aligned_to<A>(residual)))) {
      combine_slice<T, D, K, VEC, RESID, true, S>(eo, w, shared, residual, out, t, d);
      return;
    }
  }
  combine_slice<T, D, K, VEC, RESID, false, S>(eo, w, shared, residual, out, t, d);
}

// combine_row holds every routed row of its token in registers at once while the routed rows'
// elements a thread (pairs x RowLayout items) are at most this many; past it, a row at a time.
constexpr int COMBINE_ROWS_IN_FLIGHT_ITEMS = 64;

// The RESID combine of token t's whole row in RowLayout L (vec.cuh, which the caller includes; one
// CTA a token, so the row can feed a block reduction: moe_combine_residual_rms_norm.cu.j2): v[i]
// before its rounding to T.
// S: as combine_slice.
template <typename T, int D, int K, typename L, int S = 0>
__device__ __forceinline__ void combine_row(const T* __restrict__ eo, const float* __restrict__ w,
                                            const T* __restrict__ shared, const T* __restrict__ residual, int t,
                                            float (&v)[L::ITEMS]) {
  static_assert(S >= 0 && S < K, "combine_row: fewer shared pairs than pairs");
  constexpr int R = K - S;       // the routed pairs
  float e[L::ITEMS];
#pragma unroll
  for (int i = 0; i < L::ITEMS; ++i) v[i] = 0.f;
  if constexpr (R * L::ITEMS <= COMBINE_ROWS_IN_FLIGHT_ITEMS &&
                (R * L::ITEMS + 32) * L::NTHREADS <= 65536) {   // and they fit the registers a thread has
    // Every routed row's loads issued before the first is summed: one memory round trip, not R
    // (one CTA a token, so at decode's few tokens this kernel is that latency; the loop below
    // waited for each row in turn).  A pair of weight 0 adds nothing, as below: its row is read
    // (the buffer holds it) and dropped, whatever it holds.  The same sums in the same order.
    float wk[R], er[R][L::ITEMS];
#pragma unroll
    for (int k = 0; k < R; ++k) wk[k] = w[(i64)t * K + k];
#pragma unroll
    for (int k = 0; k < R; ++k) L::load(eo + ((i64)t * K + k) * D, er[k]);
#pragma unroll
    for (int k = 0; k < R; ++k)
      if (wk[k] != 0.f)
#pragma unroll
        for (int i = 0; i < L::ITEMS; ++i) v[i] += er[k][i] * wk[k];
  } else {
    for (int k = 0; k < R; ++k) {
      const float wk = w[(i64)t * K + k];
      if (wk == 0.f) continue;     // as combine_slice; the same for the whole CTA
      L::load(eo + ((i64)t * K + k) * D, e);
#pragma unroll
      for (int i = 0; i < L::ITEMS; ++i) v[i] += e[i] * wk;
    }
  }
  if constexpr (S > 0) {         // shared_rows' sum and rounding, over the row layout
    float sh[L::ITEMS];
#pragma unroll
    for (int i = 0; i < L::ITEMS; ++i) sh[i] = 0.f;
#pragma unroll
    for (int k = K - S; k < K; ++k) {
      L::load(eo + ((i64)t * K + k) * D, e);
#pragma unroll
      for (int i = 0; i < L::ITEMS; ++i) sh[i] += e[i];
    }
#pragma unroll
    for (int i = 0; i < L::ITEMS; ++i) e[i] = round_to<T>(sh[i]);
  } else {
    L::load(shared + (i64)t * D, e);
  }
#pragma unroll
  for (int i = 0; i < L::ITEMS; ++i) v[i] = plus_shared<T>(v[i], e[i]);
  L::load(residual + (i64)t * D, e);
#pragma unroll
  for (int i = 0; i < L::ITEMS; ++i) v[i] = plus_residual<T>(v[i], e[i]);
}

}  // namespace moe
}  // namespace dsg
