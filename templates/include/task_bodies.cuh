// Task bodies of a persistent segment (segment.cuh): what one CTA of a member launch does, given the
// tile index it would have had as blockIdx.x, and the weights it streams, for the L2 prefetch while
// the task waits.  Each body computes exactly what its own kernel's CTA computes (the same device
// functions, the same rounding), so a segment's outputs are bit-equal to the launches it replaces.
// Every thread of the CTA calls a body; the segment's block size is the member's.
#pragma once
#include "norm.cuh"   // before moe_combine.cuh, which uses vec.cuh's RowLayout
#include "moe_combine.cuh"
#include "mla_absorb.cuh"
#include "segment.cuh"
#include "skinny.cuh"

namespace dsg {
namespace seg {

// rms_norm.cu.j2's CTA t: out[t] = rms_norm(x[t]) * w.
template <typename T, int N, int THREADS>
__device__ __forceinline__ void rms_norm_task(const T* x, i64 x_stride, const T* w, T* out, float eps, int t,
                                              float* scratch) {
  typedef RowLayout<T, N, THREADS> L;
  float wv[L::ITEMS], v[L::ITEMS];
  L::load(w, wv);
  L::load(x + (i64)t * x_stride, v);
  rms_norm_row_loaded<T, N, L>(v, wv, eps, scratch);
  L::store(out + (i64)t * N, v);
}

// fused_add_rms_norm.cu.j2's CTA t: s[t] = x[t] + res[t] (rounded), h[t] = rms_norm(s[t]) * w.
template <typename T, int N, int THREADS>
__device__ __forceinline__ void add_rms_norm_task(const T* x, i64 x_stride, const T* res, i64 res_stride,
                                                  const T* w, T* h, T* s, float eps, int t, float* scratch) {
  typedef RowLayout<T, N, THREADS> L;
  float wv[L::ITEMS], v[L::ITEMS], r[L::ITEMS];
  L::load(w, wv);
  L::load(x + (i64)t * x_stride, v);
  L::load(res + (i64)t * res_stride, r);
#pragma unroll
  for (int i = 0; i < L::ITEMS; ++i) v[i] = round_to<T>(v[i] + r[i]);
  L::store(s + (i64)t * N, v);
  rms_norm_row_loaded<T, N, L>(v, wv, eps, scratch);
  L::store(h + (i64)t * N, v);
}

// moe_combine_residual_rms_norm.cu.j2's CTA t: s[t] = the MoE layer's output plus the residual (rounded),
// h[t] = rms_norm(s[t]) * w.  S > 0: the token's last S pairs are the shared experts (no shared input).
template <typename T, int D, int K, int S, int THREADS>
__device__ __forceinline__ void combine_rms_norm_task(const T* eo, const float* w, const T* shared,
                                                      const T* residual, const T* nw, T* h, T* s, float eps, int t,
                                                      float* scratch) {
  typedef RowLayout<T, D, THREADS> L;
  float wv[L::ITEMS], v[L::ITEMS];
  L::load(nw, wv);
  moe::combine_row<T, D, K, L, S>(eo, w, shared, residual, t, v);
#pragma unroll
  for (int i = 0; i < L::ITEMS; ++i) v[i] = round_to<T>(v[i]);
  L::store(s + (i64)t * D, v);
  rms_norm_row_loaded<T, D, L>(v, wv, eps, scratch);
  L::store(h + (i64)t * D, v);
}

// mla_v_up.cu.j2's tensor-core CTA (token chunk, head, row block) of a 3-D grid (tasks / (H * GZ), H, GZ):
// task `tile` is that grid's CTA ((chunk * H + h) * GZ + z).
template <typename T, int H, int N, int V, int C, int TN, int MT, int KS, int CPS, int GZ>
__device__ __forceinline__ void v_up_task(const T* ol, i64 ol_s0, i64 ol_s1, const T* kv_b, T* out, int ntok, int tile,
                                          int tasks, float* smem) {
  typedef absorb::AbsorbVUp<T, H, N, V, C, TN, MT, KS, CPS> VUp;
  VUp::run_cta(ol, ol_s0, ol_s1, kv_b, out, ntok, reinterpret_cast<unsigned char*>(smem), tile / (H * GZ),
               tasks / (H * GZ), tile / GZ % H, tile % GZ);
}

// The W_UV rows of a v_up task: head h's rows z * MT * 16 .. +MT * 16 - 1 (kv_b rows h * (N + V) + N + v).
template <typename T, int H, int N, int V, int C, int MT, int GZ>
__device__ __forceinline__ void v_up_prefetch(const T* kv_b, int tile) {
  const int h = tile / GZ % H, v0 = tile % GZ * MT * 16;
  prefetch_rows(MT * 16, (long long)C * sizeof(T), [&](int r) {
    return v0 + r < V ? kv_b + ((i64)h * (N + V) + N + v0 + r) * C : (const T*)nullptr;
  });
}

// A norm's weight row.
template <typename T, int N>
__device__ __forceinline__ void norm_prefetch(const T* w) {
  prefetch_rows(1, (long long)N * sizeof(T), [&](int) { return w; });
}

// skinny.cuh's linear for the CTA of tile `tile` (KS = 1: a segment has no clusters).
template <typename T, int K, int WARPS, int RT, int U, bool SILU, int... ROWS>
__device__ __forceinline__ void linear_task(const T* x, i64 x_stride, const skinny::Mats<T, sizeof...(ROWS)>& m,
                                            int ntok, int tile, float* red) {
  const int row0 = tile * RT * skinny::TILE;
  const bool vec = skinny::vec_ok<T, K, (int)sizeof...(ROWS)>(x, x_stride, m);
  if constexpr (skinny::IsF32<T>::value) {
    if (vec) skinny::fp32_tiles<K, WARPS, RT, true, 1, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    else skinny::fp32_tiles<K, WARPS, RT, false, 1, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    skinny::fp32_store<WARPS, RT, 1, SILU, ROWS...>(m, ntok, row0, red);
  } else if (ntok <= 8) {
    if (vec) skinny::mma_tiles<T, K, WARPS, RT, U, 1, true, 1, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    else skinny::mma_tiles<T, K, WARPS, RT, U, 1, false, 1, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    skinny::mma_store<T, WARPS, RT, 1, 1, SILU, ROWS...>(m, ntok, row0, red);
  } else {
    if (vec) skinny::mma_tiles<T, K, WARPS, RT, U, 2, true, 1, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    else skinny::mma_tiles<T, K, WARPS, RT, U, 2, false, 1, SILU, ROWS...>(x, x_stride, m, ntok, row0, red);
    skinny::mma_store<T, WARPS, RT, 2, 1, SILU, ROWS...>(m, ntok, row0, red);
  }
}

// The weight rows of a linear's tile.
template <typename T, int K, int RT, bool SILU, int... ROWS>
__device__ __forceinline__ void linear_prefetch(const skinny::Mats<T, sizeof...(ROWS)>& m, int tile) {
  const int row0 = tile * RT * skinny::TILE;
  prefetch_rows(RT * skinny::TILE, (long long)K * sizeof(T),
                [&](int r) { return skinny::weight_row<T, K, SILU, ROWS...>(m, row0 + r); });
}

}  // namespace seg
}  // namespace dsg
