// The streaming combine of moe_combine_residual_rms_norm_stream.cu.j2: a CTA serves many tokens, and
// a token's rows (its K pair rows of eo, the shared row where S == 0, the residual) reach shared
// memory through 16-byte cp.async while the token before it is normalised, so an SM keeps a whole
// token's rows a CTA in flight across the block reductions (one CTA a token waits on its loads, then
// on its reductions, with nothing in flight).
//
// Every thread copies exactly the 16-byte slices of RowLayout L it later reads itself, so the stage
// needs no barrier: a thread's cp.async.wait_group orders its own copies, and it re-fills its slices
// only after reading them.  The sums are combine_row's (moe_combine.cuh), term by term in the same
// order with the same rounding points, so the outputs are the same bits.
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "moe_combine.cuh"
#include "vec.cuh"

namespace dsg {
namespace moe {

template <typename T, int D, int K, int S, typename L>
struct CombineStream {
  static_assert(L::VEC * (int)sizeof(T) == 16, "streaming combine: rows of whole 16-byte slices");
  static constexpr int R = K - S;                       // the routed pairs
  static constexpr int SHARED_ROW = K;                  // the shared input's stage row (S == 0)
  static constexpr int RESID_ROW = S > 0 ? K : K + 1;   // the residual's
  static constexpr int ROWS = RESID_ROW + 1;
  static constexpr int BYTES = ROWS * D * (int)sizeof(T);

  // Whether every row the stage copies starts 16-byte aligned (rows are D elements, whole slices,
  // apart); else the caller sums from global memory (Direct).
  __device__ static __forceinline__ bool aligned(const T* eo, const T* shared, const T* residual) {
    return aligned16(eo) && aligned16(residual) && (S > 0 || aligned16(shared));
  }

  __device__ static __forceinline__ void copy_row(T* dst, const T* src) {
#pragma unroll
    for (int c = 0; c < L::CHUNKS; ++c) {
      const int i0 = L::index(c, 0);
      if (i0 < D) mma::cp_async16(dst + i0, src + i0, 16);
    }
  }

  // Token t's rows into the stage (this thread's slices) and its routed weights into wk.
  __device__ static __forceinline__ void issue(const T* __restrict__ eo, const float* __restrict__ w,
                                               const T* __restrict__ shared, const T* __restrict__ residual,
                                               int t, T* stage, float (&wk)[R]) {
#pragma unroll
    for (int k = 0; k < K; ++k) copy_row(stage + k * D, eo + ((i64)t * K + k) * D);
    if constexpr (S == 0) copy_row(stage + SHARED_ROW * D, shared + (i64)t * D);
    copy_row(stage + RESID_ROW * D, residual + (i64)t * D);
    mma::cp_async_commit();
    weights(w, t, wk);
  }

  __device__ static __forceinline__ void weights(const float* __restrict__ w, int t, float (&wk)[R]) {
#pragma unroll
    for (int k = 0; k < R; ++k) wk[k] = w[(i64)t * K + k];
  }

  // A token's rows where they are, row r as RowLayout's v (zeros past D): the stage's (16-byte aligned: one
  // 16-byte shared load a chunk, no alignment test), or (rows not 16-byte aligned) token t's in global
  // memory, read a row at a time by RowLayout's loads (combine_row's all-rows-at-once registers would leave
  // the staged path, which needs few, short of them).
  struct Staged {
    const T* stage;
    __device__ __forceinline__ void operator()(int r, float (&e)[L::ITEMS]) const {
#pragma unroll
      for (int c = 0; c < L::CHUNKS; ++c) {
        const int i0 = L::index(c, 0);
        if (i0 < D) load16(stage + r * D + i0, e + c * L::VEC);
        else
#pragma unroll
          for (int j = 0; j < L::VEC; ++j) e[c * L::VEC + j] = 0.f;
      }
    }
  };
  struct Direct {
    const T *eo, *shared, *residual;
    int t;
    __device__ __forceinline__ void operator()(int r, float (&e)[L::ITEMS]) const {
      L::load(r < K ? eo + ((i64)t * K + r) * D : r == RESID_ROW ? residual + (i64)t * D : shared + (i64)t * D, e);
    }
  };

  // combine_row's v from a token's rows (Staged: after this thread's copies land): the same sums.
  template <typename Rows>
  __device__ static __forceinline__ void sum(Rows rows, const float (&wk)[R], float (&v)[L::ITEMS]) {
    mma::cp_async_wait<0>();
    float e[L::ITEMS];
#pragma unroll
    for (int i = 0; i < L::ITEMS; ++i) v[i] = 0.f;
#pragma unroll
    for (int k = 0; k < R; ++k)
      if (wk[k] != 0.f) {
        rows(k, e);
#pragma unroll
        for (int i = 0; i < L::ITEMS; ++i) v[i] += e[i] * wk[k];
      }
    if constexpr (S > 0) {        // shared_rows' sum and rounding
      float sh[L::ITEMS];
#pragma unroll
      for (int i = 0; i < L::ITEMS; ++i) sh[i] = 0.f;
#pragma unroll
      for (int j = 0; j < S; ++j) {
        rows(R + j, e);
#pragma unroll
        for (int i = 0; i < L::ITEMS; ++i) sh[i] += e[i];
      }
#pragma unroll
      for (int i = 0; i < L::ITEMS; ++i) e[i] = round_to<T>(sh[i]);
    } else {
      rows(SHARED_ROW, e);
    }
#pragma unroll
    for (int i = 0; i < L::ITEMS; ++i) v[i] = plus_shared<T>(v[i], e[i]);
    rows(RESID_ROW, e);
#pragma unroll
    for (int i = 0; i < L::ITEMS; ++i) v[i] = plus_residual<T>(v[i], e[i]);
  }
};

}  // namespace moe
}  // namespace dsg
