// The absorbed MLA projections of decode on tensor cores (mma.sync m16n8k16, bf16 / fp16 in,
// fp32 accumulators), "swap-AB": the weight is the MMA's M side, the tokens its N side.
//
//   AbsorbQuery: q_nope [T, H, N] -> out[t, h, :C] = q_nope[t, h] @ W_UK[h]   (mla_decode_query /
//                mla_q_absorb; W_UK[h] = kv_b rows h*(N+V) .. +N-1, [N, C]: M = C columns, K = N)
//   AbsorbVUp:   o_lat [T, H, C] -> out[t, h*V + v] = o_lat[t, h] . W_UV[h][v]  (mla_v_up;
//                W_UV[h] = kv_b rows h*(N+V)+N .. +V-1, [V, C]: M = V rows, K = C)
//
// Decode has few tokens (T = batch), so per head these are skinny products: a 16-row weight tile
// against 8-token tiles wastes only the unused token columns, and each CTA reads its slice of the
// weight ONCE, into registers, with every load in flight before pdl_wait (the prefetch overlaps
// the previous kernel's tail), then reuses it for each token tile of its chunk (grid x: token
// chunks, so large T spreads over more CTAs and the weight is re-read from L2, not DRAM; a tile
// is TN tokens).
//
// The k-order trick: a dot product does not care in which order its K terms are summed, so the
// physical k behind a fragment's logical k may be any bijection, as long as the A and B fragments
// use the same one. Thread (g = lane / 4, c = lane % 4) holds logical k {2c, 2c+1} (pair 0) and
// {2c+8, 2c+9} (pair 1) of each k16 step in both operands; mapping them onto physical k that are
// contiguous per thread lets whole registers come straight from wide loads:
//   v_up  (per 32-k chunk, steps s = 0, 1): pair p of step s -> physical 8c + 4s + 2p + {0, 1}:
//         one 16-byte load of a weight row (or of a staged token row) holds both steps' fragments.
//   query (per k16 step): pair p -> physical 4c + 2p + {0, 1}: one 8-byte load of a staged token
//         row; the weight side loads W_UK rows n = 4c .. 4c+3 (W_UK is k-major, so an A register,
//         two k of one column, is the low or high halves of two row loads: one PRMT each).
// Outputs stay in the natural order (only k is permuted).
#pragma once
#include "mma.cuh"
#include "pdl.cuh"
#include "vec.cuh"

namespace dsg {
namespace absorb {

__device__ __forceinline__ bool aligned8(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 7ull) == 0;
}

// One register from the low (high) 16-bit halves of x and y: x's half in the low bits.
// volatile, so the compiler cannot hoist the (loop-invariant) weight permutes of AbsorbQuery::tile
// above the activation copies: a permute waits for its weight loads, and hoisted it would hold
// the q_nope staging back until the whole weight slice has landed (seen in the SASS with
// __byte_perm: the weight and activation latencies then add instead of overlapping).
__device__ __forceinline__ unsigned prmt(unsigned x, unsigned y, unsigned sel) {
  unsigned r;
  asm volatile("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(x), "r"(y), "r"(sel));
  return r;
}
__device__ __forceinline__ unsigned lo_halves(unsigned x, unsigned y) { return prmt(x, y, 0x5410); }
__device__ __forceinline__ unsigned hi_halves(unsigned x, unsigned y) { return prmt(x, y, 0x7632); }

// Two consecutive 16-bit elements as one register, element-wise (any alignment).
__device__ __forceinline__ unsigned pair16(const unsigned short* p) {
  return (unsigned)p[0] | ((unsigned)p[1] << 16);
}

// Stage the token rows of a tile, ntok of them rounded up to whole n8 columns (nrows), of K 16-bit
// elements into dst [nrows][KP] (shared; zero rows from ntok on: the MMA reads whole n8 columns).
// Row r starts at src + r * s0. VEC: 16-byte cp.async (src rows 16-byte aligned, K % 8 == 0),
// else element copies. The caller waits (cp_async_wait<0>) and syncs before reading.
template <typename T, int K, int KP, int THREADS>
__device__ __forceinline__ void stage_rows(T* dst, const T* __restrict__ src, i64 s0, int ntok, bool vec) {
  static_assert(sizeof(T) == 2 && K % 8 == 0 && KP % 8 == 0, "stage_rows: 16-bit rows of whole 16-byte chunks");
  const int nrows = (ntok + 7) / 8 * 8;
  if (vec) {
    constexpr int CH = K / 8;
    for (int i = threadIdx.x; i < nrows * CH; i += THREADS) {
      const int r = i / CH, ch = i % CH;
      mma::cp_async16(dst + r * KP + ch * 8, src + (i64)min(r, ntok - 1) * s0 + ch * 8, r < ntok ? 16 : 0);
    }
    mma::cp_async_commit();
  } else {
    for (int i = threadIdx.x; i < nrows * K; i += THREADS) {
      const int r = i / K, k = i % K;
      dst[r * KP + k] = r < ntok ? src[(i64)r * s0 + k] : from_float<T>(0.f);
    }
  }
}

// ---- mla_decode_query / mla_q_absorb ------------------------------------------------------
// The weight side of AbsorbQuery, kv_b stored in T: a thread's W_UK rows 16s + 4c + i (i < 4) of each
// k16 step s, 4 columns each (one 8-byte load a row), and the A fragments of step s built from them.
// (mla_absorb_fp8.cuh has the same interface for FP8 kv_b.)
template <typename T, int N, int V, int C>
struct UkWeights16 {
  static constexpr int KSTEPS = N / 16;
  typedef const T* Src;
  struct Regs { uint2 w[KSTEPS][4]; };                    // W_UK rows 16s + 4c + i, 4 columns each

  __device__ static __forceinline__ void load(Regs& wt, const T* __restrict__ kv_b, int h, int col) {
    const T* wk = kv_b + (i64)h * (N + V) * C + col;
    const int c = threadIdx.x & 3;
    if (aligned8(kv_b)) {   // C % 4 == 0: every row then starts 8-byte aligned too
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) wt.w[s][i] = *reinterpret_cast<const uint2*>(wk + (i64)(16 * s + 4 * c + i) * C);
    } else {
      const unsigned short* w16 = reinterpret_cast<const unsigned short*>(wk);
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const unsigned short* r = w16 + (i64)(16 * s + 4 * c + i) * C;
          wt.w[s][i] = make_uint2(pair16(r), pair16(r + 2));
        }
    }
  }

  // Step s's A fragments: a0 for the thread's columns col, col + 1 (m16 tile 0), a1 for col + 2,
  // col + 3 (tile 1); rows 4c, 4c+1 carry logical k pair 0, rows 4c+2, 4c+3 pair 1.
  __device__ static __forceinline__ void frags(const Regs& wt, int s, unsigned (&a0)[4], unsigned (&a1)[4]) {
    const uint2 *w = wt.w[s];   // .x: tile 0, .y: tile 1
    a0[0] = lo_halves(w[0].x, w[1].x);
    a0[1] = hi_halves(w[0].x, w[1].x);
    a0[2] = lo_halves(w[2].x, w[3].x);
    a0[3] = hi_halves(w[2].x, w[3].x);
    a1[0] = lo_halves(w[0].y, w[1].y);
    a1[1] = hi_halves(w[0].y, w[1].y);
    a1[2] = lo_halves(w[2].y, w[3].y);
    a1[3] = hi_halves(w[2].y, w[3].y);
  }
};

// CTA (token chunk, head, column block of WPC * 32 columns); warp w owns columns
// col0 = (blockIdx.z * WPC + w) * 32 .. +31, as two m16 tiles: tile j's rows g and g + 8 are
// columns col0 + 4g + 2j and col0 + 4g + 2j + 1, so a thread's 4 columns are contiguous (8-byte
// weight loads, 8-byte output stores). The warp holds its [N, 32] weight slice (N / 2 registers)
// and runs the full K = N: no cross-warp reduction.
// WS: the weight side (UkWeights16, or mla_absorb_fp8.cuh's UkWeightsFp8).
template <typename T, int H, int N, int V, int C, int OUT_W, int TN, int WPC, typename WS = UkWeights16<T, N, V, C>>
struct AbsorbQuery {
  static_assert(sizeof(T) == 2, "tensor-core path: bf16 / fp16");
  static_assert(N % 16 == 0 && C % (32 * WPC) == 0 && TN % 8 == 0, "AbsorbQuery tiling");
  static constexpr int THREADS = WPC * 32;
  static constexpr int KSTEPS = N / 16;
  static constexpr int NT = TN / 8;                       // n8 tiles per token tile
  // token-row pitch: 8-byte fragment reads of 4 rows per half-warp phase are conflict-free
  // when the pitch is an odd multiple of 32 bytes (pitch % 64 elements == 16 or 48)
  static constexpr int NP = N + ((16 - N % 32) + 32) % 32;
  static_assert(NP % 32 == 16 && NP >= N, "query row pitch");
  static constexpr int SMEM = TN * NP * (int)sizeof(T);   // the staged q_nope tile

  typedef typename WS::Regs Weights;

  // out[t0 + tok, h, col .. col+3] for the staged tile q_s [TN][NP] (ntok valid rows).
  __device__ static __forceinline__ void tile(const Weights& wt, const T* q_s, T* __restrict__ out, int t0, int ntok,
                                              int h, int col, bool out_vec) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    float acc[NT][2][4];
#pragma unroll
    for (int jt = 0; jt < NT; ++jt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[jt][j][e] = 0.f;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      unsigned a0[4], a1[4];
      WS::frags(wt, s, a0, a1);
#pragma unroll
      for (int jt = 0; jt < NT; ++jt) {
        if (jt * 8 >= ntok) break;
        const uint2 b = *reinterpret_cast<const uint2*>(q_s + (jt * 8 + g) * NP + 16 * s + 4 * c);
        mma::mma16816<mma::MmaType<T>::BF16>(acc[jt][0], a0, b.x, b.y);
        mma::mma16816<mma::MmaType<T>::BF16>(acc[jt][1], a1, b.x, b.y);
      }
    }
    // acc[jt][j][e]: column col + 2j + (e >> 1), token jt * 8 + 2c + (e & 1)
#pragma unroll
    for (int jt = 0; jt < NT; ++jt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = jt * 8 + 2 * c + e;
        if (tok >= ntok) continue;
        T* dst = out + ((i64)(t0 + tok) * H + h) * OUT_W + col;
        const float v[4] = {acc[jt][0][e], acc[jt][0][2 + e], acc[jt][1][e], acc[jt][1][2 + e]};
        if (out_vec) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(mma::pack2<T>(v[0], v[1]), mma::pack2<T>(v[2], v[3]));
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) dst[i] = from_float<T>(v[i]);
        }
      }
  }

  // The whole CTA: weights, PDL wait, then the token tiles of this chunk. extra(t0, ntok) (the
  // rope part of mla_decode_query, spread over the CTAs of a head) runs while the tile's q_nope
  // copies are in flight, so its own global round trips overlap theirs.
  template <typename Extra>
  __device__ static __forceinline__ void run(const T* __restrict__ qn, i64 qn_s0, i64 qn_s1,
                                             typename WS::Src kv_b, T* __restrict__ out, int T_,
                                             T* q_s, Extra&& extra) {
    const int h = blockIdx.y;
    const int col = (blockIdx.z * WPC + (int)(threadIdx.x >> 5)) * 32 + 4 * ((threadIdx.x & 31) >> 2);
    Weights wt;
    WS::load(wt, kv_b, h, col);
    pdl_wait();   // q_nope (and positions, q_pe) come from earlier kernels; weights do not
    pdl_launch_dependents();
    const bool q_vec = aligned16(qn) && qn_s0 % 8 == 0 && qn_s1 % 8 == 0;
    const bool out_vec = OUT_W % 4 == 0 && aligned8(out);
    const int tw = TN;
    for (int t0 = blockIdx.x * tw; t0 < T_; t0 += gridDim.x * tw) {
      const int ntok = min(tw, T_ - t0);
      stage_rows<T, N, NP, THREADS>(q_s, qn + (i64)t0 * qn_s0 + (i64)h * qn_s1, qn_s0, ntok, q_vec);
      extra(t0, ntok);
      mma::cp_async_wait<0>();
      __syncthreads();
      tile(wt, q_s, out, t0, ntok, h, col, out_vec);
      __syncthreads();   // q_s is restaged by the next tile
    }
    DSG_PHASE_EXIT();   // phases.cuh
  }
};

// ---- mla_v_up -----------------------------------------------------------------------------
// The weight side of AbsorbVUp, kv_b stored in T: a thread's W_UV rows g and g + 8 of its m16 tile,
// 8 k (one 16-byte load) of each 32-k chunk of its k slice.  (mla_absorb_fp8.cuh: UvWeightsFp8.)
template <typename T, int N, int V, int C, int CPS>
struct UvWeights16 {
  typedef const T* Src;
  struct Regs { uint4 a[CPS], b[CPS]; };                  // rows g and g + 8, k 32*chunk + 8c .. +7

  __device__ static __forceinline__ void load(Regs& wt, const T* __restrict__ kv_b, int h, int row, int ks) {
    const int c = threadIdx.x & 3;
    const T* base = kv_b + ((i64)h * (N + V) + N) * C + 8 * c;
    const bool vec = aligned16(kv_b);   // C % 8 == 0: every row then starts 16-byte aligned too
#pragma unroll
    for (int q = 0; q < CPS; ++q) {
      const int k = (ks * CPS + q) * 32;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int v = row + 8 * half;
        uint4& dst = half ? wt.b[q] : wt.a[q];
        if (v < V && k < C) {
          const T* p = base + (i64)v * C + k;
          if (vec) dst = *reinterpret_cast<const uint4*>(p);
          else {
            const unsigned short* p16 = reinterpret_cast<const unsigned short*>(p);
            dst = make_uint4(pair16(p16), pair16(p16 + 2), pair16(p16 + 4), pair16(p16 + 6));
          }
        } else {
          dst = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
  }

  // Chunk q's A fragments of its two k16 steps (s0: k 8c .. 8c+3, s1: 8c+4 .. 8c+7; rows g, g + 8).
  __device__ static __forceinline__ void frags(const Regs& wt, int q, unsigned (&s0)[4], unsigned (&s1)[4]) {
    const uint4 a = wt.a[q], b = wt.b[q];
    s0[0] = a.x;
    s0[1] = b.x;
    s0[2] = a.y;
    s0[3] = b.y;
    s1[0] = a.z;
    s1[1] = b.z;
    s1[2] = a.w;
    s1[3] = b.w;
  }
};

// CTA (token chunk, head, block of MT * 16 weight rows); warp w = (k slice ks = w / MT, m16 tile
// mt = w % MT): rows v0 + mt*16 + {g, g+8} over the 32-k chunks ks*CPS .. ks*CPS + CPS - 1
// (of NCH = C / 32), 2 * CPS 16-byte weight registers per thread. The KS slices' partial sums
// meet in shared memory (aliasing the staged o_lat tile, after the barrier that retires it).
// WS: the weight side (UvWeights16, or mla_absorb_fp8.cuh's UvWeightsFp8).
template <typename T, int H, int N, int V, int C, int TN, int MT, int KS, int CPS,
          typename WS = UvWeights16<T, N, V, C, CPS>>
struct AbsorbVUp {
  static_assert(sizeof(T) == 2, "tensor-core path: bf16 / fp16");
  static_assert(C % 32 == 0 && TN % 8 == 0, "AbsorbVUp tiling");
  static constexpr int NCH = C / 32;
  static_assert(KS * CPS >= NCH && (KS - 1) * CPS < NCH, "every k slice holds at least one chunk");
  static constexpr int THREADS = MT * KS * 32;
  static constexpr int MB = MT * 16;                      // weight rows per CTA
  static constexpr int NT = TN / 8;
  // o_lat row pitch: 16-byte fragment reads of 2 rows per 8-lane phase are conflict-free when
  // the pitch is an odd multiple of 64 bytes (pitch % 64 elements == 32)
  static constexpr int CP = C + ((32 - C % 64) + 64) % 64;
  static_assert(CP % 64 == 32 && CP >= C, "o_lat row pitch");
  static constexpr int RP = MB + 4;                       // partial-sum row pitch (floats)
  static constexpr int STAGE_BYTES = TN * CP * (int)sizeof(T);
  static constexpr int RED_BYTES = KS * TN * RP * 4;
  static constexpr int SMEM = STAGE_BYTES > RED_BYTES ? STAGE_BYTES : RED_BYTES;

  typedef typename WS::Regs Weights;

  __device__ static __forceinline__ void run(const T* __restrict__ ol, i64 ol_s0, i64 ol_s1,
                                             typename WS::Src kv_b, T* __restrict__ out, int T_,
                                             unsigned char* smem) {
    run_cta(ol, ol_s0, ol_s1, kv_b, out, T_, smem, blockIdx.x, gridDim.x, blockIdx.y, blockIdx.z);
  }

  // The CTA of token chunk tch (of ntch), head h and weight-row block z: run's, or a persistent
  // segment's task (task_bodies.cuh), which has no 3-D grid of its own.
  __device__ static __forceinline__ void run_cta(const T* __restrict__ ol, i64 ol_s0, i64 ol_s1,
                                                 typename WS::Src kv_b, T* __restrict__ out, int T_,
                                                 unsigned char* smem, int tch, int ntch, int h, int z) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int mt = warp % MT, ks = warp / MT;
    const int v0 = z * MB;
    Weights wt;
    WS::load(wt, kv_b, h, v0 + mt * 16 + g, ks);
    pdl_wait();   // o_lat comes from the attention kernel; the weights do not
    pdl_launch_dependents();
    T* o_s = reinterpret_cast<T*>(smem);
    float* red = reinterpret_cast<float*>(smem);
    const bool o_vec = aligned16(ol) && ol_s0 % 8 == 0 && ol_s1 % 8 == 0;
    const int tw = TN;
    for (int t0 = tch * tw; t0 < T_; t0 += ntch * tw) {
      const int ntok = min(tw, T_ - t0);
      stage_rows<T, C, CP, THREADS>(o_s, ol + (i64)t0 * ol_s0 + (i64)h * ol_s1, ol_s0, ntok, o_vec);
      mma::cp_async_wait<0>();
      __syncthreads();
      float acc[NT][4];
#pragma unroll
      for (int jt = 0; jt < NT; ++jt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[jt][e] = 0.f;
#pragma unroll
      for (int q = 0; q < CPS; ++q) {
        const int chunk = ks * CPS + q;
        if (chunk >= NCH) break;   // warp-uniform: the last slice may be short
        unsigned s0[4], s1[4];
        WS::frags(wt, q, s0, s1);
#pragma unroll
        for (int jt = 0; jt < NT; ++jt) {
          if (jt * 8 >= ntok) break;
          const uint4 x = *reinterpret_cast<const uint4*>(o_s + (jt * 8 + g) * CP + chunk * 32 + 8 * c);
          mma::mma16816<mma::MmaType<T>::BF16>(acc[jt], s0, x.x, x.y);
          mma::mma16816<mma::MmaType<T>::BF16>(acc[jt], s1, x.z, x.w);
        }
      }
      __syncthreads();   // every warp is done with o_s: red aliases it
      // acc[jt][e]: row mt*16 + g + 8 * (e >> 1), token jt * 8 + 2c + (e & 1)
#pragma unroll
      for (int jt = 0; jt < NT; ++jt) {
        if (jt * 8 >= ntok) break;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          red[(ks * TN + jt * 8 + 2 * c + (e & 1)) * RP + mt * 16 + g + 8 * (e >> 1)] = acc[jt][e];
      }
      __syncthreads();
      for (int i = threadIdx.x; i < ntok * MB; i += THREADS) {
        const int tok = i / MB, r = i % MB, v = v0 + r;
        if (v >= V) continue;
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < KS; ++k) sum += red[(k * TN + tok) * RP + r];
        out[(i64)(t0 + tok) * (H * V) + h * V + v] = from_float<T>(sum);
      }
      __syncthreads();   // red / o_s are reused by the next tile
    }
    DSG_PHASE_EXIT();   // phases.cuh
  }
};

}  // namespace absorb
}  // namespace dsg
