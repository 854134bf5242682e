// DeepSeekMoE combine device code: a token's expert outputs weighted and summed, plus the shared
// experts' output and the residual where the layer fuses them.  Semantics mirror ir/ops/moe.py
// (combine_ref, and moe_combine_residual's rounding points), including where results are rounded
// to the activation type.  Templates only fill in the constants.
// Dimensions: moe_common.cuh's legend.
#pragma once
#include "common.cuh"
#include "moe_common.cuh"

namespace dsg {
namespace moe {

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

// combine_row holds routed rows of its token in registers at once while their elements a thread
// (pairs x RowLayout items) are at most this many (and the registers hold them); past it, in groups.
constexpr int COMBINE_ROWS_IN_FLIGHT_ITEMS = 64;
// ... and every row of the token (routed, shared, residual) at once while they are at most this many.
constexpr int COMBINE_ALL_IN_FLIGHT_ITEMS = 96;

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
#pragma unroll
  for (int i = 0; i < L::ITEMS; ++i) v[i] = 0.f;
  constexpr int SH = S > 0 ? S : 1;                  // the shared rows, or the shared input
  constexpr int ALL_ITEMS = (R + SH + 1) * L::ITEMS;  // every row the token's sum reads
  // (+ 24: the registers a thread needs besides the rows; ptxas: V2-Lite 95 for 72 items at 256
  // threads, V2 88 for 72 at 640, whose 102 a thread the former + 32 bound did not allow)
  if constexpr (ALL_ITEMS <= COMBINE_ALL_IN_FLIGHT_ITEMS && (ALL_ITEMS + 24) * L::NTHREADS <= 65536) {
    // Every row's loads, the shared rows' and the residual's too, issued before the first sum: one
    // memory round trip.  With only the routed rows ahead (below) the SASS summed them, then loaded
    // the shared rows, summed those, then loaded the residual: three round trips after the wait at
    // one token.  The same sums in the same order.
    float wk[R], er[R][L::ITEMS], es[SH][L::ITEMS], res[L::ITEMS];
#pragma unroll
    for (int k = 0; k < R; ++k) wk[k] = w[(i64)t * K + k];
#pragma unroll
    for (int k = 0; k < R; ++k) L::load(eo + ((i64)t * K + k) * D, er[k]);
    if constexpr (S > 0) {
#pragma unroll
      for (int j = 0; j < S; ++j) L::load(eo + ((i64)t * K + R + j) * D, es[j]);
    } else {
      L::load(shared + (i64)t * D, es[0]);
    }
    L::load(residual + (i64)t * D, res);
#pragma unroll
    for (int k = 0; k < R; ++k)
      if (wk[k] != 0.f)
#pragma unroll
        for (int i = 0; i < L::ITEMS; ++i) v[i] += er[k][i] * wk[k];
    if constexpr (S > 0) {
#pragma unroll
      for (int i = 0; i < L::ITEMS; ++i) {
        float sh = 0.f;
#pragma unroll
        for (int j = 0; j < S; ++j) sh += es[j][i];
        es[0][i] = round_to<T>(sh);
      }
    }
#pragma unroll
    for (int i = 0; i < L::ITEMS; ++i) v[i] = plus_residual<T>(plus_shared<T>(v[i], es[0][i]), res[i]);
    return;
  }
  // Otherwise the routed rows GROUP at a time, each group's loads issued before its first sum:
  // all of them at once where their items fit (one round trip, not R: at decode's few tokens this
  // kernel is that latency), 4 at a time at V3's 896 threads (two trips, not eight).  A pair of weight 0 adds nothing: its row is read (the buffer holds it) and dropped,
  // whatever it holds.  The same sums in the same order.
  constexpr int BUDGET = 65536 / L::NTHREADS - 40;   // a thread's registers past what else it needs
  constexpr int FIT = (BUDGET < COMBINE_ROWS_IN_FLIGHT_ITEMS ? BUDGET : COMBINE_ROWS_IN_FLIGHT_ITEMS) / L::ITEMS;
  constexpr int GROUP = FIT < 1 ? 1 : FIT < R ? FIT : R;
#pragma unroll 1
  for (int k0 = 0; k0 < R; k0 += GROUP) {
    float wk[GROUP], er[GROUP][L::ITEMS];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) wk[g] = k0 + g < R ? w[(i64)t * K + k0 + g] : 0.f;
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
      if (k0 + g < R) L::load(eo + ((i64)t * K + k0 + g) * D, er[g]);
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
      if (wk[g] != 0.f)          // (past R: weight 0)
#pragma unroll
        for (int i = 0; i < L::ITEMS; ++i) v[i] += er[g][i] * wk[g];
  }
  float e[L::ITEMS];
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
