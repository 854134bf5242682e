// Hopper's tensor memory accelerator (TMA, sm_90): cp.async.bulk.tensor moves a whole box of a
// tensor described by a tensor map (made on the host by cuTensorMapEncodeTiled: base, dims,
// strides, box, swizzle) into shared memory in one request, filling what lies outside the tensor
// with zeros, and reports the box's bytes to an mbarrier (mbarrier.cuh).
//
// The map reaches the kernel as a by-value `const __grid_constant__ dsg::TensorMap` parameter
// (codegen/kernel.py TensorMapRef; the runtime encodes one per weight and caches it): its
// address is then a generic address in parameter space, which the copy instructions accept.
#pragma once
#include "common.cuh"
#include "l2_policy.cuh"
#include "mbarrier.cuh"

namespace dsg {

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned (TMA's requirement).
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};
static_assert(sizeof(TensorMap) == 128, "a tensor map is 128 bytes");

namespace tma {

// Fetch the descriptor into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void prefetch(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// The box of a 2-D map at element coordinates (c0 innermost, c1) into shared dst, its bytes
// counted on bar.
__device__ __forceinline__ void load_2d(void* dst, const TensorMap* map, int c0, int c1, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// The box of a 3-D map at element coordinates (c0 innermost, c1, c2) into shared dst (aligned as
// the map's swizzle needs: 1024 bytes for 128B), its bytes counted on bar.
__device__ __forceinline__ void load_3d(void* dst, const TensorMap* map, int c0, int c1, int c2,
                                        unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(bar)),
        "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// load_3d into the same shared offset of every CTA of the cluster whose bit is set in `mask` (bit r:
// rank r), its bytes counted on the barrier at bar's offset in each of them.
__device__ __forceinline__ void load_3d_multicast(void* dst, const TensorMap* map, int c0, int c1, int c2,
                                                  unsigned long long* bar, unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5, %6}], [%2], %3;\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(bar)), "h"(mask),
        "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// load_3d with an L2 policy (l2_policy.cuh) on the box's lines.
__device__ __forceinline__ void load_3d(void* dst, const TensorMap* map, int c0, int c1, int c2,
                                        unsigned long long* bar, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(bar)),
        "r"(c0), "r"(c1), "r"(c2), "l"(policy)
      : "memory");
}

}  // namespace tma
}  // namespace dsg
