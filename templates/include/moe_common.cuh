// DeepSeekMoE device code shared by the MoE headers (moe_router.cuh, moe_grouped.cuh,
// moe_combine.cuh, router_gemm.cuh, moe_wgmma*.cuh): the alignment contract their vector accesses
// rely on, and the vector loads / stores between N elements of T and N floats.
//
// Dimension legend (every moe_*.cuh): T tokens, D hidden, E routed experts, K experts per token,
// G expert groups, M expert intermediate size, NP = T*K token-expert pairs (pair p = t*K + k).
#pragma once
#include "common.cuh"

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

}  // namespace moe
}  // namespace dsg
