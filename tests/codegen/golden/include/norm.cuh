// RMSNorm over one row held in registers, mirroring transformers' DeepseekV2RMSNorm:
// normalise in fp32, round to the activation type, multiply by the weight, round again.
#pragma once
#include "vec.cuh"

namespace dsg {

// v[ITEMS] (a row of N in Layout's distribution) -> out row; wv[ITEMS]: the weight [N], already
// loaded in the same layout (a weight: kernels load it before pdl_wait(), so its memory round trip
// overlaps the previous kernel instead of following this one's reduction). Block-wide: every thread
// of the block must call it. `scratch` holds >= 32 floats of shared memory.
template <typename T, int N, typename Layout>
__device__ __forceinline__ void rms_norm_row_loaded(float* v, const float* wv, float eps, float* scratch) {
  // block_sum: full-mask warp shuffles and one scratch slot per warp.
  static_assert(Layout::NTHREADS % 32 == 0 && Layout::NTHREADS <= 1024, "rms_norm: whole warps, at most 1024 threads");
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < Layout::ITEMS; ++i) ss += v[i] * v[i];
  ss = block_sum(ss, scratch);
  const float r = rsqrtf(ss / (float)N + eps);
#pragma unroll
  for (int i = 0; i < Layout::ITEMS; ++i) v[i] = round_to<T>(wv[i] * round_to<T>(v[i] * r));
}

// As rms_norm_row_loaded, the weight w [N] read here (its load in flight during the reduction).
template <typename T, int N, typename Layout>
__device__ __forceinline__ void rms_norm_row(float* v, const T* __restrict__ w, float eps, float* scratch) {
  float wv[Layout::ITEMS];
  Layout::load(w, wv);
  rms_norm_row_loaded<T, N, Layout>(v, wv, eps, scratch);
}

}  // namespace dsg
