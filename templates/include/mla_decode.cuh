// Split-KV paged MLA decode over compressed cache rows [c_n (C) | k_rot (R)].
//
// CTA (token t, head group g, split s) attends HG heads of token t over a contiguous
// slice of the token's visible rows (j <= positions[t], j < context_len): each KT-row
// tile is read once from the paged cache (16-byte loads) into shared memory and used by
// all HG heads (scores over the W = C + R row, values over its first C columns). The
// partial max / sum / unnormalised accumulators go to a workspace; mla_decode_combine
// merges the splits. Scores are kept in log2 units (exp2f) with the scale folded in.
#pragma once
#include "vec.cuh"

namespace dsg {

template <typename T> __device__ __forceinline__ float2 pair_to_float2(const T* p);
template <> __device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <> __device__ __forceinline__ float2 pair_to_float2<__half>(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}
template <> __device__ __forceinline__ float2 pair_to_float2<float>(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

// The sequence b that owns token t: the last b with query_start[b] <= t.
__device__ __forceinline__ int sequence_of(const i32* __restrict__ query_start, int B, int t) {
  int lo = 0, hi = B - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T, int C, int R, int H, int HG, int BS, int KT, int THREADS>
struct MlaDecode {
  static constexpr int W = C + R;                       // cache row width
  static constexpr int NWARPS = THREADS / 32;
  static constexpr int HPW = (HG + NWARPS - 1) / NWARPS;  // heads per warp (scores)
  static constexpr int CPT = (C + THREADS - 1) / THREADS; // value columns per thread
  static constexpr int WP = (W + 1) / 2;                 // element pairs per row
  static constexpr int KPH = (WP % 2 == 1) ? WP : WP + 1; // row pitch in pairs: odd, conflict-free
  static constexpr int KP = 2 * KPH;                     // row pitch in elements (shared)
  static constexpr int QP = 2 * WP;                      // query pitch (floats, zero padded)
  static constexpr int PP = (HG + 3) / 4 * 4;            // probabilities pitch (float4 reads)
  static constexpr bool VEC_ROWS = (W * (int)sizeof(T)) % 16 == 0;
  static constexpr int VPR = VEC_ROWS ? W * (int)sizeof(T) / 16 : 0;  // 16-byte vectors per row
  // shared memory carve-up (bytes), 16-byte aligned pieces
  static constexpr int Q_BYTES = HG * QP * 4;
  static constexpr int K_BYTES = (KT * KP * (int)sizeof(T) + 15) / 16 * 16;
  static constexpr int P_BYTES = KT * PP * 4;
  static constexpr int A_BYTES = PP * 4;
  static constexpr int S_BYTES = KT * 8;
  static constexpr int SMEM = Q_BYTES + K_BYTES + P_BYTES + A_BYTES + S_BYTES;
  static_assert(KT == 32, "one lane per tile row in the score phase");
  static_assert(THREADS % 32 == 0, "whole warps");

  __device__ static void split(const T* __restrict__ q_lat, i64 ql_s0, i64 ql_s1,
                               const T* __restrict__ q_rot, i64 qr_s0, i64 qr_s1,
                               const T* __restrict__ cache, const i32* __restrict__ block_tables, int bt_width,
                               const i32* __restrict__ context_lens, const i32* __restrict__ query_start,
                               const i64* __restrict__ positions, float* __restrict__ ws_acc,
                               float* __restrict__ ws_ml, float scale, int T_, int B, int S, char* smem) {
    float* qs = reinterpret_cast<float*>(smem);
    T* ks = reinterpret_cast<T*>(smem + Q_BYTES);
    float* ps = reinterpret_cast<float*>(smem + Q_BYTES + K_BYTES);
    float* alpha_s = reinterpret_cast<float*>(smem + Q_BYTES + K_BYTES + P_BYTES);
    i64* slot_s = reinterpret_cast<i64*>(smem + Q_BYTES + K_BYTES + P_BYTES + A_BYTES);

    const int t = blockIdx.x, g = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (t >= T_) return;
    const int b = sequence_of(query_start, B, t);
    const i64 pos = positions[t];
    const int ctx_len = context_lens[b];
    const int n = (int)min((i64)ctx_len, pos + 1);          // visible rows
    const int per = (((n + S - 1) / S) + KT - 1) / KT * KT;  // rows per split, whole tiles
    const int r_begin = s * per;
    const int r_end = min(n, r_begin + per);
    const int h0 = g * HG;

    // Queries of the group, as float, zero past W and for heads past H.
    for (int i = tid; i < HG * QP; i += THREADS) {
      const int hh = i / QP, d = i % QP, h = h0 + hh;
      float v = 0.f;
      if (h < H && d < W)
        v = d < C ? to_float(q_lat[(i64)t * ql_s0 + (i64)h * ql_s1 + d])
                  : to_float(q_rot[(i64)t * qr_s0 + (i64)h * qr_s1 + (d - C)]);
      qs[i] = v;
    }
    // Pad elements of the K tile are read (times a zero query) by the score loop: zero them.
    for (int i = tid; i < KT * KP; i += THREADS) ks[i] = from_float<T>(0.f);

    const float scale_log2 = scale * 1.4426950408889634f;
    float m[HPW], l[HPW];
#pragma unroll
    for (int k = 0; k < HPW; ++k) { m[k] = -CUDART_INF_F; l[k] = 0.f; }
    float acc[CPT][HG];
#pragma unroll
    for (int k = 0; k < CPT; ++k)
#pragma unroll
      for (int h = 0; h < HG; ++h) acc[k][h] = 0.f;

    const i32* table = block_tables + (i64)b * bt_width;
    for (int r0 = r_begin; r0 < r_end; r0 += KT) {
      const int rows = min(KT, r_end - r0);
      __syncthreads();  // previous tile fully consumed (and qs / ks zeroing done)
      if (tid < rows) {
        const int r = r0 + tid;
        slot_s[tid] = (i64)table[r / BS] * BS + (r % BS);
      }
      __syncthreads();
      if constexpr (VEC_ROWS) {
        for (int i = tid; i < rows * VPR; i += THREADS) {
          const int j = i / VPR, v = i % VPR;
          const uint4 raw = *reinterpret_cast<const uint4*>(cache + slot_s[j] * W + v * (16 / (int)sizeof(T)));
          unsigned int* dst = reinterpret_cast<unsigned int*>(ks + j * KP + v * (16 / (int)sizeof(T)));
          dst[0] = raw.x; dst[1] = raw.y; dst[2] = raw.z; dst[3] = raw.w;
        }
      } else {
        for (int i = tid; i < rows * W; i += THREADS) {   // rows not 16-byte multiples
          const int j = i / W, d = i % W;
          ks[j * KP + d] = cache[slot_s[j] * W + d];
        }
      }
      __syncthreads();

      // Scores: lane = tile row, warp = heads warp, warp + NWARPS, ...
#pragma unroll
      for (int k = 0; k < HPW; ++k) {
        const int hh = warp + k * NWARPS;
        if (hh < HG) {   // warp-uniform
          float dot = 0.f;
          if (lane < rows) {
            const T* krow = ks + lane * KP;
            const float* qrow = qs + hh * QP;
#pragma unroll 8
            for (int p = 0; p < WP; ++p) {
              const float2 kv = pair_to_float2<T>(krow + 2 * p);
              const float2 qv = *reinterpret_cast<const float2*>(qrow + 2 * p);
              dot = fmaf(qv.x, kv.x, dot);
              dot = fmaf(qv.y, kv.y, dot);
            }
          }
          const float sc = lane < rows ? dot * scale_log2 : -CUDART_INF_F;
          const float m_new = fmaxf(m[k], warp_max(sc));
          const float pj = lane < rows ? exp2f(sc - m_new) : 0.f;
          const float alpha = exp2f(m[k] - m_new);
          l[k] = l[k] * alpha + warp_sum(pj);
          m[k] = m_new;
          ps[lane * PP + hh] = pj;
          if (lane == 0) alpha_s[hh] = alpha;
        }
      }
      __syncthreads();

      // Values: thread owns columns tid, tid + THREADS, ... for all HG heads.
      float al[HG];
#pragma unroll
      for (int h = 0; h < HG; ++h) al[h] = alpha_s[h];
#pragma unroll
      for (int k = 0; k < CPT; ++k)
#pragma unroll
        for (int h = 0; h < HG; ++h) acc[k][h] *= al[h];
      for (int j = 0; j < rows; ++j) {
        float pr[PP];
#pragma unroll
        for (int h4 = 0; h4 < PP / 4; ++h4) {
          const float4 v = *reinterpret_cast<const float4*>(ps + j * PP + 4 * h4);
          pr[4 * h4] = v.x; pr[4 * h4 + 1] = v.y; pr[4 * h4 + 2] = v.z; pr[4 * h4 + 3] = v.w;
        }
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
          const int c = tid + k * THREADS;
          const float kv = (c < C) ? to_float(ks[j * KP + c]) : 0.f;
#pragma unroll
          for (int h = 0; h < HG; ++h) acc[k][h] = fmaf(pr[h], kv, acc[k][h]);
        }
      }
    }

    // Partials: [T, H, S, C] accumulators and [T, H, S, 2] (max, sum) in log2 units.
#pragma unroll
    for (int k = 0; k < HPW; ++k) {
      const int hh = warp + k * NWARPS, h = h0 + hh;
      if (hh < HG && h < H && lane == 0) {
        float* ml = ws_ml + (((i64)t * H + h) * S + s) * 2;
        ml[0] = m[k];
        ml[1] = l[k];
      }
    }
#pragma unroll
    for (int h = 0; h < HG; ++h) {
      if (h0 + h >= H) break;
      float* o = ws_acc + (((i64)t * H + h0 + h) * S + s) * C;
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const int c = tid + k * THREADS;
        if (c < C) o[c] = acc[k][h];
      }
    }
  }

  // CTA (t, h): o_lat[t, h, :] = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M).
  __device__ static void combine(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                                 T* __restrict__ out, int T_, int S) {
    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= T_) return;
    const float* ml = ws_ml + ((i64)t * H + h) * S * 2;
    float M = -CUDART_INF_F;
    for (int s = 0; s < S; ++s) M = fmaxf(M, ml[2 * s]);
    float L = 0.f;
    for (int s = 0; s < S; ++s)
      if (ml[2 * s] != -CUDART_INF_F) L += ml[2 * s + 1] * exp2f(ml[2 * s] - M);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const float* acc = ws_acc + ((i64)t * H + h) * S * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float o = 0.f;
      for (int s = 0; s < S; ++s)
        if (ml[2 * s] != -CUDART_INF_F) o = fmaf(acc[(i64)s * C + c], exp2f(ml[2 * s] - M), o);
      out[((i64)t * H + h) * C + c] = from_float<T>(o * inv);
    }
  }
};

}  // namespace dsg
