// Thread-block clusters (sm_90): a CTA's rank in its cluster, the cluster barrier, and loads from a
// peer CTA's shared memory (distributed shared memory).  The kernels that merge partial results
// across the CTAs of a cluster use these: the split-KV decode attention (mla_decode.cuh) and the
// skinny linears split over K (skinny.cuh).  Inline PTX, no CCCL; no-ops below sm_90, where those
// kernels are built with clusters of one.
#pragma once
#include "common.cuh"

namespace dsg {
namespace cluster {

__device__ __forceinline__ unsigned rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
// Every thread of every CTA of the cluster.  Release / acquire: this CTA's shared-memory writes
// before the barrier are visible to every peer that reads them after it.
__device__ __forceinline__ void sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// A last barrier that only says "I am done reading my peers" (those loads completed: their values
// were used before it) needs to release nothing; it keeps every CTA's shared memory alive until no
// peer reads it any more.
__device__ __forceinline__ void sync_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}
// The shared::cluster address of `cta_addr` (a shared::cta address, smem_u32) in the CTA of rank `r`.
__device__ __forceinline__ unsigned map_rank(unsigned cta_addr, unsigned r) {
  unsigned out = cta_addr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(cta_addr), "r"(r));
#endif
  return out;
}
// A float (ld) / float4 (ld4) at shared address `a`: a shared::cluster address (map_rank) when
// CLUSTER, this CTA's own shared::cta address otherwise.
template <bool CLUSTER> __device__ __forceinline__ float ld(unsigned a) {
  float v;
  if constexpr (CLUSTER) asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
  else asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
  return v;
}
template <bool CLUSTER> __device__ __forceinline__ float4 ld4(unsigned a) {
  float4 v;
  if constexpr (CLUSTER)
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(a) : "memory");
  else
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(a) : "memory");
  return v;
}

}  // namespace cluster
}  // namespace dsg
