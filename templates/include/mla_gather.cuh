// Gather each sequence's paged cache rows into one packed buffer: sequence b's rows
// 0 .. context_lens[b] - 1 (block_tables maps row j to block block_tables[b][j / BS], offset j % BS)
// land at rows key_start[b] .. key_start[b + 1] - 1 of out.  The prefill attention then attends to
// a sequence's whole context (the prefix earlier steps cached and this step's rows) after one kv_b
// GEMM over the gathered latents.
//
// CTA = (ROWS rows of one sequence); a warp copies a row, in 16-byte chunks where W and both bases
// allow (cache rows are W apart, out rows too), else element by element.
#pragma once
#include "common.cuh"

namespace dsg {

template <typename T, int W, int BS, int ROWS>
struct MlaGather {
  static constexpr int THREADS = ROWS * 32;
  static constexpr int EV = 16 / (int)sizeof(T);           // elements a 16-byte chunk
  static constexpr bool VEC_OK = W % EV == 0;

  __device__ static void run(const T* __restrict__ cache, const i32* __restrict__ block_tables, int bt_width,
                             const i32* __restrict__ context_lens, const i32* __restrict__ key_start,
                             T* __restrict__ out) {
    const int b = blockIdx.y, j = blockIdx.x * ROWS + threadIdx.x / 32, lane = threadIdx.x & 31;
    const int n = context_lens[b];
    if (j >= n) return;
    const i64 block = block_tables[(i64)b * bt_width + j / BS];
    const T* src = cache + (block * BS + j % BS) * W;
    T* dst = out + ((i64)key_start[b] + j) * W;
    if constexpr (VEC_OK) {
      if (((reinterpret_cast<unsigned long long>(cache) | reinterpret_cast<unsigned long long>(out)) & 15) == 0) {
        for (int c = lane; c < W / EV; c += 32)
          reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(src)[c];
        return;
      }
    }
    for (int c = lane; c < W; c += 32) dst[c] = src[c];
  }
};

}  // namespace dsg
