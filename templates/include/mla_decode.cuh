// Paged MLA decode over compressed cache rows [c_n (C) | k_rot (R)], in one launch.
//
// Work item (token t, head group g): HG heads of token t attend the token's visible rows
// (j <= positions[t], j < context_len). The item's rows are cut into S * G contiguous splits, one
// CTA each. Every CTA streams its rows from the paged cache through shared memory (each row read
// once for all HG heads), keeps an online softmax and leaves its partial (per head: max, sum,
// unnormalised accumulators) in its own shared memory. SplitMerge then merges them in two levels:
//  1. on chip: with S > 1 each S consecutive splits form one thread-block cluster, and split s
//     reads the cluster's partials through distributed shared memory and merges output columns
//     [s * cdiv(C, S), ...). S is a compile-time constant of each kernel (the cluster size): the
//     lowering emits one kernel per S and gives exactly one of them a non-empty grid.
//  2. through L2, only when G > 1 clusters serve an item (G = gridDim.x / (items * S), read at run
//     time): each CTA writes its columns of its cluster's merged result, normalised, with the
//     cluster's (max, sum) per head, to a workspace record and takes a ticket; the rank-s CTA that
//     arrives last of the item's G merges the G records' columns and writes the output. The
//     tickets reset themselves (tickets.cuh): nothing to clear between CUDA-graph replays.
// Level 2 lets an item use more CTAs than one cluster holds (one token at a long context: 64
// splits) and many items use clusters of 2, which pack onto the GPCs where clusters of 4 or 8 do
// not (codegen/families/mla_decode_attention.py says which S and G a step gets).
//
// MlaDecode is the CUDA-core split (fp32, odd shapes; G == 1); MlaDecodeMma the tensor-core one
// (bf16 / fp16). Scores are kept in log2 units (exp2f) with the scale folded in.
#pragma once
#include "vec.cuh"
#include "cluster.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "tickets.cuh"

namespace dsg {

template <typename T> __device__ __forceinline__ float2 pair_to_float2(const T* p);
template <> __device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <> __device__ __forceinline__ float2 pair_to_float2<__half>(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}
template <> __device__ __forceinline__ float2 pair_to_float2<float>(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

// The sequence b that owns token t: the last b with query_start[b] <= t.
__device__ __forceinline__ int sequence_of(const i32* __restrict__ query_start, int B, int t) {
  int lo = 0, hi = B - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Bytes rounded up to a multiple of 16 (shared-memory carve-ups start every piece 16-byte aligned).
__host__ __device__ constexpr int round_up16(int bytes) { return (bytes + 15) / 16 * 16; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// The split of a CTA: blockIdx.x = (item * G + gi) * S + s, item = t * NG + g, G clusters of S
// splits per item (G = gridDim.x / (items * S): the lowering's grid is exactly items * S * G).
// locate() is arithmetic only; rows() reads the step metadata: rows [r_begin, r_end) of the item's
// n visible rows for split gi * S + s of S * G, every split but the last whole KT tiles (later
// splits may be empty; split 0, in cluster 0, always holds the first row).
template <int S>
struct DecodeSplit {
  bool valid;
  int t, g, s, split, splits, b, r_begin, r_end;
  int ctx_len, q_begin, q_end;   // the sequence's context length and query tokens [q_begin, q_end)
  i64 pos;                       // the token's position

  // G, the clusters of an item, and the item of this CTA: arithmetic on the grid, recomputed where
  // the merge needs them rather than kept live across the tile loop.
  __device__ __forceinline__ static int clusters(int items) { return max(1, (int)gridDim.x / max(1, items * S)); }
  __device__ __forceinline__ static int item_of(int G) { return (int)blockIdx.x / S / G; }

  template <int NG>
  __device__ __forceinline__ static DecodeSplit locate(int T_) {
    DecodeSplit d;
    const int items = T_ * NG, G = clusters(items);
    const int cl = (int)blockIdx.x / S, item = cl / G;
    d.s = (int)blockIdx.x - cl * S;
    d.split = (cl - item * G) * S + d.s;
    d.splits = S * G;
    d.valid = item < items;   // the grid is exactly items * S * G: a guard, not a case
    d.t = item / NG;
    d.g = item - d.t * NG;
    d.b = 0;
    d.r_begin = d.r_end = 0;
    d.ctx_len = d.q_begin = d.q_end = 0;
    d.pos = 0;
    return d;
  }
  // rows()' guess of the token's sequence: its own index (one token a sequence at decode).
  __device__ __forceinline__ int guessed_sequence(int B) const { return min(t, B - 1); }
  // Every metadata word the split needs (fresh_from's too), loaded together.  A decode step has one
  // token a sequence, so the token's sequence is its own index: guessed, the four loads go out in one
  // round trip, and the guess is checked against the query range it loaded (query_start is sorted,
  // so qs[g] <= t < qs[g + 1] makes g the last sequence starting at or before t, as the search
  // finds).  Only a wrong guess (several tokens a sequence) searches, a round trip a halving, and
  // loads again.  The search first and then the loads took two round trips at one sequence and
  // log2(B) + 2 at B: the decode attention's chain before its wait.
  template <int KT>
  __device__ __forceinline__ void rows(const i32* __restrict__ context_lens, const i32* __restrict__ query_start,
                                       const i64* __restrict__ positions, int B) {
    if (!valid) return;
    b = guessed_sequence(B);
    q_begin = query_start[b];
    q_end = query_start[b + 1];
    ctx_len = context_lens[b];
    pos = positions[t];
    if (!(q_begin <= t && t < q_end)) {   // through L2 (__ldcg): as the same loads as the guess's, the
      b = sequence_of(query_start, B, t);  // compiler merged the two and issued the guess's after the check
      q_begin = __ldcg(query_start + b);
      q_end = __ldcg(query_start + b + 1);
      ctx_len = __ldcg(context_lens + b);
    }
    const int n = (int)min((i64)ctx_len, pos + 1);   // visible rows
    const int per = ((n + splits - 1) / splits + KT - 1) / KT * KT;
    r_begin = split * per;
    r_end = min(n, r_begin + per);
  }
  // The guessed sequence's block-table row towards L1 (rows()' guess: one token a sequence), one
  // entry a thread (every line of the row's first blockDim.x entries: 256 pages, 16K rows at 64 a
  // page), so that the page lookups after rows() hit L1 instead of waiting another round trip to L2.
  // Called right after locate(), its prefetches leave with rows()' loads.
  __device__ __forceinline__ void warm_table(const i32* __restrict__ block_tables, int bt_width, int B) const {
    if (!valid) return;
    const int e = (int)threadIdx.x;
    if (e < bt_width) {
      const i32* p = block_tables + (i64)guessed_sequence(B) * bt_width + e;
      asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
    }
  }
  __device__ __forceinline__ int tiles(int KT) const { return r_end > r_begin ? (r_end - r_begin + KT - 1) / KT : 0; }
  // The first cache row this step writes for the CTA's sequence: its tokens are the last query_len
  // rows of its context (positions context_len - query_len ..; both descriptions, the smaller).
  // Rows before it were written by earlier steps.  After rows(); the position of the sequence's first
  // query token is this token's own at decode (one token a sequence), else one more load.
  __device__ __forceinline__ int fresh_from(const i64* __restrict__ positions) const {
    return (int)min((i64)ctx_len - (q_end - q_begin), q_begin == t ? pos : positions[q_begin]);
  }
};

// The merge of one item's splits (S == 1 and G == 1 included: that kernel normalises its own).
// Every CTA left its partial at the start of its shared memory: ML (per head: max in log2 units,
// sum; (-inf, 0) for an empty split) then ACC [HG][CP] unnormalised accumulators (zero for an empty
// split). Split s weighs each of its cluster's partials by 2^(m_i - M) / sum_i l_i 2^(m_i - M) and
// takes columns [s * SPAN, ...) of the group's valid heads: with G == 1 those are the output; with
// G > 1 they go to the CTA's workspace record (REC floats at part + blockIdx.x * REC: the cluster's
// (M, L) per head, then [HG][SPAN] normalised columns), and the last of the item's G rank-s CTAs
// weighs the G records by L_j 2^(M_j - M*) / sum_j L_j 2^(M_j - M*) and writes the output. Records
// are summed in cluster order, so the bits do not depend on which CTA arrives last. run() is called
// by every thread of every CTA (the cluster barriers and the ticket need them all).
template <typename T, int C, int H, int HG, int THREADS, int S>
struct SplitMerge {
  static constexpr bool VEC = C % 32 == 0;               // float4 column quads in every slice (S <= 8)
  static constexpr int CP = VEC ? C + 8 : C;             // ACC pitch: the mma path's float2 stores of 8 heads
                                                         // fall on distinct banks per half-warp
  static constexpr int SPAN = (C + S - 1) / S;           // output columns per split
  static constexpr int ML_BYTES = round_up16(HG * 8);
  static constexpr int ACC_BYTES = round_up16(HG * CP * 4);
  static constexpr int WT_BYTES = S * HG * 4;            // this CTA's merge weights (never read by peers)
  static constexpr int BYTES = ML_BYTES + ACC_BYTES + WT_BYTES;
  static constexpr int GMAX = 8;                         // most clusters an item has (the lowering's cap)
  static constexpr int REC_ML = (2 * HG + 3) / 4 * 4;    // a record's (max, sum) per head, 16-byte padded
  static constexpr int REC = REC_ML + (HG * SPAN + 3) / 4 * 4;   // floats of a workspace record (level 2): 16-byte multiples
  static constexpr int TICKETS = 1024;                   // items * S the level-2 tickets serve (the lowering's)
  static_assert(S == 1 || S == 2 || S == 4 || S == 8, "a cluster of 1, 2, 4 or 8 CTAs (portable sizes)");
  static_assert(GMAX * HG * 4 <= ACC_BYTES, "the level-2 weights ([G][HG]) reuse the accumulators' shared memory");
  static_assert((!VEC || SPAN % 4 == 0) && REC % 4 == 0, "float4 columns and 16-byte records");

  // The weights of S partials (m[i]: max in log2 units, -inf for an empty split; sum_of(i) its sum,
  // read only where the split has rows): w[i] = 2^(m_i - M) / sum_j l_j 2^(m_j - M), zero for an
  // empty split.  Returns (M, L) (a level-2 record keeps them).
  template <typename SumOf>
  __device__ __forceinline__ static float2 weights(const float (&m)[S], SumOf&& sum_of, float (&w)[S]) {
    float M = -CUDART_INF_F, L = 0.f;
#pragma unroll
    for (int i = 0; i < S; ++i) M = fmaxf(M, m[i]);
#pragma unroll
    for (int i = 0; i < S; ++i)
      if (m[i] != -CUDART_INF_F) L += sum_of(i) * exp2f(m[i] - M);
    // L > 0 but for a cluster of empty splits (only when G > 1: cluster 0 holds the first row)
    const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
    for (int i = 0; i < S; ++i) w[i] = m[i] != -CUDART_INF_F ? exp2f(m[i] - M) * inv : 0.f;
    return make_float2(M, L);
  }

  __device__ __forceinline__ static float2* ml(char* smem) { return reinterpret_cast<float2*>(smem); }
  __device__ __forceinline__ static float* acc(char* smem) { return reinterpret_cast<float*>(smem + ML_BYTES); }

  // Columns [c0, c1) of the nh valid heads: out[hh][c] = value(hh, c) (a float4 of c .. c + 3 when
  // VEC, else a float), 4-element stores where the output's base allows them.
  template <typename V4, typename V1>
  __device__ __forceinline__ static void store(T* __restrict__ o, int nh, int c0, int c1, V4&& value4, V1&& value1) {
    const int tid = threadIdx.x;
    if constexpr (VEC) {
      // (t, h, c) rows of a contiguous [T, H, C] output: 4-element stores where the base allows
      const bool ov = (reinterpret_cast<unsigned long long>(o) & (4 * sizeof(T) - 1)) == 0;
      const int nq = (c1 - c0) / 4;   // C % 32 == 0 and S <= 8: whole quads
      for (int e = tid; e < nh * nq; e += THREADS) {
        const int hh = e / nq, c = c0 + 4 * (e - hh * nq);
        const float4 a = value4(hh, c);
        T* dst = o + (i64)hh * C + c;
        if (ov) {
          if constexpr (sizeof(T) == 2) *reinterpret_cast<uint2*>(dst) = make_uint2(mma::pack2<T>(a.x, a.y), mma::pack2<T>(a.z, a.w));
          else *reinterpret_cast<float4*>(dst) = a;
        } else {
          dst[0] = from_float<T>(a.x); dst[1] = from_float<T>(a.y); dst[2] = from_float<T>(a.z); dst[3] = from_float<T>(a.w);
        }
      }
    } else {
      const int nc = c1 - c0;
      for (int e = tid; e < nh * nc; e += THREADS) {
        const int hh = e / nc, c = c0 + (e - hh * nc);
        o[(i64)hh * C + c] = from_float<T>(value1(hh, c));
      }
    }
  }

  // part / tickets: the level-2 workspace and ticket counters (unused when G == 1; part may be null).
  __device__ static void run(char* smem, bool valid, int t, int h0, int s, T* __restrict__ out,
                             float* __restrict__ part, unsigned int* tickets, int item, int G) {
    constexpr bool CL = S > 1;
    const int tid = threadIdx.x;
    float* wts = reinterpret_cast<float*>(smem + ML_BYTES + ACC_BYTES);
    if constexpr (CL) cluster::sync(); else __syncthreads();
    DSG_PHASE(6);   // phases.cuh: every split's partial is in place
    const unsigned own = smem_u32(smem);
    unsigned peer[S];    // each split's partial, as seen from here (cluster rank == split)
#pragma unroll
    for (int i = 0; i < S; ++i) peer[i] = CL ? cluster::map_rank(own, i) : own;
    const int nh = min(HG, H - h0);
    const bool two = G > 1;                         // uniform over the grid
    float* rec = two ? part + (i64)blockIdx.x * REC : nullptr;
    if (valid && tid < nh) {
      float m[S], w[S];
#pragma unroll
      for (int i = 0; i < S; ++i) m[i] = cluster::ld<CL>(peer[i] + tid * 8);
      const float2 ML = weights(m, [&](int i) { return cluster::ld<CL>(peer[i] + tid * 8 + 4); }, w);
#pragma unroll
      for (int i = 0; i < S; ++i) wts[i * HG + tid] = w[i];
      if (two) reinterpret_cast<float2*>(rec)[tid] = ML;
    }
    __syncthreads();
    const int c0 = s * SPAN, c1 = min(C, c0 + SPAN);
    if (valid) {
      auto merged4 = [&](int hh, int c) {
        const unsigned off = ML_BYTES + (hh * CP + c) * 4;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < S; ++i) {
          const float w = wts[i * HG + hh];
          const float4 x = cluster::ld4<CL>(peer[i] + off);
          a.x = fmaf(w, x.x, a.x); a.y = fmaf(w, x.y, a.y); a.z = fmaf(w, x.z, a.z); a.w = fmaf(w, x.w, a.w);
        }
        return a;
      };
      auto merged1 = [&](int hh, int c) {
        const unsigned off = ML_BYTES + (hh * CP + c) * 4;
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < S; ++i) a = fmaf(wts[i * HG + hh], cluster::ld<CL>(peer[i] + off), a);
        return a;
      };
      if (!two) {
        store(out + ((i64)t * H + h0) * C, nh, c0, c1, merged4, merged1);
      } else {   // this CTA's columns of the cluster's result, normalised, to its record
        float* racc = rec + REC_ML;
        if constexpr (VEC) {
          const int nq = (c1 - c0) / 4;
          for (int e = tid; e < nh * nq; e += THREADS) {
            const int hh = e / nq, c = c0 + 4 * (e - hh * nq);
            *reinterpret_cast<float4*>(racc + hh * SPAN + (c - c0)) = merged4(hh, c);
          }
        } else {
          const int nc = c1 - c0;
          for (int e = tid; e < nh * nc; e += THREADS) {
            const int hh = e / nc, c = c0 + (e - hh * nc);
            racc[hh * SPAN + (c - c0)] = merged1(hh, c);
          }
        }
      }
    }
    DSG_PHASE(7);   // this CTA's columns merged (stored, or in its record)
    if constexpr (CL) cluster::sync_relaxed();   // no peer reads this CTA's shared memory after this
    if (!two || !valid) return;                   // both uniform over the CTA

    // Level 2, out of line: its code stays out of the tile loop's register allocation and schedule.
    level2(smem, t, h0, s, nh, out, part, tickets, item, G);
  }

  __device__ __noinline__ static void level2(char* smem, int t, int h0, int s, int nh, T* __restrict__ out,
                                             const float* __restrict__ part, unsigned int* tickets, int item, int G) {
    const int tid = threadIdx.x;
    const int c0 = s * SPAN, c1 = min(C, c0 + SPAN);
    // The last of the item's G rank-s CTAs merges their records' columns.
    // (the flag in the CTA's own ML words, which nobody reads any more: no static shared memory)
    if (!last_arrival(tickets + item * S + s, (unsigned)G, reinterpret_cast<int*>(smem))) return;
    float* w2 = acc(smem);                        // [GMAX][HG] record weights (the accumulators are free)
    const float* base = part + (i64)item * G * S * REC + s * REC;   // record (item, j, s) at base + j * S * REC
    if (tid < nh) {
      float2 ml[GMAX];
      float Ms = -CUDART_INF_F, W = 0.f;
#pragma unroll
      for (int j = 0; j < GMAX; ++j)
        if (j < G) ml[j] = __ldcg(reinterpret_cast<const float2*>(base + (i64)j * S * REC) + tid);
#pragma unroll
      for (int j = 0; j < GMAX; ++j)
        if (j < G) Ms = fmaxf(Ms, ml[j].x);
#pragma unroll
      for (int j = 0; j < GMAX; ++j) {
        if (j < G) {
          const float wj = ml[j].x != -CUDART_INF_F ? ml[j].y * exp2f(ml[j].x - Ms) : 0.f;
          w2[j * HG + tid] = wj;
          W += wj;
        }
      }
      const float inv = W > 0.f ? 1.f / W : 0.f;   // W > 0: cluster 0 holds the first row
#pragma unroll
      for (int j = 0; j < GMAX; ++j)
        if (j < G) w2[j * HG + tid] *= inv;
    }
    __syncthreads();
    // The G records' loads are independent: unrolled to GMAX and issued together (one L2 latency a
    // column quad, not G of them in a row).
    auto final4 = [&](int hh, int c) {
      const float* src = base + REC_ML + hh * SPAN + (c - c0);
      float4 x[GMAX];
#pragma unroll
      for (int j = 0; j < GMAX; ++j)
        if (j < G) x[j] = __ldcg(reinterpret_cast<const float4*>(src + (i64)j * S * REC));
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < GMAX; ++j) {
        if (j < G) {
          const float w = w2[j * HG + hh];
          a.x = fmaf(w, x[j].x, a.x); a.y = fmaf(w, x[j].y, a.y); a.z = fmaf(w, x[j].z, a.z); a.w = fmaf(w, x[j].w, a.w);
        }
      }
      return a;
    };
    auto final1 = [&](int hh, int c) {
      const float* src = base + REC_ML + hh * SPAN + (c - c0);
      float x[GMAX];
#pragma unroll
      for (int j = 0; j < GMAX; ++j)
        if (j < G) x[j] = __ldcg(src + (i64)j * S * REC);
      float a = 0.f;
#pragma unroll
      for (int j = 0; j < GMAX; ++j)
        if (j < G) a = fmaf(w2[j * HG + hh], x[j], a);
      return a;
    };
    store(out + ((i64)t * H + h0) * C, nh, c0, c1, final4, final1);
  }
};

// CUDA-core split: CTA = one split of one item, THREADS threads; KT = 32-row tiles (one lane per
// row in the score phase), every piece of shared memory 16-byte aligned.
template <typename T, int C, int R, int H, int HG, int BS, int KT, int THREADS, int S>
struct MlaDecode {
  static constexpr int W = C + R;                       // cache row width
  static constexpr int NG = (H + HG - 1) / HG;
  static constexpr int BLOCK = THREADS;
  static constexpr int NWARPS = THREADS / 32;
  static constexpr int HPW = (HG + NWARPS - 1) / NWARPS;  // heads per warp (scores)
  static constexpr int CPT = (C + THREADS - 1) / THREADS; // value columns per thread
  static constexpr int WP = (W + 1) / 2;                 // element pairs per row
  static constexpr int KPH = (WP % 2 == 1) ? WP : WP + 1; // row pitch in pairs: odd, conflict-free
  static constexpr int KP = 2 * KPH;                     // row pitch in elements (shared)
  static constexpr int QP = 2 * WP;                      // query pitch (floats, zero padded)
  static constexpr int PP = (HG + 3) / 4 * 4;            // probabilities pitch (float4 reads)
  // Cache rows take 16-byte loads when a row is a whole number of vectors: row r starts at
  // cache + slot * W elements, and the cache is a contiguous [blocks, BS, W] tensor with a
  // 16-byte aligned base (the runtime's own allocation; runtime/launcher.py checks it).
  static constexpr bool VEC_ROWS = (W * (int)sizeof(T)) % 16 == 0;
  static constexpr int VPR = VEC_ROWS ? W * (int)sizeof(T) / 16 : 0;  // 16-byte vectors per row
  // Shared memory carve-up (bytes). Every piece is rounded up to 16 bytes so each one starts
  // 16-byte aligned: ps is read as float4, ks written as u32 / read as pairs, slot_s is i64.
  // (HG * QP * 4 alone is only a multiple of 8: HG * WP odd, e.g. H 3 and W 29, put ps off by 8.)
  // After the last tile the same memory holds the split's partial (SplitMerge).
  // codegen/families/mla_decode_attention.py smem_bytes() mirrors this; the kernel
  // static_asserts that the two agree.
  static constexpr int Q_BYTES = round_up16(HG * QP * 4);
  static constexpr int K_BYTES = round_up16(KT * KP * (int)sizeof(T));
  static constexpr int P_BYTES = KT * PP * 4;           // PP % 4 == 0: a multiple of 16
  static constexpr int A_BYTES = PP * 4;
  static constexpr int S_BYTES = KT * 8;
  typedef SplitMerge<T, C, H, HG, THREADS, S> Merge;
  static constexpr int SMEM = cmax(Q_BYTES + K_BYTES + P_BYTES + A_BYTES + S_BYTES, Merge::BYTES);
  static_assert(KT == 32, "one lane per tile row in the score phase");
  static_assert(THREADS % 32 == 0, "whole warps");
  static_assert(Q_BYTES % 16 == 0 && K_BYTES % 16 == 0 && P_BYTES % 16 == 0 && A_BYTES % 16 == 0,
                "every shared piece starts 16-byte aligned (ps float4, slot_s i64)");
  static_assert(PP % 4 == 0 && QP % 2 == 0 && KP % 2 == 0, "float4 / float2 / pair reads of shared rows");

  __device__ static void run(const T* __restrict__ q_lat, i64 ql_s0, i64 ql_s1,
                             const T* __restrict__ q_rot, i64 qr_s0, i64 qr_s1,
                             const T* __restrict__ cache, const i32* __restrict__ block_tables, int bt_width,
                             const i32* __restrict__ context_lens, const i32* __restrict__ query_start,
                             const i64* __restrict__ positions, T* __restrict__ out, float scale, int T_, int B,
                             float* __restrict__ part, unsigned int* tickets, char* smem) {
    DSG_PHASE(phases::ENTRY);   // phases.cuh
    float* qs = reinterpret_cast<float*>(smem);
    T* ks = reinterpret_cast<T*>(smem + Q_BYTES);
    float* ps = reinterpret_cast<float*>(smem + Q_BYTES + K_BYTES);
    float* alpha_s = reinterpret_cast<float*>(smem + Q_BYTES + K_BYTES + P_BYTES);
    i64* slot_s = reinterpret_cast<i64*>(smem + Q_BYTES + K_BYTES + P_BYTES + A_BYTES);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    pdl_wait();   // everything below reads what earlier kernels wrote (queries, cache, step metadata)
    DecodeSplit<S> sp = DecodeSplit<S>::template locate<NG>(T_);
    sp.template rows<KT>(context_lens, query_start, positions, B);
    const int t = sp.t, h0 = sp.g * HG;

    // Queries of the group, as float, zero past W and for heads past H.
    for (int i = tid; i < HG * QP; i += THREADS) {
      const int hh = i / QP, d = i % QP, h = h0 + hh;
      float v = 0.f;
      if (sp.valid && h < H && d < W)
        v = d < C ? to_float(q_lat[(i64)t * ql_s0 + (i64)h * ql_s1 + d])
                  : to_float(q_rot[(i64)t * qr_s0 + (i64)h * qr_s1 + (d - C)]);
      qs[i] = v;
    }
    // Pad elements of the K tile are read (times a zero query) by the score loop: zero them.
    for (int i = tid; i < KT * KP; i += THREADS) ks[i] = from_float<T>(0.f);

    const float scale_log2 = scale * 1.4426950408889634f;
    float m[HPW], l[HPW];
#pragma unroll
    for (int k = 0; k < HPW; ++k) { m[k] = -CUDART_INF_F; l[k] = 0.f; }
    float acc[CPT][HG];
#pragma unroll
    for (int k = 0; k < CPT; ++k)
#pragma unroll
      for (int h = 0; h < HG; ++h) acc[k][h] = 0.f;

    const i32* table = block_tables + (i64)sp.b * bt_width;
    for (int r0 = sp.r_begin; r0 < sp.r_end; r0 += KT) {
      const int rows = min(KT, sp.r_end - r0);
      __syncthreads();  // previous tile fully consumed (and qs / ks zeroing done)
      if (tid < rows) {
        const int r = r0 + tid;
        slot_s[tid] = (i64)table[r / BS] * BS + (r % BS);
      }
      __syncthreads();
      if constexpr (VEC_ROWS) {   // cache + slot * W + 16k bytes: 16-byte aligned (see VEC_ROWS)
        for (int i = tid; i < rows * VPR; i += THREADS) {
          const int j = i / VPR, v = i % VPR;
          const uint4 raw = *reinterpret_cast<const uint4*>(cache + slot_s[j] * W + v * (16 / (int)sizeof(T)));
          unsigned int* dst = reinterpret_cast<unsigned int*>(ks + j * KP + v * (16 / (int)sizeof(T)));
          dst[0] = raw.x; dst[1] = raw.y; dst[2] = raw.z; dst[3] = raw.w;
        }
      } else {
        for (int i = tid; i < rows * W; i += THREADS) {   // rows not 16-byte multiples
          const int j = i / W, d = i % W;
          ks[j * KP + d] = cache[slot_s[j] * W + d];
        }
      }
      __syncthreads();

      // Scores: lane = tile row, warp = heads warp, warp + NWARPS, ...
#pragma unroll
      for (int k = 0; k < HPW; ++k) {
        const int hh = warp + k * NWARPS;
        if (hh < HG) {   // warp-uniform
          float dot = 0.f;
          if (lane < rows) {
            const T* krow = ks + lane * KP;
            const float* qrow = qs + hh * QP;
#pragma unroll 8
            for (int p = 0; p < WP; ++p) {
              const float2 kv = pair_to_float2<T>(krow + 2 * p);
              const float2 qv = *reinterpret_cast<const float2*>(qrow + 2 * p);
              dot = fmaf(qv.x, kv.x, dot);
              dot = fmaf(qv.y, kv.y, dot);
            }
          }
          const float sc = lane < rows ? dot * scale_log2 : -CUDART_INF_F;
          const float m_new = fmaxf(m[k], warp_max(sc));
          const float pj = lane < rows ? exp2f(sc - m_new) : 0.f;
          const float alpha = exp2f(m[k] - m_new);
          l[k] = l[k] * alpha + warp_sum(pj);
          m[k] = m_new;
          ps[lane * PP + hh] = pj;
          if (lane == 0) alpha_s[hh] = alpha;
        }
      }
      __syncthreads();

      // Values: thread owns columns tid, tid + THREADS, ... for all HG heads.
      float al[HG];
#pragma unroll
      for (int h = 0; h < HG; ++h) al[h] = alpha_s[h];
#pragma unroll
      for (int k = 0; k < CPT; ++k)
#pragma unroll
        for (int h = 0; h < HG; ++h) acc[k][h] *= al[h];
      for (int j = 0; j < rows; ++j) {
        float pr[PP];
#pragma unroll
        for (int h4 = 0; h4 < PP / 4; ++h4) {
          const float4 v = *reinterpret_cast<const float4*>(ps + j * PP + 4 * h4);
          pr[4 * h4] = v.x; pr[4 * h4 + 1] = v.y; pr[4 * h4 + 2] = v.z; pr[4 * h4 + 3] = v.w;
        }
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
          const int c = tid + k * THREADS;
          const float kv = (c < C) ? to_float(ks[j * KP + c]) : 0.f;
#pragma unroll
          for (int h = 0; h < HG; ++h) acc[k][h] = fmaf(pr[h], kv, acc[k][h]);
        }
      }
    }
    pdl_launch_dependents();

    // The split's partial (an empty split: (-inf, 0) and zeros) over the tile memory, then the merge.
    __syncthreads();
    float2* ml = Merge::ml(smem);
    float* accs = Merge::acc(smem);
#pragma unroll
    for (int k = 0; k < HPW; ++k) {
      const int hh = warp + k * NWARPS;
      if (hh < HG && lane == 0) ml[hh] = make_float2(m[k], l[k]);
    }
#pragma unroll
    for (int h = 0; h < HG; ++h) {
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const int c = tid + k * THREADS;
        if (c < C) accs[h * Merge::CP + c] = acc[k][h];
      }
    }
    const int Gc = DecodeSplit<S>::clusters(T_ * NG);
    Merge::run(smem, sp.valid, t, h0, sp.s, out, part, tickets, DecodeSplit<S>::item_of(Gc), Gc);
    DSG_PHASE_EXIT();   // phases.cuh
  }
};

// Tensor-core split (bf16 / fp16): CTA = one split of one item (16 heads: the mma M dimension,
// heads past H have zero queries and are not stored), NW warps, KT = 8 * NW-row cache tiles
// through an NSTAGE-deep cp.async ring (16-byte copies; rows past the split zero-filled).
// Row layout in shared memory: 16-byte chunks, c ^ (row & 7) when a row is a multiple of 8
// chunks (576 wide: 72), else an odd chunk pitch: ldmatrix and the copies are conflict-free
// either way, and a 64-row tile of 576-wide rows takes exactly 72 KB.
// The queries live in registers as A fragments for the whole W (staged once through the last
// ring slot). Per tile:
//  - scores: warp w owns tile rows 8w .. 8w + 7 (one n8 tile) over all of W, four accumulator
//    chains; its per-head maximum goes to shared memory;
//  - every warp takes the tile maximum, computes P for its own rows (bf16/fp16) into shared
//    memory and keeps its own share of the row sums;
//  - values: warp w owns C / NW output columns; P (16 x KT) and V (the same tile) by ldmatrix.
// Three barriers per tile; no partial scores cross warps.
// The split reads the cache rows of earlier steps before its pdl_wait() (tests/gpu/test_kernels_mla.py
// -k reads_this_steps_rows races it), and after it copies this step's own rows of its first
// NSTAGE - 1 tiles (at decode one row a sequence) in a loop over those rows: an unrolled walk over
// every row of those tiles would be ~1,000 more instructions, fetched cold each layer.

template <typename T, int C, int R, int H, int BS, int NW, int NSTAGE, int S>
struct MlaDecodeMma {
  static constexpr int HG = 16;
  static constexpr int NG = (H + HG - 1) / HG;
  static constexpr int W = C + R;
  static constexpr int THREADS = NW * 32;
  static constexpr int BLOCK = THREADS;
  static constexpr int KT = 8 * NW;                 // tile rows: 8 per warp in the score phase
  static constexpr int VPR = W / 8;                 // 16-byte chunks per cache row
  static constexpr bool SWZ = VPR % 8 == 0;
  static constexpr int PITCH = SWZ ? VPR : (VPR | 1);   // shared row pitch in chunks
  static constexpr int STAGE_BYTES = KT * PITCH * 16;
  static constexpr int RING = NSTAGE * STAGE_BYTES;
  static constexpr int KSTEPS = W / 16;
  static constexpr int CW = C / NW;                 // value columns per warp
  static constexpr int VT = CW / 8;                 // value n8 tiles per warp
  static constexpr int PPITCH = KT + 8;             // P tile pitch (elements): odd chunk pitch
  static constexpr int MAX_OFF = RING;              // [NW][16] per-warp maxima (then row sums)
  static constexpr int P_OFF = MAX_OFF + NW * HG * 4;
  static constexpr int COPIES = (VPR + 31) / 32;    // chunks per lane per copied row
  static constexpr int NCH = NW == 8 ? 4 : 2;       // score accumulator chains (4 warps: registers are short)
  typedef SplitMerge<T, C, H, HG, THREADS, S> Merge;
  static constexpr int SMEM = cmax(P_OFF + HG * PPITCH * 2, Merge::BYTES);
  static constexpr bool BF16 = mma::MmaType<T>::BF16;
  static_assert(sizeof(T) == 2, "tensor-core path is bf16 / fp16");
  static_assert(W % 32 == 0 && C % (16 * NW) == 0, "k-step pairs over the row; n8 tile pairs over a warp's columns");
  static_assert(NSTAGE >= 2 && KT % 16 == 0, "ring and P tile shape");
  static_assert(HG * PITCH * 16 <= STAGE_BYTES, "the queries are staged in one ring slot");
  static_assert(Merge::BYTES <= RING, "the partial fits in the ring (the maxima region stays free for the sums)");

  __device__ __forceinline__ static char* chunk(char* base, int row, int c) {
    return base + (row * PITCH + (SWZ ? (c ^ (row & 7)) : c)) * 16;
  }

  // Tile `it` of the split into ring slot it % NSTAGE: warp w copies tile rows 8w .. 8w + 7 (their
  // pages looked up first, eight independent loads), lane l the chunks l, l + 32, ... of each.
  // WINDOW: only the split's rows r with lo <= r < hi, and with `fill` the rows past the split
  // zero-filled; two calls, [0, f) with fill and [f, ..) without, fill the slot as one call without
  // WINDOW does.
  // Cache row r of the split's sequence (block table `table`): its first element.
  __device__ __forceinline__ static const T* cache_row(const T* __restrict__ cache, const i32* __restrict__ table, int r) {
    return cache + ((i64)__ldg(table + r / BS) * BS + r % BS) * W;
  }
  // Lane l's 16-byte chunks l, l + 32, ... of one row, from src (bytes: 16, or 0 to zero-fill) into
  // row `row` of a ring slot.
  __device__ __forceinline__ static void copy_row(char* slot, int row, const T* src, int lane, int bytes) {
#pragma unroll
    for (int k = 0; k < COPIES; ++k) {
      const int c = lane + 32 * k;
      if (c < VPR) mma::cp_async16(chunk(slot, row, c), src + c * 8, bytes);
    }
  }

  template <bool WINDOW = false>
  __device__ __forceinline__ static void issue(char* ring, int it, const DecodeSplit<S>& sp, const T* __restrict__ cache,
                                               const i32* __restrict__ table, int warp, int lane,
                                               int lo = 0, int hi = 0, bool fill = true) {
    const int r0 = sp.r_begin + it * KT + warp * 8;
    char* dst = ring + (it % NSTAGE) * STAGE_BYTES;
    const T* src[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = r0 + i;
      src[i] = cache;   // zero fill past the split: nothing is read
      if (r < sp.r_end && (!WINDOW || (r >= lo && r < hi))) src[i] = cache_row(cache, table, r);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = r0 + i;
      const bool copy = r < sp.r_end && (!WINDOW || (r >= lo && r < hi));
      if (WINDOW && !copy && !(fill && r >= sp.r_end)) continue;
      copy_row(dst, warp * 8 + i, src[i], lane, copy ? 16 : 0);
    }
  }

  __device__ static void run(const T* __restrict__ q_lat, i64 ql_s0, i64 ql_s1,
                             const T* __restrict__ q_rot, i64 qr_s0, i64 qr_s1,
                             const T* __restrict__ cache, const i32* __restrict__ block_tables, int bt_width,
                             const i32* __restrict__ context_lens, const i32* __restrict__ query_start,
                             const i64* __restrict__ positions, T* __restrict__ out, float scale, int T_, int B,
                             float* __restrict__ part, unsigned int* tickets, char* smem) {
    DSG_PHASE(phases::ENTRY);   // phases.cuh: its launch apart from its pre-wait chain
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g8 = lane >> 2, c4 = lane & 3;   // mma fragment coordinates: heads g8, g8 + 8
    // Before the wait, what no kernel of this step writes (pdl.cuh): the step's
    // metadata (uploaded before the step's first kernel) and the cache rows earlier steps wrote,
    // i.e. the first NSTAGE - 1 tiles but for this step's own rows (fresh_from), which the kernel
    // before this one writes (mla_decode_query's cache CTA or mla_kv_cache_write): those, and the
    // queries, follow the wait.  At one token and a short context that is every cache row but one
    // off the critical path (the attention is ~6 us of a layer's step there).
    DecodeSplit<S> sp = DecodeSplit<S>::template locate<NG>(T_);
    sp.warm_table(block_tables, bt_width, B);
    sp.template rows<KT>(context_lens, query_start, positions, B);
    const int ntiles = sp.tiles(KT);
    const int fresh = sp.valid ? sp.fresh_from(positions) : 0;
    const i32* table = block_tables + (i64)sp.b * bt_width;
    char* ring = smem;
#pragma unroll
    for (int st = 0; st < NSTAGE - 1; ++st) {
      if (st < ntiles) issue<true>(ring, st, sp, cache, table, warp, lane, 0, fresh, true);
      mma::cp_async_commit();
    }
    pdl_wait();   // everything below reads what the kernels before it wrote (queries; this step's cache rows)

    // The group's queries go to the last ring slot (free until iteration 0 refills it, after its
    // barrier) and from there into A fragments: qf[ks] = heads 0-15 x columns 16 ks .. 16 ks + 15.
    // As 16-byte cp.async chunks where the views allow it (the engine's q_lat / q_rot are the two
    // parts of one [T, H, C + R] buffer), committed ahead of the first tiles so that their latency
    // overlaps the metadata chain (in one group with this step's rows of the first tiles); element
    // by element otherwise. Heads past H are zero.
    const int h0 = sp.g * HG;
    const T* ql = q_lat + (i64)sp.t * ql_s0;
    const T* qr = q_rot + (i64)sp.t * qr_s0;
    const bool qvec = aligned16(ql) && aligned16(qr) && ql_s1 % 8 == 0 && qr_s1 % 8 == 0;   // uniform
    char* qs = smem + (NSTAGE - 1) * STAGE_BYTES;
    if (qvec) {
      for (int e = tid; e < HG * VPR; e += THREADS) {
        const int hh = e / VPR, c = e - hh * VPR, h = h0 + hh;
        const bool live = sp.valid && h < H;
        const T* src = c * 8 < C ? ql + (i64)h * ql_s1 + c * 8 : qr + (i64)h * qr_s1 + (c * 8 - C);
        mma::cp_async16(chunk(qs, hh, c), live ? src : q_lat, live ? 16 : 0);
      }
    }
    // rows [fresh, r_end) of the first NSTAGE - 1 tiles, warp w the w-th, w + NW-th, ... of them
    const int lo = max(fresh, sp.r_begin), hi = min(sp.r_end, sp.r_begin + min(ntiles, NSTAGE - 1) * KT);
#pragma unroll 1
    for (int r = lo + warp; r < hi; r += NW) {
      const int it = (r - sp.r_begin) / KT;   // < NSTAGE - 1: ring slot it
      copy_row(ring + it * STAGE_BYTES, r - sp.r_begin - it * KT, cache_row(cache, table, r), lane, 16);
    }
    mma::cp_async_commit();
    if (!qvec) {
      for (int e = tid; e < HG * W; e += THREADS) {
        const int hh = e / W, d = e - hh * W, h = h0 + hh;
        T v = from_float<T>(0.f);
        if (sp.valid && h < H) v = d < C ? ql[(i64)h * ql_s1 + d] : qr[(i64)h * qr_s1 + (d - C)];
        *reinterpret_cast<T*>(chunk(qs, hh, d >> 3) + (d & 7) * 2) = v;
      }
    }
    mma::cp_async_wait<0>();   // the queries and the first NSTAGE - 1 tiles
    __syncthreads();
    DSG_PHASE(4);   // phases.cuh: the queries and the first tiles landed
    unsigned qf[KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) mma::ldsm_x4(qf[ks], chunk(qs, lane & 15, 2 * ks + (lane >> 4)));

    const float sl2 = scale * 1.4426950408889634f;
    float* red = reinterpret_cast<float*>(smem + MAX_OFF);
    T* ps = reinterpret_cast<T*>(smem + P_OFF);
    float m_r[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_r[2] = {0.f, 0.f};   // heads g8, g8 + 8; l: this lane's rows
    float o[VT][4];
#pragma unroll
    for (int v = 0; v < VT; ++v) o[v][0] = o[v][1] = o[v][2] = o[v][3] = 0.f;

    // This lane's ldmatrix chunk in the score loop is (4 kp + l3) ^ (row & 7), l3 = lane >> 3 and
    // row & 7 = lane & 7: with u = l3 ^ (lane & 7) that is 4 kp + (u & 3) + 4 (u >> 2) for even kp
    // and 4 kp + (u & 3) - 4 (u >> 2) for odd kp, two fixed offsets instead of one XOR per k-step.
    const int u = SWZ ? ((lane >> 3) ^ (lane & 7)) : (lane >> 3);
    const int k_even = ((u & 3) + (u & 4)) * 16, k_odd = ((u & 3) - (u & 4)) * 16;
    for (int it = 0; it < ntiles; ++it) {
      mma::cp_async_wait<NSTAGE - 2>();   // tile `it` (and the queries) landed: newer groups are tiles past it
      __syncthreads();   // tile `it` landed for every thread; every warp is done with tile it - 1
      if (it + NSTAGE - 1 < ntiles) issue(ring, it + NSTAGE - 1, sp, cache, table, warp, lane);
      mma::cp_async_commit();
      char* kb = ring + (it % NSTAGE) * STAGE_BYTES;
      const int rows = min(KT, sp.r_end - (sp.r_begin + it * KT));

      // Scores of this warp's 8 rows: S[head][row] = q[head] . k[row], NCH independent mma chains.
      float sc[NCH][4];
#pragma unroll
      for (int ch = 0; ch < NCH; ++ch) sc[ch][0] = sc[ch][1] = sc[ch][2] = sc[ch][3] = 0.f;
      const char* krow = kb + (warp * 8 + (lane & 7)) * PITCH * 16;
#pragma unroll
      for (int kp = 0; kp < KSTEPS / 2; ++kp) {
        unsigned bb[4];
        mma::ldsm_x4(bb, krow + (kp & 1 ? k_odd : k_even) + kp * 64);
        mma::mma16816<BF16>(sc[(2 * kp) % NCH], qf[2 * kp], bb[0], bb[1]);
        mma::mma16816<BF16>(sc[(2 * kp + 1) % NCH], qf[2 * kp + 1], bb[2], bb[3]);
      }
      const int j = warp * 8 + 2 * c4;   // this lane's rows j, j + 1
      float x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v = sc[0][i];
#pragma unroll
        for (int ch = 1; ch < NCH; ++ch) v += sc[ch][i];
        x[i] = j + (i & 1) < rows ? v * sl2 : -CUDART_INF_F;
      }
      float mx0 = fmaxf(x[0], x[1]), mx1 = fmaxf(x[2], x[3]);
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      if (c4 == 0) { red[warp * HG + g8] = mx0; red[warp * HG + g8 + 8] = mx1; }
      __syncthreads();   // every warp's maxima

      float mt0 = red[g8], mt1 = red[g8 + 8];
#pragma unroll
      for (int w = 1; w < NW; ++w) { mt0 = fmaxf(mt0, red[w * HG + g8]); mt1 = fmaxf(mt1, red[w * HG + g8 + 8]); }
      const float mn0 = fmaxf(m_r[0], mt0), mn1 = fmaxf(m_r[1], mt1);   // finite: the tile has a row
      const float al0 = exp2f(m_r[0] - mn0), al1 = exp2f(m_r[1] - mn1);
      m_r[0] = mn0; m_r[1] = mn1;
      const float p0 = exp2f(x[0] - mn0), p1 = exp2f(x[1] - mn0), p2 = exp2f(x[2] - mn1), p3 = exp2f(x[3] - mn1);
      l_r[0] = l_r[0] * al0 + (p0 + p1);
      l_r[1] = l_r[1] * al1 + (p2 + p3);
      *reinterpret_cast<unsigned*>(ps + g8 * PPITCH + j) = mma::pack2<T>(p0, p1);
      *reinterpret_cast<unsigned*>(ps + (g8 + 8) * PPITCH + j) = mma::pack2<T>(p2, p3);
      __syncthreads();   // the whole P tile

#pragma unroll
      for (int v = 0; v < VT; ++v) { o[v][0] *= al0; o[v][1] *= al0; o[v][2] *= al1; o[v][3] *= al1; }
#pragma unroll
      for (int k2 = 0; k2 < KT / 16; ++k2) {
        unsigned pa[4];
        mma::ldsm_x4(pa, ps + (lane & 15) * PPITCH + k2 * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int vp = 0; vp < VT / 2; ++vp) {
          unsigned bb[4];
          mma::ldsm_x4_t(bb, chunk(kb, k2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                   (warp * CW + vp * 16) / 8 + (lane >> 4)));
          mma::mma16816<BF16>(o[2 * vp], pa, bb[0], bb[1]);
          mma::mma16816<BF16>(o[2 * vp + 1], pa, bb[2], bb[3]);
        }
      }
    }
    mma::cp_async_wait<0>();   // only empty groups can remain
    pdl_launch_dependents();
    DSG_PHASE(5);   // every tile scored and summed

#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 1);
      l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 2);
    }
    // The split's partial (an empty split: (-inf, 0) and zeros) over the ring, then the merge.
    __syncthreads();   // every warp is done with the ring and the maxima
    float2* ml = Merge::ml(smem);
    float* acc = Merge::acc(smem);
    if (c4 == 0) { red[warp * HG + g8] = l_r[0]; red[warp * HG + g8 + 8] = l_r[1]; }
    if (warp == 0 && c4 == 0) { ml[g8].x = m_r[0]; ml[g8 + 8].x = m_r[1]; }
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      const int c = warp * CW + v * 8 + 2 * c4;
      *reinterpret_cast<float2*>(acc + g8 * Merge::CP + c) = make_float2(o[v][0], o[v][1]);
      *reinterpret_cast<float2*>(acc + (g8 + 8) * Merge::CP + c) = make_float2(o[v][2], o[v][3]);
    }
    __syncthreads();
    if (tid < HG) {
      float L = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) L += red[w * HG + tid];
      ml[tid].y = L;
    }
    const int Gc = DecodeSplit<S>::clusters(T_ * NG);
    Merge::run(smem, sp.valid, sp.t, h0, sp.s, out, part, tickets, DecodeSplit<S>::item_of(Gc), Gc);
    DSG_PHASE_EXIT();   // phases.cuh
  }
};

}  // namespace dsg
