// MLA prefill attention, flash style, over decompressed keys and values of the packed
// prompts: q = [q_nope | q_rot] (DK = N + R wide), k = [kv_nope | k_rot] (k_rot shared by
// all heads), v = kv's V part; causal within each prompt (key j visible to query i iff
// j <= positions[i] - positions[first token]). fp32 online softmax (log2 units).
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
                             const i64* __restrict__ positions, T* __restrict__ out, float scale, char* smem) {
    constexpr int VPITCH = V | 1;
    float* Qs = reinterpret_cast<float*>(smem);
    float* Ks = Qs + BM * QP;
    float* Vs = Ks + BN * KP;
    float* Ps = Vs + BN * VPITCH;
    __shared__ int max_lp;

    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * BM;
    const int qs = query_start[b], L = query_start[b + 1] - qs;
    if (q0 >= L) return;
    const int tid = threadIdx.x, i = tid / G, g = tid % G;
    const i64 pos0 = positions[qs];

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
    const int kend = min(L, max_lp + 1);

    const float scale_log2 = scale * 1.4426950408889634f;
    float m = -CUDART_INF_F, l = 0.f, acc[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) acc[k] = 0.f;

    for (int k0 = 0; k0 < kend; k0 += BN) {
      __syncthreads();   // previous tile consumed
      for (int e = tid; e < BN * DK; e += THREADS) {
        const int j = e / DK, d = e % DK;
        float v = 0.f;
        if (k0 + j < L) {
          const i64 u = qs + k0 + j;
          v = d < N ? to_float(kv[u * kv_s0 + (i64)h * (N + V) + d]) : to_float(k_rot[u * kr_s0 + d - N]);
        }
        Ks[j * KP + d] = v;
      }
      for (int e = tid; e < BN * V; e += THREADS) {
        const int j = e / V, c = e % V;
        Vs[j * VPITCH + c] = (k0 + j < L) ? to_float(kv[(qs + k0 + j) * kv_s0 + (i64)h * (N + V) + N + c]) : 0.f;
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
        s[kk] = (j < L && j <= my_lp) ? s[kk] * scale_log2 : -CUDART_INF_F;
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


// Tensor-core version (bf16 / fp16): CTA = (BM = 64 query rows, head, sequence), 4 warps of 16
// query rows each.  Q (DK padded to DKP, a multiple of 16) sits in shared memory for the whole
// CTA; K (BN x DKP) and V (BN x VP) tiles come in by cp.async, K of the next tile while this
// tile's softmax and P.V run, V of the next while its scores run.  S = Q K^T and O += P V are
// mma.sync m16n8k16 with fp32 accumulators; P is rounded to the act type for the P V product
// (as flash attention does), the row sums and the rescaling stay fp32.  Rows are laid out with
// a pitch of (width + 8) halves, so ldmatrix's eight 16-byte rows hit distinct banks.
template <typename T, int H, int N, int R, int V>
struct MlaPrefillTC {
  static constexpr int DK = N + R;
  static constexpr int DKP = (DK + 15) / 16 * 16, VP = (V + 15) / 16 * 16;
  static constexpr int BM = 64, BN = 64, THREADS = 128;
  static constexpr int QKP = DKP + 8, VPP = VP + 8;
  static constexpr int SMEM = (BM * QKP + BN * QKP + BN * VPP) * 2;
  // cp.async 16-byte chunks of global rows: chunk d of a row starts at a multiple of 8 elements
  // when N, R, V are (compile time) and the bases / strides are (checked once per CTA in run()).
  static constexpr bool VEC_OK = (N % 8 == 0) && (R % 8 == 0) && (V % 8 == 0);
  static_assert(QKP % 8 == 0 && VPP % 8 == 0 && (BM * QKP) % 8 == 0 && (BN * QKP) % 8 == 0,
                "shared rows and tiles start 16-byte aligned (cp.async / uint4 stores, ldmatrix rows)");
  static constexpr bool BF16 = mma::MmaType<T>::BF16;

  // rows [row0, row0 + rows) of [q_nope | q_rot] (Q) or [kv_nope | k_rot] (K): DKP wide, zero padded
  template <bool VEC>
  __device__ static void load_qk(T* dst, int nrows, const T* a, i64 a_s0, i64 a_off, const T* b, i64 b_s0,
                                 i64 b_off, i64 t0, int valid_rows) {
    constexpr int CH = DKP / 8;
    for (int c = threadIdx.x; c < nrows * CH; c += THREADS) {
      const int r = c / CH, d = (c % CH) * 8;
      T* o = dst + r * QKP + d;
      const bool ok = r < valid_rows;
      const i64 t = t0 + r;
      if constexpr (VEC) {
        const T* src = a;
        int bytes = 0;
        if (ok && d < N) { src = a + t * a_s0 + a_off + d; bytes = 16; }
        else if (ok && d < DK) { src = b + t * b_s0 + b_off + d - N; bytes = 16; }
        mma::cp_async16(o, src, bytes);
      } else {
        __align__(16) T v[8];   // stored to shared memory as one uint4
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int dd = d + i;
          v[i] = !ok ? from_float<T>(0.f)
                 : dd < N ? a[t * a_s0 + a_off + dd] : dd < DK ? b[t * b_s0 + b_off + dd - N] : from_float<T>(0.f);
        }
        *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(v);
      }
    }
  }

  template <bool VEC>
  __device__ static void load_v(T* dst, const T* kv, i64 kv_s0, i64 off, i64 t0, int valid_rows) {
    constexpr int CH = VP / 8;
    for (int c = threadIdx.x; c < BN * CH; c += THREADS) {
      const int r = c / CH, d = (c % CH) * 8;
      T* o = dst + r * VPP + d;
      const bool ok = r < valid_rows;
      const i64 t = t0 + r;
      if constexpr (VEC) {
        const bool in = ok && d < V;
        mma::cp_async16(o, in ? kv + t * kv_s0 + off + d : kv, in ? 16 : 0);
      } else {
        __align__(16) T v[8];   // stored to shared memory as one uint4
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = (ok && d + i < V) ? kv[t * kv_s0 + off + d + i] : from_float<T>(0.f);
        *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(v);
      }
    }
  }

  template <bool VEC>
  __device__ static void body(const T* __restrict__ q_nope, i64 qn_s0, i64 qn_s1, const T* __restrict__ q_rot,
                              i64 qr_s0, i64 qr_s1, const T* __restrict__ kv, i64 kv_s0,
                              const T* __restrict__ k_rot, i64 kr_s0, int qs, int L, int q0, int kend,
                              int lp0, int lp1, T* __restrict__ out, float scale, char* smem) {
    T* Qs = reinterpret_cast<T*>(smem);
    T* Ks = Qs + BM * QKP;
    T* Vs = Ks + BN * QKP;
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t2 = (lane & 3) * 2;
    const i64 kvo = (i64)h * (N + V);

    load_qk<VEC>(Qs, BM, q_nope, qn_s0, (i64)h * qn_s1, q_rot, qr_s0, (i64)h * qr_s1, qs + q0, L - q0);
    load_qk<VEC>(Ks, BN, kv, kv_s0, kvo, k_rot, kr_s0, 0, qs, L);
    mma::cp_async_commit();
    load_v<VEC>(Vs, kv, kv_s0, kvo + N, qs, L);
    mma::cp_async_commit();

    const float sl2 = scale * 1.4426950408889634f;
    float m0 = -CUDART_INF_F, m1 = -CUDART_INF_F, l0 = 0.f, l1 = 0.f;
    float o[VP / 8][4];
#pragma unroll
    for (int i = 0; i < VP / 8; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[i][c] = 0.f;

    for (int k0 = 0; k0 < kend; k0 += BN) {
      mma::cp_async_wait<1>();          // K of this tile (and Q)
      __syncthreads();
      float s[BN / 8][4];
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[i][c] = 0.f;
#pragma unroll
      for (int kk = 0; kk < DKP; kk += 16) {
        unsigned a[4];
        mma::ldsm_x4(a, Qs + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QKP + kk + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          unsigned b[4];
          mma::ldsm_x4(b, Ks + (np * 16 + (lane & 7) + (lane >> 4) * 8) * QKP + kk + ((lane >> 3) & 1) * 8);
          mma::mma16816<BF16>(s[2 * np], a, b[0], b[1]);
          mma::mma16816<BF16>(s[2 * np + 1], a, b[2], b[3]);
        }
      }
      __syncthreads();                  // every warp is done with this K tile
      if (k0 + BN < kend)
        load_qk<VEC>(Ks, BN, kv, kv_s0, kvo, k_rot, kr_s0, 0, qs + k0 + BN, L - k0 - BN);
      mma::cp_async_commit();

      // mask (causal within the prompt, keys < L), online softmax in log2 units
      float mx0 = -CUDART_INF_F, mx1 = -CUDART_INF_F;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int j = k0 + i * 8 + t2 + (c & 1);
          const int lp = (c < 2) ? lp0 : lp1;
          const float v = (j < L && j <= lp) ? s[i][c] * sl2 : -CUDART_INF_F;
          s[i][c] = v;
          if (c < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
        }
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float al0 = (mn0 == -CUDART_INF_F) ? 1.f : exp2f(m0 - mn0);
      const float al1 = (mn1 == -CUDART_INF_F) ? 1.f : exp2f(m1 - mn1);
      m0 = mn0;
      m1 = mn1;
      float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float mm = (c < 2) ? mn0 : mn1;
          const float p = (s[i][c] == -CUDART_INF_F) ? 0.f : exp2f(s[i][c] - mm);
          s[i][c] = p;
          if (c < 2) rs0 += p; else rs1 += p;
        }
      l0 = l0 * al0 + rs0;
      l1 = l1 * al1 + rs1;
#pragma unroll
      for (int i = 0; i < VP / 8; ++i) {
        o[i][0] *= al0; o[i][1] *= al0;
        o[i][2] *= al1; o[i][3] *= al1;
      }

      mma::cp_async_wait<1>();          // V of this tile
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned a[4];
        a[0] = mma::pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = mma::pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = mma::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = mma::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int vn = 0; vn < VP / 16; ++vn) {
          unsigned b[4];
          mma::ldsm_x4_t(b, Vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VPP + vn * 16 + (lane >> 4) * 8);
          mma::mma16816<BF16>(o[2 * vn], a, b[0], b[1]);
          mma::mma16816<BF16>(o[2 * vn + 1], a, b[2], b[3]);
        }
      }
      __syncthreads();                  // every warp is done with this V tile
      if (k0 + BN < kend) load_v<VEC>(Vs, kv, kv_s0, kvo + N, qs + k0 + BN, L - k0 - BN);
      mma::cp_async_commit();
    }
    mma::cp_async_wait<0>();

#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, off);
      l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = warp * 16 + g + hh * 8;
      const float l = hh ? l1 : l0;
      if (q0 + r >= L || !(l > 0.f)) continue;
      const float inv = 1.f / l;
      T* orow = out + (i64)(qs + q0 + r) * (H * V) + (i64)h * V;
#pragma unroll
      for (int i = 0; i < VP / 8; ++i) {
        const int col = i * 8 + t2;
        const float v0 = o[i][hh * 2] * inv, v1 = o[i][hh * 2 + 1] * inv;
        if constexpr (V % 2 == 0) {
          if (col < V) *reinterpret_cast<unsigned*>(orow + col) = mma::pack2<T>(v0, v1);
        } else {
          if (col < V) orow[col] = from_float<T>(v0);
          if (col + 1 < V) orow[col + 1] = from_float<T>(v1);
        }
      }
    }
  }

  __device__ static void run(const T* __restrict__ q_nope, i64 qn_s0, i64 qn_s1, const T* __restrict__ q_rot,
                             i64 qr_s0, i64 qr_s1, const T* __restrict__ kv, i64 kv_s0,
                             const T* __restrict__ k_rot, i64 kr_s0, const i32* __restrict__ query_start,
                             const i64* __restrict__ positions, T* __restrict__ out, float scale, char* smem) {
    __shared__ int max_lp;
    const int b = blockIdx.z;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BM;       // the longest (last) tiles start first
    const int qs = query_start[b], L = query_start[b + 1] - qs;
    if (q0 >= L) return;
    const i64 pos0 = positions[qs];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = warp * 16 + (lane >> 2), r1 = r0 + 8;
    const int lp0 = (q0 + r0 < L) ? (int)(positions[qs + q0 + r0] - pos0) : -1;
    const int lp1 = (q0 + r1 < L) ? (int)(positions[qs + q0 + r1] - pos0) : -1;
    if (threadIdx.x == 0) max_lp = -1;
    __syncthreads();
    atomicMax(&max_lp, max(lp0, lp1));
    __syncthreads();
    const int kend = min(L, max_lp + 1);
    bool vec = VEC_OK;
    if constexpr (VEC_OK) {
      const auto al = [](const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15) == 0; };
      vec = ((qn_s0 | qn_s1 | qr_s0 | qr_s1 | kv_s0 | kr_s0) & 7) == 0 && al(q_nope) && al(q_rot) && al(kv) && al(k_rot);
    }
    if (vec)
      body<VEC_OK>(q_nope, qn_s0, qn_s1, q_rot, qr_s0, qr_s1, kv, kv_s0, k_rot, kr_s0, qs, L, q0, kend, lp0, lp1,
                   out, scale, smem);
    else
      body<false>(q_nope, qn_s0, qn_s1, q_rot, qr_s0, qr_s1, kv, kv_s0, k_rot, kr_s0, qs, L, q0, kend, lp0, lp1,
                  out, scale, smem);
  }
};

}  // namespace dsg
