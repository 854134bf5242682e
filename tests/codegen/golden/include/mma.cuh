// Tensor-core helpers for sm_80+ (plain sm_90 too): cp.async into shared memory, ldmatrix,
// mma.sync m16n8k16 with fp32 accumulators on bf16 / fp16 operands.  Inline PTX, no CCCL.
#pragma once
#include "common.cuh"

namespace dsg {
namespace mma {

template <typename T> struct MmaType;
template <> struct MmaType<__nv_bfloat16> { static constexpr bool BF16 = true; };
template <> struct MmaType<__half> { static constexpr bool BF16 = false; };

// .L2::128B: the copies of a stage cover whole 128-byte runs of each row, and the hint lets L2
// fetch a run as one line (H200: the grouped expert tiles are L2-throughput-bound,
// ~89% of L2 at 75% of DRAM; the hint gained 1-2% in every case measured, 256B lost).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
// d += a (16x16, row) * b (16x8, col), fp32 accumulators
template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A ST-deep cp.async ring over KT K slices: load(stage, kt) issues slice kt's copies into ring
// slot `stage`, compute(stage) consumes a landed slot.  ST - 1 slices stay in flight; the barrier
// before each refill keeps a slot from being overwritten while a warp still reads it.
template <int ST, typename Load, typename Compute>
__device__ __forceinline__ void cp_async_ring(int KT, Load&& load, Compute&& compute) {
  static_assert(ST >= 2, "cp_async_ring: at least two stages");
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < KT) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<ST - 2>();
    __syncthreads();
    if (kt + ST - 1 < KT) load((kt + ST - 1) % ST, kt + ST - 1);
    cp_async_commit();
    compute(kt % ST);
  }
  cp_async_wait<0>();
}

// two floats -> one register of two 16-bit values (lo = first)
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}

// 8 elements of a row into shared memory (dst 16-byte aligned): one 16-byte cp.async when src is
// 16-byte aligned (ALIGNED; the caller guarantees it) and the chunk is whole or empty, else
// element loads with zero fill, staged in a uint4 (a T[8] cast to one could be under-aligned).
template <typename T, bool ALIGNED>
__device__ __forceinline__ void load8(T* dst, const T* src, int valid) {
  static_assert(sizeof(T) == 2, "load8: 8 elements of a 16-bit type make one 16-byte chunk");
  if constexpr (ALIGNED) {
    cp_async16(dst, src, valid > 0 ? 16 : 0);   // 0 bytes: zero fill, src not read
  } else {
    uint4 raw;
    T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = (i < valid) ? src[i] : from_float<T>(0.f);
    *reinterpret_cast<uint4*>(dst) = raw;
  }
}

}  // namespace mma
}  // namespace dsg
