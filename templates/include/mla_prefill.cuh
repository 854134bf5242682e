// MLA prefill attention on CUDA cores (fp32; bf16 / fp16 run MlaPrefillTC2, mla_prefill_tc2.cuh),
// flash style, over decompressed keys and values of the packed
// prompts: q = [q_nope | q_rot] (DK = N + R wide), k = [kv_nope | k_rot] (k_rot shared by
// all heads), v = kv's V part.  Sequence b's queries are rows query_start[b] .. query_start[b+1] - 1
// of q, its keys rows key_start[b] .. key_start[b+1] - 1 of kv / k_rot (Lk of them, the last L of
// which are its queries' own tokens: the keys before them are a cached prefix, or none); key j is
// visible to query i iff j <= positions[i] - positions[first query] + (Lk - L).  fp32 online
// softmax (log2 units).
//
// CTA = (BM query tile, head, sequence); 256 threads: thread (i = tid / 8, g = tid % 8)
// owns query row i, scores of keys g, g + 8, ... of each BN-key tile and value columns
// g, g + 8, ... of its output row.
#pragma once
#include "common.cuh"
#include "mma.cuh"

namespace dsg {

template <typename T, int H, int N, int R, int V>
struct MlaPrefill {
  static constexpr int DK = N + R;
  static constexpr int BM = 32, BN = 32, THREADS = 256, G = 8;
  static constexpr int KPB = BN / G;                       // keys per thread per tile
  static constexpr int VPT = (V + G - 1) / G;              // value columns per thread
  static constexpr int QP = DK | 1, KP = DK | 1;           // odd pitches: conflict-free
  static constexpr int PP = BN + 1;
  static constexpr int SMEM = (BM * QP + BN * KP + BN * ((V | 1)) + BM * PP) * 4;
  static_assert(THREADS == BM * G, "one query row per 8 threads");

  __device__ static void run(const T* __restrict__ q_nope, i64 qn_s0, i64 qn_s1, const T* __restrict__ q_rot,
                             i64 qr_s0, i64 qr_s1, const T* __restrict__ kv, i64 kv_s0,
                             const T* __restrict__ k_rot, i64 kr_s0, const i32* __restrict__ query_start,
                             const i32* __restrict__ key_start, const i64* __restrict__ positions,
                             T* __restrict__ out, float scale, char* smem) {
    constexpr int VPITCH = V | 1;
    float* Qs = reinterpret_cast<float*>(smem);
    float* Ks = Qs + BM * QP;
    float* Vs = Ks + BN * KP;
    float* Ps = Vs + BN * VPITCH;
    __shared__ int max_lp;

    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * BM;
    const int qs = query_start[b], L = query_start[b + 1] - qs;
    if (q0 >= L) return;
    const int ks = key_start[b], Lk = key_start[b + 1] - ks;
    const int tid = threadIdx.x, i = tid / G, g = tid % G;
    const i64 pos0 = positions[qs] - (Lk - L);   // the position of key 0

    if (tid == 0) max_lp = -1;
    for (int e = tid; e < BM * DK; e += THREADS) {
      const int r = e / DK, d = e % DK;
      float v = 0.f;
      if (q0 + r < L) {
        const i64 t = qs + q0 + r;
        v = d < N ? to_float(q_nope[t * qn_s0 + (i64)h * qn_s1 + d]) : to_float(q_rot[t * qr_s0 + (i64)h * qr_s1 + d - N]);
      }
      Qs[r * QP + d] = v;
    }
    const bool row_valid = q0 + i < L;
    const int my_lp = row_valid ? (int)(positions[qs + q0 + i] - pos0) : -1;
    __syncthreads();
    if (g == 0 && row_valid) atomicMax(&max_lp, my_lp);
    __syncthreads();
    const int kend = min(Lk, max_lp + 1);

    const float scale_log2 = scale * 1.4426950408889634f;
    float m = -CUDART_INF_F, l = 0.f, acc[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) acc[k] = 0.f;

    for (int k0 = 0; k0 < kend; k0 += BN) {
      __syncthreads();   // previous tile consumed
      for (int e = tid; e < BN * DK; e += THREADS) {
        const int j = e / DK, d = e % DK;
        float v = 0.f;
        if (k0 + j < Lk) {
          const i64 u = ks + k0 + j;
          v = d < N ? to_float(kv[u * kv_s0 + (i64)h * (N + V) + d]) : to_float(k_rot[u * kr_s0 + d - N]);
        }
        Ks[j * KP + d] = v;
      }
      for (int e = tid; e < BN * V; e += THREADS) {
        const int j = e / V, c = e % V;
        Vs[j * VPITCH + c] =
            (k0 + j < Lk) ? to_float(kv[(i64)(ks + k0 + j) * kv_s0 + (i64)h * (N + V) + N + c]) : 0.f;
      }
      __syncthreads();

      float s[KPB];
#pragma unroll
      for (int kk = 0; kk < KPB; ++kk) s[kk] = 0.f;
      const float* qrow = Qs + i * QP;
#pragma unroll 4
      for (int d = 0; d < DK; ++d) {
        const float qv = qrow[d];
#pragma unroll
        for (int kk = 0; kk < KPB; ++kk) s[kk] = fmaf(qv, Ks[(g + G * kk) * KP + d], s[kk]);
      }
      float tmax = -CUDART_INF_F;
#pragma unroll
      for (int kk = 0; kk < KPB; ++kk) {
        const int j = k0 + g + G * kk;
        s[kk] = (j < Lk && j <= my_lp) ? s[kk] * scale_log2 : -CUDART_INF_F;
        tmax = fmaxf(tmax, s[kk]);
      }
#pragma unroll
      for (int o = 1; o < G; o <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
      const float m_new = fmaxf(m, tmax);
      const float alpha = (m_new == -CUDART_INF_F) ? 1.f : exp2f(m - m_new);
      float rsum = 0.f;
#pragma unroll
      for (int kk = 0; kk < KPB; ++kk) {
        const float p = (s[kk] == -CUDART_INF_F) ? 0.f : exp2f(s[kk] - m_new);
        rsum += p;
        Ps[i * PP + g + G * kk] = p;
      }
#pragma unroll
      for (int o = 1; o < G; o <<= 1) rsum += __shfl_xor_sync(0xffffffffu, rsum, o);
      l = l * alpha + rsum;
      m = m_new;
      __syncwarp();   // row i's probabilities come from the 8 lanes of this warp
#pragma unroll
      for (int k = 0; k < VPT; ++k) acc[k] *= alpha;
      const int jn = min(BN, kend - k0);
      for (int j = 0; j < jn; ++j) {
        const float p = Ps[i * PP + j];
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          const int c = g + G * k;
          if (c < V) acc[k] = fmaf(p, Vs[j * VPITCH + c], acc[k]);
        }
      }
      __syncwarp();
    }

    if (row_valid && l > 0.f) {
      const float inv = 1.f / l;
      T* orow = out + (i64)(qs + q0 + i) * (H * V) + (i64)h * V;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = g + G * k;
        if (c < V) orow[c] = from_float<T>(acc[k] * inv);
      }
    }
  }
};


}  // namespace dsg
