// 16-byte vector loads and stores of activation rows, converted to / from float.
// A row takes the vector path only where both its pointer and its length allow it;
// callers check alignment at run time (views may start anywhere) and fall back to scalars.
#pragma once
#include "common.cuh"

namespace dsg {

template <typename T> struct Vec16 { static constexpr int N = 16 / (int)sizeof(T); };

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Load 16 bytes (8 bf16/fp16 or 4 fp32) from p (16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void load16(const T* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::N; ++i) out[i] = to_float(e[i]);
}

// Store Vec16<T>::N floats to p (16-byte aligned), converted to T.
template <typename T>
__device__ __forceinline__ void store16(T* p, const float* in) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::N; ++i) e[i] = from_float<T>(in[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// A row of N elements spread over THREADS threads in chunks of VEC consecutive elements:
// thread tid owns elements (k * THREADS + tid) * VEC + j, k < CHUNKS, j < VEC.
// VEC is 16 bytes' worth when N allows it, else 1 (odd test dims).
// Safe for any N and any row pointer: the 16-byte path needs N % VEC == 0 (so a chunk is whole
// or past the end) and an aligned row, tested once per call (uniform when one CTA owns the row).
template <typename T, int N, int THREADS>
struct RowLayout {
  static constexpr int NTHREADS = THREADS;
  static constexpr int VEC = (N % Vec16<T>::N == 0) ? Vec16<T>::N : 1;
  static constexpr int CHUNKS = (N + THREADS * VEC - 1) / (THREADS * VEC);
  static constexpr int ITEMS = CHUNKS * VEC;

  __device__ static __forceinline__ int index(int k, int j) { return (k * THREADS + (int)threadIdx.x) * VEC + j; }

  // v[ITEMS] <- row (zeros past N).
  __device__ static __forceinline__ void load(const T* row, float* v) {
    const bool vec = VEC > 1 && aligned16(row);
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int i0 = index(k, 0);
      if (vec) {
        if (i0 < N) load16(row + i0, v + k * VEC);
        else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) v[k * VEC + j] = 0.f;
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k * VEC + j] = (i0 + j < N) ? to_float(row[i0 + j]) : 0.f;
      }
    }
  }

  // row <- v[ITEMS] (elements past N are not written).
  __device__ static __forceinline__ void store(T* row, const float* v) {
    const bool vec = VEC > 1 && aligned16(row);
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int i0 = index(k, 0);
      if (vec) {
        if (i0 < N) store16(row + i0, v + k * VEC);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          if (i0 + j < N) row[i0 + j] = from_float<T>(v[k * VEC + j]);
      }
    }
  }
};

}  // namespace dsg
