// L2 cache policies (sm_80+).  A load or store that carries one tells L2 which of its lines to
// give up first when it needs room: evict_first for bytes read once (a decode step's weights),
// evict_last for bytes read again soon (an activation that many tiles gather).  The policy is a
// 64-bit value made by createpolicy (a constant: it folds into the instruction's operand).  Make
// it once, before a loop of accesses: each call is an instruction of its own.
#pragma once
#include "common.cuh"

namespace dsg {
namespace l2 {

__device__ __forceinline__ unsigned long long evict_first() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

__device__ __forceinline__ unsigned long long evict_last() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

// One 16-bit element stored under `policy`.
template <typename T>
__device__ __forceinline__ void store(T* p, T v, unsigned long long policy) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  asm volatile("st.global.L2::cache_hint.b16 [%0], %1, %2;\n" ::"l"(p), "h"(*reinterpret_cast<unsigned short*>(&v)),
               "l"(policy)
               : "memory");
}

// One 16-byte chunk (16-byte aligned) stored under `policy`.
__device__ __forceinline__ void store(uint4* p, const uint4& v, unsigned long long policy) {
  asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(policy)
               : "memory");
}

// A store under `policy` where HINT, a plain store elsewhere (the callers' switch).
template <bool HINT, typename V>
__device__ __forceinline__ void store_if(V* p, const V& v, unsigned long long policy) {
  if constexpr (HINT) store(p, v, policy);
  else *p = v;
}

}  // namespace l2
}  // namespace dsg
