// MLA prefill attention on tensor cores (bf16 / fp16): MlaPrefillTC2, the tensor-core sibling of
// mla_prefill.cuh's MlaPrefill (fp32, CUDA cores), at the tile Tuning.attention.prefill_tile
// names.  It replaced a first tensor-core version (MlaPrefillTC: Q re-read from shared memory every
// key tile, single-buffered K / V, the mask on every tile), 1.4-1.6x slower at every shape
// measured on the H200 (docs/PERF_NOTES.md) and removed after.
#pragma once
#include "common.cuh"
#include "mma.cuh"

namespace dsg {

// The contract of MlaPrefill::run (arguments, keys at key_start, the causal rule shifted by the keys before
// the first query, fp32 online softmax in log2 units), with P rounded to T for the P V product (as flash
// attention does; the row sums and rescaling stay fp32), one rounding of o / l, rows with l == 0 left
// unwritten, 16-byte cp.async copies where N, R, V, the bases and the strides allow (checked once per CTA)
// and element gathers elsewhere, the longest query tiles first, any N, R, V.  How it runs:
//
//  * WM query rows per warp (16 or 32: one or two m16 tiles), BM / WM warps share each K / V tile,
//    so a CTA's copies per query row halve at BM = 128; and at WM = 32 each K / V fragment read by
//    ldmatrix feeds two mma instead of one (half the shared-memory reads per mma, for twice the
//    accumulator registers).
//  * QREG: the warp's Q fragments (WM rows x DKP) are read by ldmatrix once, after Q lands, and
//    stay in registers for the CTA's life.  Q's shared memory
//    is then dead and holds the second K / V stage.  Without QREG, Q stays in shared memory.
//  * K and V of tile j + 1 are copied (one cp.async group) while tile j is computed: a two-stage
//    ring, one barrier per tile (it both publishes tile j and frees tile j - 1's stage).
//  * The mask (key < Lk, key <= the row's position) is applied only on tiles that are not
//    wholly visible to every valid row of the warp (the diagonal tile and the prompt's end); tiles
//    wholly hidden from the warp's rows are skipped (a fully masked tile leaves m, l, o exactly as
//    they were: alpha = 1, p = 0).
//  * Softmax with the max taken on raw scores (max(s) * c == max(s * c) for c > 0: rounding is
//    monotone) and p = exp2(s * c - m) as one FMA; a row that has seen no visible key yet uses 0
//    in place of m = -inf, so p = exp2(-inf) = 0 needs no per-element test (flash attention 2's
//    rule; o and l are still 0 then, so alpha's value does not matter).
template <typename T, int H, int N, int R, int V, int BM_, int BN_, int WM_, bool QREG_>
struct MlaPrefillTC2 {
  static constexpr int DK = N + R;
  static constexpr int DKP = (DK + 15) / 16 * 16, VP = (V + 15) / 16 * 16;
  static constexpr int BM = BM_, BN = BN_, WM = WM_, MI = WM / 16, WARPS = BM / WM, THREADS = WARPS * 32;
  static constexpr bool QREG = QREG_;
  static constexpr int QKP = DKP + 8, VPP = VP + 8;          // pitches (halves): conflict-free ldmatrix
  static constexpr int Q_ELEMS = BM * QKP, STAGE = BN * (QKP + VPP);   // a stage: K tile, then V tile
  // [region 0 | stage 0]: region 0 holds Q, and stage 1 after it (over Q when Q lives in registers)
  static constexpr int REGION0 = QREG ? (Q_ELEMS > STAGE ? Q_ELEMS : STAGE) : Q_ELEMS + STAGE;
  static constexpr int SMEM = (REGION0 + STAGE) * 2;
  static constexpr bool VEC_OK = (N % 8 == 0) && (R % 8 == 0) && (V % 8 == 0);
  static constexpr bool BF16 = mma::MmaType<T>::BF16;
  static_assert(WM == 16 || WM == 32, "one or two m16 tiles per warp");
  static_assert(BM % WM == 0 && BN % 16 == 0 && THREADS <= 1024, "whole warps, whole k16 steps of P V");
  static_assert(QKP % 8 == 0 && VPP % 8 == 0 && REGION0 % 8 == 0 && STAGE % 8 == 0,
                "shared rows, tiles and stages start 16-byte aligned (cp.async / uint4 stores, ldmatrix rows)");

  // exp2 as one MUFU.EX2: exp2f wraps it in a fix-up for subnormal results (3 more instructions a
  // score); here a probability below 2^-126 (relative to the row's running max) becomes 0.
  __device__ static __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }

  // Tile copies.  Thread tid owns one 16-byte chunk column (or several, when a row has more chunks
  // than the CTA has threads) and every RS-th row of it, so the column's source (a or b, its stride)
  // is resolved once a call and a chunk costs a pointer step and one cp.async; rows past the
  // prompt (and the padding past DK / V) are zero stores.  The gather path (unaligned strides, odd
  // dims) reads element by element and stores whole 16-byte chunks.
  template <int CH>
  struct Lanes {
    static constexpr int CS = THREADS >= CH ? CH : THREADS;   // threads across a row
    static constexpr int RS = THREADS / CS;                   // rows a pass
  };

  // nrows rows of [a | b] (a: N wide, b: R wide), row r from token t0 + r, DKP wide, zero padded
  // (and zero rows from valid_rows on)
  template <bool VEC>
  __device__ static void load_qk(T* dst, int nrows, const T* a, i64 a_s0, i64 a_off, const T* b, i64 b_s0,
                                 i64 b_off, i64 t0, int valid_rows) {
    constexpr int CH = DKP / 8, CS = Lanes<CH>::CS, RS = Lanes<CH>::RS;
    if (threadIdx.x >= CS * RS) return;
    for (int cc = threadIdx.x % CS; cc < CH; cc += CS) {
      const int d = cc * 8;
      if constexpr (VEC) {
        const i64 s0 = d < N ? a_s0 : b_s0;
        const int rows = min(nrows, d < DK ? valid_rows : 0);   // the zero padding past DK reads nothing
        int r = threadIdx.x / CS;
        const T* src = (d < N ? a + a_off + d : b + b_off + (d - N)) + (t0 + r) * s0;
#pragma unroll 2
        for (; r < rows; r += RS, src += RS * s0) mma::cp_async16(dst + r * QKP + d, src, 16);
        for (; r < nrows; r += RS) *reinterpret_cast<uint4*>(dst + r * QKP + d) = make_uint4(0, 0, 0, 0);
      } else {
        for (int r = threadIdx.x / CS; r < nrows; r += RS) {
          const bool ok = r < valid_rows;
          const i64 t = t0 + r;
          __align__(16) T v[8];   // stored to shared memory as one uint4
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int dd = d + i;
            v[i] = !ok ? from_float<T>(0.f)
                   : dd < N ? a[t * a_s0 + a_off + dd] : dd < DK ? b[t * b_s0 + b_off + dd - N] : from_float<T>(0.f);
          }
          *reinterpret_cast<uint4*>(dst + r * QKP + d) = *reinterpret_cast<const uint4*>(v);
        }
      }
    }
  }

  // BN rows of V (kv's columns off + [0, V)), VP wide, zero padded, zero rows from valid_rows on
  template <bool VEC>
  __device__ static void load_v(T* dst, const T* kv, i64 kv_s0, i64 off, i64 t0, int valid_rows) {
    constexpr int CH = VP / 8, CS = Lanes<CH>::CS, RS = Lanes<CH>::RS;
    if (threadIdx.x >= CS * RS) return;
    for (int cc = threadIdx.x % CS; cc < CH; cc += CS) {
      const int d = cc * 8;
      if constexpr (VEC) {
        const int rows = min(BN, d < V ? valid_rows : 0);
        int r = threadIdx.x / CS;
        const T* src = kv + off + d + (t0 + r) * kv_s0;
#pragma unroll 2
        for (; r < rows; r += RS, src += RS * kv_s0) mma::cp_async16(dst + r * VPP + d, src, 16);
        for (; r < BN; r += RS) *reinterpret_cast<uint4*>(dst + r * VPP + d) = make_uint4(0, 0, 0, 0);
      } else {
        for (int r = threadIdx.x / CS; r < BN; r += RS) {
          const bool ok = r < valid_rows;
          const i64 t = t0 + r;
          __align__(16) T v[8];   // stored to shared memory as one uint4
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = (ok && d + i < V) ? kv[t * kv_s0 + off + d + i] : from_float<T>(0.f);
          *reinterpret_cast<uint4*>(dst + r * VPP + d) = *reinterpret_cast<const uint4*>(v);
        }
      }
    }
  }

  // lp[mi][hh]: the prompt position of row warp * WM + mi * 16 + lane / 4 + 8 * hh (-1: no row)
  template <bool VEC>
  __device__ static void body(const T* __restrict__ q_nope, i64 qn_s0, i64 qn_s1, const T* __restrict__ q_rot,
                              i64 qr_s0, i64 qr_s1, const T* __restrict__ kv, i64 kv_s0,
                              const T* __restrict__ k_rot, i64 kr_s0, int qs, int L, int ks, int Lk, int q0,
                              int kend, const int (&lp)[MI][2], T* __restrict__ out, float scale, char* smem) {
    T* const Qs = reinterpret_cast<T*>(smem);
    T* const stage0 = Qs + REGION0;
    T* const stage1 = QREG ? Qs : Qs + Q_ELEMS;
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t2 = (lane & 3) * 2;
    const i64 kvo = (i64)h * (N + V);
    const auto load_tile = [&](T* st, int k0) {   // K then V of keys [k0, k0 + BN)
      load_qk<VEC>(st, BN, kv, kv_s0, kvo, k_rot, kr_s0, 0, ks + k0, Lk - k0);
      load_v<VEC>(st + BN * QKP, kv, kv_s0, kvo + N, ks + k0, Lk - k0);
    };

    // The warp's visible-key bounds: every valid row sees keys [0, wmin], some row sees up to wmax.
    int mymin = 0x7fffffff, mymax = -1;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (q0 + warp * WM + mi * 16 + g + 8 * hh < L) {
          mymin = min(mymin, lp[mi][hh]);
          mymax = max(mymax, lp[mi][hh]);
        }
    const int wmin = __reduce_min_sync(0xffffffffu, mymin), wmax = __reduce_max_sync(0xffffffffu, mymax);

    load_qk<VEC>(Qs, BM, q_nope, qn_s0, (i64)h * qn_s1, q_rot, qr_s0, (i64)h * qr_s1, qs + q0, L - q0);
    load_tile(stage0, 0);
    mma::cp_async_commit();
    mma::cp_async_wait<0>();
    __syncthreads();

    // A fragments of the warp's rows (m16 tile mi, k16 step kk): ldmatrix x4 of rows 0-7 / 8-15 at
    // columns kk + 0-7 / kk + 8-15
    const auto q_frag = [&](unsigned (&a)[4], int mi, int kk) {
      mma::ldsm_x4(a, Qs + (warp * WM + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QKP + kk + (lane >> 4) * 8);
    };
    unsigned qf[QREG ? MI : 1][QREG ? DKP / 16 : 1][4];
    if constexpr (QREG) {
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int kk = 0; kk < DKP / 16; ++kk) q_frag(qf[mi][kk], mi, kk * 16);
    }

    const float sl2 = scale * 1.4426950408889634f;
    float m[MI][2], l[MI][2], o[MI][VP / 8][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      m[mi][0] = m[mi][1] = -CUDART_INF_F;
      l[mi][0] = l[mi][1] = 0.f;
#pragma unroll
      for (int i = 0; i < VP / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[mi][i][c] = 0.f;
    }

    const int nt = (kend + BN - 1) / BN;
    for (int jt = 0; jt < nt; ++jt) {
      const int k0 = jt * BN;
      mma::cp_async_wait<0>();          // tile jt (this thread's copies)
      __syncthreads();                  // ... and every thread's; every warp is done with tile jt - 1 (and Q)
      if (jt + 1 < nt) load_tile((jt & 1) ? stage0 : stage1, k0 + BN);
      mma::cp_async_commit();
      if (k0 > wmax) continue;          // no row of this warp sees any key of the tile
      const T* Ks = (jt & 1) ? stage1 : stage0;
      const T* Vs = Ks + BN * QKP;

      // S = Q K^T (raw, unscaled)
      float s[MI][BN / 8][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) s[mi][i][c] = 0.f;
#pragma unroll
      for (int kk = 0; kk < DKP / 16; ++kk) {
        unsigned qa[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          if constexpr (QREG) {
#pragma unroll
            for (int c = 0; c < 4; ++c) qa[mi][c] = qf[mi][kk][c];
          } else {
            q_frag(qa[mi], mi, kk * 16);
          }
        }
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          unsigned b[4];
          mma::ldsm_x4(b, Ks + (np * 16 + (lane & 7) + (lane >> 4) * 8) * QKP + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            mma::mma16816<BF16>(s[mi][2 * np], qa[mi], b[0], b[1]);
            mma::mma16816<BF16>(s[mi][2 * np + 1], qa[mi], b[2], b[3]);
          }
        }
      }

      // mask only where some key of the tile is hidden from some valid row of the warp
      if (!(k0 + BN <= Lk && k0 + BN - 1 <= wmin)) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int j = k0 + i * 8 + t2 + (c & 1);
              if (!(j < Lk && j <= lp[mi][c >> 1])) s[mi][i][c] = -CUDART_INF_F;
            }
      }

      // online softmax (log2 units), rows (mi, hh): this thread's 2 x BN / 8 scores of each
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        float alpha[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float mx = -CUDART_INF_F;
#pragma unroll
          for (int i = 0; i < BN / 8; ++i) mx = fmaxf(mx, fmaxf(s[mi][i][2 * hh], s[mi][i][2 * hh + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mn = fmaxf(m[mi][hh], mx * sl2);
          const float base = (mn == -CUDART_INF_F) ? 0.f : mn;   // no visible key yet: every p is 0
          alpha[hh] = ex2(m[mi][hh] - base);
          m[mi][hh] = mn;
          float rs = 0.f;
#pragma unroll
          for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int c = 2 * hh; c < 2 * hh + 2; ++c) {
              const float p = ex2(fmaf(s[mi][i][c], sl2, -base));
              s[mi][i][c] = p;
              rs += p;
            }
          l[mi][hh] = l[mi][hh] * alpha[hh] + rs;
        }
#pragma unroll
        for (int i = 0; i < VP / 8; ++i) {
          o[mi][i][0] *= alpha[0]; o[mi][i][1] *= alpha[0];
          o[mi][i][2] *= alpha[1]; o[mi][i][3] *= alpha[1];
        }
      }

      // O += P V, P rounded to T (the accumulator layout of S is the A layout of P)
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned pa[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          pa[mi][0] = mma::pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
          pa[mi][1] = mma::pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
          pa[mi][2] = mma::pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
          pa[mi][3] = mma::pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
        }
#pragma unroll
        for (int vn = 0; vn < VP / 16; ++vn) {
          unsigned b[4];
          mma::ldsm_x4_t(b, Vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * VPP + vn * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            mma::mma16816<BF16>(o[mi][2 * vn], pa[mi], b[0], b[1]);
            mma::mma16816<BF16>(o[mi][2 * vn + 1], pa[mi], b[2], b[3]);
          }
        }
      }
    }
    mma::cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float lsum = l[mi][hh];
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
        const int r = warp * WM + mi * 16 + g + hh * 8;
        if (q0 + r >= L || !(lsum > 0.f)) continue;
        const float inv = 1.f / lsum;
        T* orow = out + (i64)(qs + q0 + r) * (H * V) + (i64)h * V;
#pragma unroll
        for (int i = 0; i < VP / 8; ++i) {
          const int col = i * 8 + t2;
          const float v0 = o[mi][i][hh * 2] * inv, v1 = o[mi][i][hh * 2 + 1] * inv;
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
                             const i32* __restrict__ key_start, const i64* __restrict__ positions,
                             T* __restrict__ out, float scale, char* smem) {
    __shared__ int max_lp;
    const int b = blockIdx.z;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BM;       // the longest (last) tiles start first
    const int qs = query_start[b], L = query_start[b + 1] - qs;
    if (q0 >= L) return;
    const int ks = key_start[b], Lk = key_start[b + 1] - ks;
    const i64 pos0 = positions[qs] - (Lk - L);   // the position of key 0
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int lp[MI][2], mymax = -1;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = warp * WM + mi * 16 + (lane >> 2) + 8 * hh;
        lp[mi][hh] = (q0 + r < L) ? (int)(positions[qs + q0 + r] - pos0) : -1;
        mymax = max(mymax, lp[mi][hh]);
      }
    if (threadIdx.x == 0) max_lp = -1;
    __syncthreads();
    atomicMax(&max_lp, mymax);
    __syncthreads();
    const int kend = min(Lk, max_lp + 1);
    bool vec = VEC_OK;
    if constexpr (VEC_OK) {
      const auto al = [](const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15) == 0; };
      vec = ((qn_s0 | qn_s1 | qr_s0 | qr_s1 | kv_s0 | kr_s0) & 7) == 0 && al(q_nope) && al(q_rot) && al(kv) && al(k_rot);
    }
    if (vec)
      body<VEC_OK>(q_nope, qn_s0, qn_s1, q_rot, qr_s0, qr_s1, kv, kv_s0, k_rot, kr_s0, qs, L, ks, Lk, q0, kend, lp,
                   out, scale, smem);
    else
      body<false>(q_nope, qn_s0, qn_s1, q_rot, qr_s0, qr_s1, kv, kv_s0, k_rot, kr_s0, qs, L, ks, Lk, q0, kend, lp,
                  out, scale, smem);
  }
};

}  // namespace dsg
