// Hopper's bulk asynchronous copies (sm_90): cp.async.bulk moves one contiguous run of global
// memory into shared memory and reports its bytes to an mbarrier (complete_tx, mbarrier.cuh),
// where the consumers wait.  One request per run, where 16-byte cp.async makes one per 16 bytes:
// the swapped expert tiles are L2-throughput-bound (PERF_NOTES v7).  Inline PTX, no CCCL.
#pragma once
#include "common.cuh"
#include "mbarrier.cuh"

namespace dsg {
namespace bulk {

// bytes (a multiple of 16; dst and src 16-byte aligned) from global src to shared dst, counted
// on bar.
__device__ __forceinline__ void copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

}  // namespace bulk
}  // namespace dsg
