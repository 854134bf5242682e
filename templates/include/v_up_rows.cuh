// o_proj's e4m3 rows from mla_v_up's own output (Tuning.linear.v_up_fp8, ir/passes/fuse_v_up_fp8_quant.py):
// o [T, H * V] with V = 128, so a token's 128-column group g is exactly head g's V columns.  The qf8 variant's
// CTA holds a whole head (grid z = 1), so after AbsorbVUp has stored its tokens' rows of o it reads its head's
// 128 columns of each of those tokens back (its own stores, visible after the barrier; o rounded to the
// activation type, as o_proj's quantiser launch reads it) and quantises them with norm_quant.cuh's
// norm_rows_fp8 (quant_fp8.cuh's e4m3x2, AMAX_FLOOR and true division): the same bytes and scales as the
// quantiser launch (gemm_fp8's quant_x) on the stored o, bit for bit, with no other CTA involved.
#pragma once
#include "norm_quant.cuh"
#include "vec.cuh"

namespace dsg {
namespace absorb {

// norm_rows_fp8's layout of one token's group: 16 threads (half a warp) of 8 columns (16 bytes) each; the
// column index is o's, so the group is head blockIdx.y's.
template <int V, int THREADS>
struct HeadGroup {
  static constexpr int NTHREADS = THREADS, VEC = 8, CHUNKS = 1, ITEMS = 8;
  __device__ static __forceinline__ int index(int, int j) {
    return (int)blockIdx.y * V + (int)(threadIdx.x & 15) * 8 + j;
  }
};

// The CTA's tokens (grid x chunks of TN, as AbsorbVUp::run walks them): o's rows -> q [T, H * V] e4m3 and
// s [T, H] float32.  Half a warp a token; a warp whose first half has a token runs whole (the shuffles), its
// second half past the tile repeating the first half's token (the same bytes to the same place).
template <typename T, int H, int V, int TN, int THREADS>
__device__ __forceinline__ void v_up_rows_fp8(const T* o, unsigned char* __restrict__ q, float* __restrict__ s,
                                              int T_) {
  static_assert(V == fp8q::GROUP && THREADS % 32 == 0, "a head's V columns are one 128-column group");
  typedef HeadGroup<V, THREADS> L;
  constexpr int PER = THREADS / 16;                    // tokens a pass
  const int half = (int)threadIdx.x >> 4;
  const bool vec = aligned16(o);
  __syncthreads();                                     // the CTA's stores of o are visible to all its threads
  for (int t0 = blockIdx.x * TN; t0 < T_; t0 += gridDim.x * TN) {
    const int ntok = min(TN, T_ - t0);
    for (int b = 0; b < ntok; b += PER) {
      if ((half & ~1) >= ntok - b) break;               // warp-uniform
      const int t = t0 + b + min(half, ntok - b - 1);
      const T* row = o + (i64)t * (H * V);
      const int i0 = L::index(0, 0);
      float v[8];
      if (vec) load16(row + i0, v);
      else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = to_float(row[i0 + j]);
      }
      quant::norm_rows_fp8<H * V, H, L>(v, q, s, t);
    }
  }
}

}  // namespace absorb
}  // namespace dsg
