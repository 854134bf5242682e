// Hopper's warpgroup MMA (wgmma, sm_90a only): a warpgroup of 4 warps (128 threads) multiplies a
// 64 x 16 A tile by a 16 x N B tile, both read from shared memory through matrix descriptors, into
// fp32 accumulators spread over its registers, asynchronously: issue, commit a group, later wait.
// The operands are K-major tiles of 64 16-bit elements a row (128 bytes) in the 128-byte swizzle
// TMA writes (and moe_wgmma.cuh's gathering copies reproduce): 8-row atoms of 1024 bytes, the
// 16-byte chunk c of row r stored at chunk c ^ (r % 8).
//
// sm_90a-only PTX (wgmma, setmaxnreg): only kernels compiled for --gpu-architecture=sm_90a may
// include this header (their launch `requires` sm_90a: codegen/arch.py builds them for it).
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma.cuh needs the sm_90a target (wgmma, setmaxnreg): compile with --gpu-architecture=sm_90a"
#endif

namespace dsg {
namespace wgmma {

// ---- shared-memory matrix descriptors -----------------------------------------------------
// bits 0-13 start address / 16, 16-29 leading byte offset / 16 (unused by K-major swizzled tiles:
// 1), 32-45 stride byte offset / 16 (1024: from one 8-row atom to the next), 62-63 swizzle
// (1 = 128B).  The tile starts on a 1024-byte boundary, so the base-offset bits stay 0.
__device__ __forceinline__ unsigned long long desc_sw128(unsigned smem_addr) {
  return (unsigned long long)((smem_addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}
// The descriptor of the same tile k16 steps further along K: 32 bytes a step inside the 128-byte
// swizzled rows (the hardware applies the XOR to the address it forms).
__device__ __forceinline__ unsigned long long desc_advance(unsigned long long desc, int k16) {
  return desc + (unsigned long long)((k16 * 32) >> 4);
}

// ---- ordering -------------------------------------------------------------------------------
// Before the first wgmma of a batch, and between any register access of the accumulators and a
// wgmma that uses them.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accumulator reads or writes across the asynchronous region
// (the wgmma asm statements name the registers, the wait does not).
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 128 threads of one warpgroup meet at hardware barrier `id` (1 .. 15: 0 is __syncthreads').
__device__ __forceinline__ void warpgroup_sync(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}

// ---- register budget of a warpgroup (warp-specialised kernels) ------------------------------
// The producer gives registers back, the consumers take them, so the accumulators fit.
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// ---- d (64 x 256 fp32) += a (64 x 16) * b (16 x 256), both K-major in shared memory ------------
// Thread t of the warpgroup (warp w = t / 32, lane l) holds d[4j + 2h + c] = element
// (row 16w + l / 4 + 8h, column 8j + 2 (l % 4) + c), j < 32.
#define DSG_WGMMA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define DSG_WGMMA_D128 DSG_WGMMA_D8(0), DSG_WGMMA_D8(8), DSG_WGMMA_D8(16), DSG_WGMMA_D8(24), DSG_WGMMA_D8(32), DSG_WGMMA_D8(40), DSG_WGMMA_D8(48), DSG_WGMMA_D8(56), DSG_WGMMA_D8(64), DSG_WGMMA_D8(72), DSG_WGMMA_D8(80), DSG_WGMMA_D8(88), DSG_WGMMA_D8(96), DSG_WGMMA_D8(104), DSG_WGMMA_D8(112), DSG_WGMMA_D8(120)

// The 128 accumulator registers %0 .. %127 of the asm below, then the two descriptors %128, %129
// and the scale-d predicate's source %130.
#define DSG_WGMMA_ACC128                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"                                \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"                       \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"                       \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"                       \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"                       \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"                       \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"           \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define DSG_WGMMA_M64N256K16(types)                                                                       \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                           \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32." types "\n" DSG_WGMMA_ACC128 ", %128, %129, p, 1, 1, 0, 0;\n}\n"

template <bool BF16>
__device__ __forceinline__ void mma_m64n256k16(float (&d)[128], unsigned long long a_desc, unsigned long long b_desc) {
  if constexpr (BF16)
    asm volatile(DSG_WGMMA_M64N256K16("bf16.bf16") : DSG_WGMMA_D128 : "l"(a_desc), "l"(b_desc), "r"(1));
  else
    asm volatile(DSG_WGMMA_M64N256K16("f16.f16") : DSG_WGMMA_D128 : "l"(a_desc), "l"(b_desc), "r"(1));
}

// ---- d (64 x N fp32) += a (64 x 16) * b (16 x N), N = 16 / 32 / 64: the swapped decode tiles ----
// (moe_wgmma_skinny.cuh: weight rows as M, an expert's few pairs as N.)  Same register layout:
// d[4j + 2h + c] = element (row 16w + l / 4 + 8h, column 8j + 2 (l % 4) + c), j < N / 8.
#define DSG_WGMMA_ACC8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define DSG_WGMMA_ACC16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define DSG_WGMMA_ACC32                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"                                \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
// the descriptors and the scale-d predicate's source follow the R accumulators: %R, %R+1, %R+2
#define DSG_WGMMA_M64NK16(shape, types, acc, da, db, sd)                                                  \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " sd ", 0;\n"                                                      \
  "wgmma.mma_async.sync.aligned." shape ".f32." types "\n" acc ", " da ", " db ", p, 1, 1, 0, 0;\n}\n"

template <bool BF16, int N>
__device__ __forceinline__ void mma_m64nk16(float (&d)[N / 2], unsigned long long a_desc, unsigned long long b_desc) {
  static_assert(N == 16 || N == 32 || N == 64, "wgmma m64nNk16: N is 16, 32 or 64 here");
  if constexpr (N == 16) {
    if constexpr (BF16)
      asm volatile(DSG_WGMMA_M64NK16("m64n16k16", "bf16.bf16", DSG_WGMMA_ACC8, "%8", "%9", "%10")
                   : DSG_WGMMA_D8(0) : "l"(a_desc), "l"(b_desc), "r"(1));
    else
      asm volatile(DSG_WGMMA_M64NK16("m64n16k16", "f16.f16", DSG_WGMMA_ACC8, "%8", "%9", "%10")
                   : DSG_WGMMA_D8(0) : "l"(a_desc), "l"(b_desc), "r"(1));
  } else if constexpr (N == 32) {
    if constexpr (BF16)
      asm volatile(DSG_WGMMA_M64NK16("m64n32k16", "bf16.bf16", DSG_WGMMA_ACC16, "%16", "%17", "%18")
                   : DSG_WGMMA_D8(0), DSG_WGMMA_D8(8) : "l"(a_desc), "l"(b_desc), "r"(1));
    else
      asm volatile(DSG_WGMMA_M64NK16("m64n32k16", "f16.f16", DSG_WGMMA_ACC16, "%16", "%17", "%18")
                   : DSG_WGMMA_D8(0), DSG_WGMMA_D8(8) : "l"(a_desc), "l"(b_desc), "r"(1));
  } else {
    if constexpr (BF16)
      asm volatile(DSG_WGMMA_M64NK16("m64n64k16", "bf16.bf16", DSG_WGMMA_ACC32, "%32", "%33", "%34")
                   : DSG_WGMMA_D8(0), DSG_WGMMA_D8(8), DSG_WGMMA_D8(16), DSG_WGMMA_D8(24)
                   : "l"(a_desc), "l"(b_desc), "r"(1));
    else
      asm volatile(DSG_WGMMA_M64NK16("m64n64k16", "f16.f16", DSG_WGMMA_ACC32, "%32", "%33", "%34")
                   : DSG_WGMMA_D8(0), DSG_WGMMA_D8(8), DSG_WGMMA_D8(16), DSG_WGMMA_D8(24)
                   : "l"(a_desc), "l"(b_desc), "r"(1));
  }
}

#undef DSG_WGMMA_M64NK16
#undef DSG_WGMMA_ACC32
#undef DSG_WGMMA_ACC16
#undef DSG_WGMMA_ACC8
#undef DSG_WGMMA_M64N256K16
#undef DSG_WGMMA_ACC128
#undef DSG_WGMMA_D128
#undef DSG_WGMMA_D8

}  // namespace wgmma
}  // namespace dsg
