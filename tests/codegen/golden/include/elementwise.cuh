// Row-wise elementwise kernels over [T, N] views: CTA (t, chunk) handles THREADS * VEC
// consecutive elements of row t; inputs may be strided views, the output is contiguous.
#pragma once
#include "vec.cuh"

namespace dsg {

// Elements per access along a row of N: 16 bytes' worth when N allows it, else 1 (odd N).
// The lowering sizes the grid with the same number (families/_dense_util.py vec16).
template <typename T, int N>
__host__ __device__ constexpr int row_vec() { return (N % Vec16<T>::N == 0) ? Vec16<T>::N : 1; }

// out[t, :] = f(a[t, :], b[t, :]) with f applied in float; rows of a and b are a_stride /
// b_stride elements apart. Vector path when N and every pointer allow 16-byte access.
template <typename T, int N, int THREADS, typename F>
__device__ __forceinline__ void binary_rows(const T* __restrict__ a, i64 a_stride, const T* __restrict__ b,
                                            i64 b_stride, T* __restrict__ out, int rows, F f) {
  constexpr int VEC = row_vec<T, N>();
  const int t = blockIdx.x;
  if (t >= rows) return;
  const T* ar = a + (i64)t * a_stride;
  const T* br = b + (i64)t * b_stride;
  T* orow = out + (i64)t * N;
  const int i0 = ((int)blockIdx.y * THREADS + (int)threadIdx.x) * VEC;
  if (i0 >= N) return;
  // N % VEC == 0: a chunk is whole.  Views start anywhere: the 16-byte path only for aligned rows
  // (one test per thread, the same for the whole CTA: it owns one row).
  if (VEC > 1 && aligned16(ar) && aligned16(br) && aligned16(orow)) {
    float x[VEC], y[VEC];
    load16(ar + i0, x);
    load16(br + i0, y);
#pragma unroll
    for (int j = 0; j < VEC; ++j) x[j] = f(x[j], y[j]);
    store16(orow + i0, x);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (i0 + j < N) orow[i0 + j] = from_float<T>(f(to_float(ar[i0 + j]), to_float(br[i0 + j])));
  }
}

}  // namespace dsg
