// Split-KV paged MLA decode over compressed cache rows [c_n (C) | k_rot (R)].
//
// CTA (token t, head group g, split s) attends HG heads of token t over a contiguous
// slice of the token's visible rows (j <= positions[t], j < context_len): each KT-row
// tile is read once from the paged cache (16-byte loads) into shared memory and used by
// all HG heads (scores over the W = C + R row, values over its first C columns). The
// partial max / sum / unnormalised accumulators go to a workspace; MlaCombine merges
// the splits. MlaDecode is the CUDA-core split (fp32, odd shapes); MlaDecodeMma the
// tensor-core one (bf16 / fp16 when the row and value widths fit the mma tiles). Scores are kept in log2 units (exp2f) with the scale folded in.
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

// Bytes rounded up to a multiple of 16 (shared-memory carve-ups start every piece 16-byte aligned).
__host__ __device__ constexpr int round_up16(int bytes) { return (bytes + 15) / 16 * 16; }

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
  // Cache rows take 16-byte loads when a row is a whole number of vectors: row r starts at
  // cache + slot * W elements, and the cache is a contiguous [blocks, BS, W] tensor with a
  // 16-byte aligned base (the runtime's own allocation; runtime/launcher.py checks it).
  static constexpr bool VEC_ROWS = (W * (int)sizeof(T)) % 16 == 0;
  static constexpr int VPR = VEC_ROWS ? W * (int)sizeof(T) / 16 : 0;  // 16-byte vectors per row
  // Shared memory carve-up (bytes). Every piece is rounded up to 16 bytes so each one starts
  // 16-byte aligned: ps is read as float4, ks written as u32 / read as pairs, slot_s is i64.
  // (HG * QP * 4 alone is only a multiple of 8: HG * WP odd, e.g. H 3 and W 29, put ps off by 8.)
  // codegen/families/mla_decode_attention.py smem_bytes() mirrors this; the kernel
  // static_asserts that the two agree.
  static constexpr int Q_BYTES = round_up16(HG * QP * 4);
  static constexpr int K_BYTES = round_up16(KT * KP * (int)sizeof(T));
  static constexpr int P_BYTES = KT * PP * 4;           // PP % 4 == 0: a multiple of 16
  static constexpr int A_BYTES = PP * 4;
  static constexpr int S_BYTES = KT * 8;
  static constexpr int SMEM = Q_BYTES + K_BYTES + P_BYTES + A_BYTES + S_BYTES;
  static_assert(KT == 32, "one lane per tile row in the score phase");
  static_assert(THREADS % 32 == 0, "whole warps");
  static_assert(Q_BYTES % 16 == 0 && K_BYTES % 16 == 0 && P_BYTES % 16 == 0 && A_BYTES % 16 == 0,
                "every shared piece starts 16-byte aligned (ps float4, slot_s i64)");
  static_assert(PP % 4 == 0 && QP % 2 == 0 && KP % 2 == 0, "float4 / float2 / pair reads of shared rows");

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
      if constexpr (VEC_ROWS) {   // cache + slot * W + 16k bytes: 16-byte aligned (see VEC_ROWS)
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

};


// CTA (t, h): o_lat[t, h, :] = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M).
// Warp 0 compacts the non-empty splits (m_s finite) with their weights into shared memory;
// then every thread streams its columns over only those splits (empty splits never wrote acc).
// The compacted list holds MAXS entries: the lowering clamps the split count's size expression
// to min(MAXS, ...), so S <= MAXS by construction; a launch with a larger S (a hand-edited
// plan) traps here rather than dropping splits.
template <typename T, int C, int H, int MAXS>
struct MlaCombine {
  static_assert(MAXS >= 1 && MAXS <= 65535, "S is the split's grid z");
  __device__ static void combine(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                                 T* __restrict__ out, int T_, int S) {
    __shared__ float w_s[MAXS];
    __shared__ int idx_s[MAXS];
    __shared__ int cnt_s;
    __shared__ float inv_s;
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    if (S > MAXS) __trap();   // uniform, once per CTA; unreachable for a lowered plan
    if (t >= T_) return;
    const float* ml = ws_ml + ((i64)t * H + h) * S * 2;
    if (tid < 32) {
      float M = -CUDART_INF_F;
      for (int s = tid; s < S; s += 32) M = fmaxf(M, ml[2 * s]);
      M = warp_max(M);
      int base = 0;
      float L = 0.f;
      for (int s0 = 0; s0 < S; s0 += 32) {
        const int s = s0 + tid;
        const float m = s < S ? ml[2 * s] : -CUDART_INF_F;
        const bool ok = m != -CUDART_INF_F;
        const unsigned bal = __ballot_sync(0xffffffffu, ok);
        if (ok) {
          const int p = base + __popc(bal & ((1u << tid) - 1u));
          const float w = exp2f(m - M);
          w_s[p] = w;          // p <= s < S <= MAXS: the rank of split s among the non-empty ones
          idx_s[p] = s;
          L += ml[2 * s + 1] * w;
        }
        base += __popc(bal);
      }
      L = warp_sum(L);
      if (tid == 0) { cnt_s = base; inv_s = L > 0.f ? 1.f / L : 0.f; }
    }
    __syncthreads();
    const int cnt = cnt_s;
    const float inv = inv_s;
    const float* acc = ws_acc + ((i64)t * H + h) * S * C;
    for (int c = tid; c < C; c += blockDim.x) {
      float o0 = 0.f, o1 = 0.f;
      int p = 0;
      for (; p + 1 < cnt; p += 2) {
        o0 = fmaf(acc[(i64)idx_s[p] * C + c], w_s[p], o0);
        o1 = fmaf(acc[(i64)idx_s[p + 1] * C + c], w_s[p + 1], o1);
      }
      if (p < cnt) o0 = fmaf(acc[(i64)idx_s[p] * C + c], w_s[p], o0);
      out[((i64)t * H + h) * C + c] = from_float<T>((o0 + o1) * inv);
    }
  }
};

namespace mlad {
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
template <typename T> __device__ __forceinline__ unsigned pack2(float x, float y);
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack2<__half>(float x, float y) {
  __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<unsigned*>(&v);
}
template <typename T> __device__ __forceinline__ void mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
}  // namespace mlad

// Tensor-core split (bf16 / fp16): CTA (token t, group of 16 heads g, KV split s), NW warps.
// The 16 heads are the M dimension of mma.sync m16n8k16 (heads past H: zero queries, not
// stored). KT = 32-row cache tiles stream through an NSTAGE-deep cp.async ring (16-byte
// copies, rows past the split zero-filled). Scores: warp w owns k-steps w, w+NW, ... of the
// W-wide dot product with its query fragments in registers; the four partial 16 x 32 score
// tiles are summed through shared memory (every warp gets the full tile and runs the same
// online softmax). Values: warp w owns C/NW output columns; P stays in registers (the score
// accumulator layout is the A-operand layout) and V comes from the same tile by ldmatrix.trans.
template <typename T, int C, int R, int H, int BS, int KT, int NSTAGE, int NW>
struct MlaDecodeMma {
  static constexpr int W = C + R;
  static constexpr int THREADS = NW * 32;
  static constexpr int KP = W + 8;                 // smem row pitch (elements): 16 B aligned, ldmatrix conflict-free
  static constexpr int KSTEPS = W / 16;
  static constexpr int QKS = (KSTEPS + NW - 1) / NW;
  static constexpr int NT = KT / 8;                // score n-tiles
  static constexpr int CW = C / NW;                // value columns per warp
  static constexpr int VT = CW / 8;                // value n-tiles per warp
  static constexpr int VPR = W * 2 / 16;           // 16-byte vectors per cache row
  static constexpr int STAGE_BYTES = KT * KP * 2;
  static constexpr int RED_BYTES = NW * NT * 32 * 16;
  static constexpr int SMEM = NSTAGE * STAGE_BYTES + RED_BYTES;
  static_assert(sizeof(T) == 2, "tensor-core path is bf16 / fp16");
  static_assert(W % 16 == 0 && C % (16 * NW) == 0 && KT == 32, "tile shape");

  __device__ static float ldq(const T* __restrict__ q_lat, i64 ql, const T* __restrict__ q_rot, i64 qr, int d) {
    return d < C ? to_float(q_lat[ql + d]) : to_float(q_rot[qr + (d - C)]);
  }

  __device__ static void split(const T* __restrict__ q_lat, i64 ql_s0, i64 ql_s1,
                               const T* __restrict__ q_rot, i64 qr_s0, i64 qr_s1,
                               const T* __restrict__ cache, const i32* __restrict__ block_tables, int bt_width,
                               const i32* __restrict__ context_lens, const i32* __restrict__ query_start,
                               const i64* __restrict__ positions, float* __restrict__ ws_acc,
                               float* __restrict__ ws_ml, float scale, int T_, int B, int S, char* smem) {
    const int t = blockIdx.x, g = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (t >= T_) return;
    const int b = sequence_of(query_start, B, t);
    const i64 pos = positions[t];
    const int n = (int)min((i64)context_lens[b], pos + 1);
    const int per = (((n + S - 1) / S) + KT - 1) / KT * KT;
    const int r_begin = s * per;
    const int r_end = min(n, r_begin + per);
    const int h0 = g * 16;
    if (r_begin >= r_end) {    // empty split: only (max, sum) = (-inf, 0); combine skips it
      if (tid < 16 && h0 + tid < H) {
        float* ml = ws_ml + (((i64)t * H + h0 + tid) * S + s) * 2;
        ml[0] = -CUDART_INF_F;
        ml[1] = 0.f;
      }
      return;
    }
    T* ks = reinterpret_cast<T*>(smem);
    float4* red = reinterpret_cast<float4*>(smem + NSTAGE * STAGE_BYTES);
    const int ntiles = (r_end - r_begin + KT - 1) / KT;
    const i32* table = block_tables + (i64)b * bt_width;

    auto issue = [&](int it) {
      const int r0 = r_begin + it * KT;
      const int rows = min(KT, r_end - r0);
      T* dst0 = ks + (it % NSTAGE) * KT * KP;
#pragma unroll 6
      for (int v = tid; v < KT * VPR; v += THREADS) {
        const int j = v / VPR, c = v % VPR;
        T* dst = dst0 + j * KP + c * 8;
        if (j < rows) {
          const int r = r0 + j;
          const i64 slot = (i64)__ldg(table + r / BS) * BS + (r % BS);
          mlad::cp_async16(dst, cache + slot * W + c * 8, 16);
        } else {
          mlad::cp_async16(dst, cache, 0);
        }
      }
    };
#pragma unroll
    for (int st = 0; st < NSTAGE; ++st) {
      if (st < ntiles) issue(st);
      mlad::cp_async_commit();
    }

    // Query fragments (A operand, row = head): k-steps warp, warp + NW, ...
    unsigned qf[QKS][4];
    {
      const int r0 = lane >> 2, cc = 2 * (lane & 3);
#pragma unroll
      for (int kk = 0; kk < QKS; ++kk) {
        const int kstep = warp + kk * NW;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = h0 + r0 + (i & 1) * 8;
          const int d = kstep * 16 + cc + (i >> 1) * 8;
          float x0 = 0.f, x1 = 0.f;
          if (kstep < KSTEPS && h < H) {
            const i64 ql = (i64)t * ql_s0 + (i64)h * ql_s1, qr = (i64)t * qr_s0 + (i64)h * qr_s1;
            x0 = ldq(q_lat, ql, q_rot, qr, d);
            x1 = ldq(q_lat, ql, q_rot, qr, d + 1);
          }
          qf[kk][i] = mlad::pack2<T>(x0, x1);
        }
      }
    }

    const float scale_log2 = scale * 1.4426950408889634f;
    float m_r[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_r[2] = {0.f, 0.f};
    float o[VT][4];
#pragma unroll
    for (int v = 0; v < VT; ++v) o[v][0] = o[v][1] = o[v][2] = o[v][3] = 0.f;

    for (int it = 0; it < ntiles; ++it) {
      mlad::cp_async_wait<NSTAGE - 1>();
      __syncthreads();
      const T* kb = ks + (it % NSTAGE) * KT * KP;
      float sc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < QKS; ++kk) {
        const int kstep = warp + kk * NW;
        if (kstep < KSTEPS) {
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            unsigned bb[4];
            mlad::ldsm_x4(bb, kb + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * KP + kstep * 16 + ((lane >> 3) & 1) * 8);
            mlad::mma16816<T>(sc[2 * np], qf[kk], bb[0], bb[1]);
            mlad::mma16816<T>(sc[2 * np + 1], qf[kk], bb[2], bb[3]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) red[(warp * NT + nt) * 32 + lane] = make_float4(sc[nt][0], sc[nt][1], sc[nt][2], sc[nt][3]);
      __syncthreads();
      const int rows = min(KT, r_end - (r_begin + it * KT));
      float mx0 = -CUDART_INF_F, mx1 = -CUDART_INF_F;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float4 a = red[nt * 32 + lane];
#pragma unroll
        for (int w = 1; w < NW; ++w) {
          const float4 x = red[(w * NT + nt) * 32 + lane];
          a.x += x.x; a.y += x.y; a.z += x.z; a.w += x.w;
        }
        const int j = nt * 8 + 2 * (lane & 3);
        sc[nt][0] = j < rows ? a.x * scale_log2 : -CUDART_INF_F;
        sc[nt][1] = j + 1 < rows ? a.y * scale_log2 : -CUDART_INF_F;
        sc[nt][2] = j < rows ? a.z * scale_log2 : -CUDART_INF_F;
        sc[nt][3] = j + 1 < rows ? a.w * scale_log2 : -CUDART_INF_F;
        mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      const float mn0 = fmaxf(m_r[0], mx0), mn1 = fmaxf(m_r[1], mx1);
      const float al0 = exp2f(m_r[0] - mn0), al1 = exp2f(m_r[1] - mn1);
      m_r[0] = mn0; m_r[1] = mn1;
      float ls0 = 0.f, ls1 = 0.f;
      unsigned pa[NT / 2][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float p0 = exp2f(sc[nt][0] - mn0), p1 = exp2f(sc[nt][1] - mn0);
        const float p2 = exp2f(sc[nt][2] - mn1), p3 = exp2f(sc[nt][3] - mn1);
        ls0 += p0 + p1;
        ls1 += p2 + p3;
        pa[nt >> 1][(nt & 1) * 2] = mlad::pack2<T>(p0, p1);
        pa[nt >> 1][(nt & 1) * 2 + 1] = mlad::pack2<T>(p2, p3);
      }
      l_r[0] = l_r[0] * al0 + ls0;
      l_r[1] = l_r[1] * al1 + ls1;
#pragma unroll
      for (int v = 0; v < VT; ++v) { o[v][0] *= al0; o[v][1] *= al0; o[v][2] *= al1; o[v][3] *= al1; }
#pragma unroll
      for (int vp = 0; vp < VT / 2; ++vp) {
        const int n0 = warp * CW + vp * 16;
#pragma unroll
        for (int k2 = 0; k2 < NT / 2; ++k2) {
          unsigned bb[4];
          mlad::ldsm_x4_t(bb, kb + (k2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KP + n0 + (lane >> 4) * 8);
          mlad::mma16816<T>(o[2 * vp], pa[k2], bb[0], bb[1]);
          mlad::mma16816<T>(o[2 * vp + 1], pa[k2], bb[2], bb[3]);
        }
      }
      __syncthreads();   // tile and score partials consumed
      if (it + NSTAGE < ntiles) issue(it + NSTAGE);
      mlad::cp_async_commit();
    }
    mlad::cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 1);
      l_r[i] += __shfl_xor_sync(0xffffffffu, l_r[i], 2);
    }
    const int hA = h0 + (lane >> 2), hB = hA + 8;
    float* oA = ws_acc + (((i64)t * H + hA) * S + s) * C;
    float* oB = ws_acc + (((i64)t * H + hB) * S + s) * C;
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      const int c = warp * CW + v * 8 + 2 * (lane & 3);
      if (hA < H) *reinterpret_cast<float2*>(oA + c) = make_float2(o[v][0], o[v][1]);
      if (hB < H) *reinterpret_cast<float2*>(oB + c) = make_float2(o[v][2], o[v][3]);
    }
    if (warp == 0 && (lane & 3) == 0) {
      if (hA < H) { float* ml = ws_ml + (((i64)t * H + hA) * S + s) * 2; ml[0] = m_r[0]; ml[1] = l_r[0]; }
      if (hB < H) { float* ml = ws_ml + (((i64)t * H + hB) * S + s) * 2; ml[0] = m_r[1]; ml[1] = l_r[1]; }
    }
  }
};

}  // namespace dsg
