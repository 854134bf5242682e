// The router logits at prefill sizes: logits [T, E] = x.float() @ gate.T in fp32, a register-tiled
// GEMM on CUDA cores (moe_route's first launch above GEMM_TOKENS; the GEMV of moe_router.cuh 1 below).
//
// Dimension legend: T tokens, D hidden, E routed experts.  Tiles: BM tokens x BN experts per CTA,
// BK of D staged per step, TM tokens x TN experts per thread, S splits of D (gridDim.z).
//
// Why a tile: the GEMV gives a CTA 2 experts x 8 tokens, so at T = 16384 each 8-token slice of x is
// read again by every one of the E / 2 expert-pair CTAs (~2.1 GB a layer at V2-Lite, 569 us).  Here
// a CTA owns BM tokens x BN experts (all 64 of V2-Lite's), so x is read cdiv(E, BN) times and the
// fp32 gate (E x D x 4 bytes) streams from L2; the work is 2 T E D flops on the FMA pipes.
//
// Grid (cdiv(E, BN), cdiv(T, BM), S); expert blocks of a token tile are neighbours in launch order
// (their x tile meets in L2).  CTA (bx, by, z) sums the tile's products over its share of the
// KT = cdiv(D, BK) slices: slices [z * cdiv(KT, S), ...).  S = 1: it writes the logits.  S > 1 (few
// tiles: the lowering splits D until the grid fills the SMs): each CTA writes its partial tile to
// the workspace, and the tile's CTA that arrives last (a ticket, tickets.cuh) adds the S partials in
// the order z = 0, 1, ..., S - 1 and writes the logits: the same sums whichever CTA finishes last.
//
// Numerics: within a split every output is one fp32 FMA chain over d ascending; then the splits'
// sum.  So the logits are x.float() @ gate.T up to the order of summation (fp32, never TF32: the
// top-k's ties and near-ties must stay where the reference has them), and experts whose gate rows
// are equal get bit-equal logits.
//
// Shared memory: two stages of [BM + BN rows][BK + 4 floats]: x converted to float as it is staged
// (once per element, not once per use) and the gate, both row-major as in global memory.  A row of
// BK + 4 floats (144 bytes at BK = 32) puts 4 or 8 consecutive rows' 16-byte words in distinct
// banks.  Thread (tx, ty) owns tokens ty + TY * i and experts tx + TX * j (i < TM, j < TN; TX = BN / TN,
// TY = BM / TM); a warp is 8 tx x 4 ty, so its 16-byte load of x reads 4 rows (each broadcast to 8
// lanes) and of the gate 8 rows: one wavefront each, for 4 TM TN FMAs per lane.
#pragma once
#include "moe_common.cuh"
#include "pdl.cuh"
#include "tickets.cuh"

namespace dsg {
namespace moe {

// Bytes of dynamic shared memory: two stages of (BM + BN) rows of BK + 4 floats.
template <int BM, int BN, int BK>
__host__ __device__ constexpr int router_gemm_smem() {
  return 2 * (BM + BN) * (BK + 4) * int(sizeof(float));
}

// VEC consecutive elements of T on their way from global to shared memory: loaded as one 16- or
// 8-byte word (or VEC elements), kept raw in registers while the current stage is computed, then
// converted to float and stored.  The staging registers are a uint4 / uint2, never a T array cast
// to one (moe_common.cuh's load_f explains why).
template <typename T, int VEC, int BYTES = int(sizeof(T)) * VEC>
struct Staged {
  T v[VEC];
  __device__ __forceinline__ void load(const T* __restrict__ p, bool ok) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = ok ? p[i] : from_float<T>(0.f);
  }
  __device__ __forceinline__ void store(float* s) const {
#pragma unroll
    for (int i = 0; i < VEC; ++i) s[i] = to_float(v[i]);
  }
};

// Converts the VEC elements in `raw` and stores them at s (16-byte aligned where VEC % 4 == 0,
// 8-byte where VEC == 2: the row stride and the column are multiples of VEC floats).
template <typename T, int VEC>
__device__ __forceinline__ void store_raw(const T* raw, float* s) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4)
      *reinterpret_cast<float4*>(s + i) =
          make_float4(to_float(raw[i]), to_float(raw[i + 1]), to_float(raw[i + 2]), to_float(raw[i + 3]));
  } else if constexpr (VEC == 2) {
    *reinterpret_cast<float2*>(s) = make_float2(to_float(raw[0]), to_float(raw[1]));
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) s[i] = to_float(raw[i]);
  }
}

template <typename T, int VEC>
struct Staged<T, VEC, 16> {
  uint4 v;
  __device__ __forceinline__ void load(const T* __restrict__ p, bool ok) {
    v = ok ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ void store(float* s) const { store_raw<T, VEC>(reinterpret_cast<const T*>(&v), s); }
};

template <typename T, int VEC>
struct Staged<T, VEC, 8> {
  uint2 v;
  __device__ __forceinline__ void load(const T* __restrict__ p, bool ok) {
    v = ok ? *reinterpret_cast<const uint2*>(p) : make_uint2(0u, 0u);
  }
  __device__ __forceinline__ void store(float* s) const { store_raw<T, VEC>(reinterpret_cast<const T*>(&v), s); }
};

// One operand's share of a stage: ROWS rows x BK columns, VEC-wide vectors, every thread PER of
// them (vector q = tid + NT * l: row q / CV, columns (q % CV) * VEC, CV = BK / VEC vectors a row:
// a warp loads whole BK-element runs of 32 / CV consecutive rows, and its stores spread evenly
// over the banks).  Rows >= `rows` and columns >= D are zeros (the tile's edges, D's last slice).
template <typename T, int ROWS, int BK, int NT, int VEC, int D>
struct StageLoader {
  static constexpr int CV = BK / VEC;
  static constexpr int PER = ROWS * CV / NT;
  static_assert(BK % VEC == 0 && (ROWS * CV) % NT == 0, "router GEMM: a stage must split evenly over the threads");
  Staged<T, VEC> r[PER];

  // `live`: false loads nothing (zeros), so the main loop's prefetch needs no branch.
  __device__ __forceinline__ void load(const T* __restrict__ base, int row0, int rows, int k0, bool live = true) {
#pragma unroll
    for (int l = 0; l < PER; ++l) {
      const int q = threadIdx.x + NT * l, row = q / CV, k = k0 + (q % CV) * VEC;
      const bool ok = live && row0 + row < rows && k < D;   // D % VEC == 0: a vector is all in or all out
      r[l].load(base + (i64)(ok ? row0 + row : 0) * D + (ok ? k : 0), ok);
    }
  }
  __device__ __forceinline__ void store(float* s, int ld) const {
#pragma unroll
    for (int l = 0; l < PER; ++l) {
      const int q = threadIdx.x + NT * l;
      r[l].store(s + (q / CV) * ld + (q % CV) * VEC);
    }
  }
};

// Pull this CTA's gate rows (its expert block, its split's share of D) into L2 before waiting for
// the previous kernel (weights: allowed before pdl_wait).  Token tile 0 only: every tile reads them.
template <int E, int D, int BN, int BK, int NT>
__device__ __forceinline__ void prefetch_gate_tile_l2(const float* __restrict__ gate) {
  constexpr int KT = (D + BK - 1) / BK;
  if (blockIdx.y != 0) return;
  const int per = (KT + gridDim.z - 1) / gridDim.z;
  const int d0 = min(D, (int)blockIdx.z * per * BK), d1 = min(D, d0 + per * BK);
  const int lines = (d1 - d0) > 0 ? ((d1 - d0) * 4 + 127) / 128 : 0;      // 128-byte lines per row
  const int e0 = blockIdx.x * BN;
  for (int i = threadIdx.x; i < BN * lines; i += NT) {
    const int r = i / lines, l = i % lines;
    if (e0 + r < E) {
      const char* p = reinterpret_cast<const char*>(gate + (i64)(e0 + r) * D + d0) + l * 128;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
  }
}

template <typename T, int E, int D, int BM, int BN, int BK, int TM, int TN, int NT, int XV, int GV, int TICKETS>
__device__ __forceinline__ void router_gemm_body(const T* __restrict__ x, const float* __restrict__ gate,
                                                 float* __restrict__ logits, float* __restrict__ partials,
                                                 int num_tokens, unsigned int* __restrict__ tickets, float* smem) {
  constexpr int TX = BN / TN, TY = BM / TM, LD = BK + 4, STAGE = (BM + BN) * LD;
  constexpr int KT = (D + BK - 1) / BK;
  static_assert(TX * TY == NT && TX % 8 == 0 && TY % 4 == 0, "router GEMM: a warp is 8 experts x 4 tokens of threads");
  static_assert(BK % 4 == 0 && (TM * TN) % 4 == 0, "router GEMM: 16-byte shared-memory and partial words");
  static_assert(2 * STAGE * int(sizeof(float)) == router_gemm_smem<BM, BN, BK>(), "router GEMM: shared memory");
  StageLoader<T, BM, BK, NT, XV, D> xl;
  StageLoader<float, BN, BK, NT, GV, D> gl;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tx = (warp % (TX / 8)) * 8 + (lane & 7), ty = (warp / (TX / 8)) * 4 + (lane >> 3);
  const int e0 = blockIdx.x * BN, t0 = blockIdx.y * BM;
  const int S = gridDim.z, z = blockIdx.z, per = (KT + S - 1) / S;
  const int kt0 = min(KT, z * per), kt1 = min(KT, kt0 + per);

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

  if (kt0 < kt1) {
    xl.load(x, t0, num_tokens, kt0 * BK);
    gl.load(gate, e0, E, kt0 * BK);
    xl.store(smem, LD);
    gl.store(smem + BM * LD, LD);
    __syncthreads();
    for (int kt = kt0; kt < kt1; ++kt) {
      // The next stage's loads, in flight while this one is computed (predicated, not branched
      // around: a branch let the compiler sink them below the FMAs).  After the last stage they
      // load nothing and store zeros to the idle buffer, which nothing reads again.
      const bool next = kt + 1 < kt1;
      const float* xs = smem + ((kt - kt0) & 1) * STAGE;
      const float* gs = xs + BM * LD;
      xl.load(x, t0, num_tokens, (kt + 1) * BK, next);
      gl.load(gate, e0, E, (kt + 1) * BK, next);
#pragma unroll
      for (int kk = 0; kk < BK; kk += 4) {
        float4 a[TM], b[TN];
#pragma unroll
        for (int i = 0; i < TM; ++i) a[i] = *reinterpret_cast<const float4*>(xs + (ty + TY * i) * LD + kk);
#pragma unroll
        for (int j = 0; j < TN; ++j) b[j] = *reinterpret_cast<const float4*>(gs + (tx + TX * j) * LD + kk);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) {
            acc[i][j] = fmaf(a[i].x, b[j].x, acc[i][j]);
            acc[i][j] = fmaf(a[i].y, b[j].y, acc[i][j]);
            acc[i][j] = fmaf(a[i].z, b[j].z, acc[i][j]);
            acc[i][j] = fmaf(a[i].w, b[j].w, acc[i][j]);
          }
      }
      float* ns = smem + ((kt + 1 - kt0) & 1) * STAGE;     // every thread left it at the last barrier
      xl.store(ns, LD);
      gl.store(ns + BM * LD, LD);
      __syncthreads();
    }
  }

  if (S > 1) {
    // This CTA's partial tile, thread by thread (TM * TN floats each, 16-byte words), then the
    // tile's last CTA adds all S in split order (its own from registers).
    const int tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
    constexpr int W = TM * TN;
    const auto slot = [&](int zz) {
      return reinterpret_cast<float4*>(partials + ((i64)(zz * tiles + tile) * NT + threadIdx.x) * W);
    };
    float4* mine = slot(z);
#pragma unroll
    for (int w = 0; w < W; w += 4)
      __stcg(mine + w / 4, make_float4(acc[w / TN][w % TN], acc[(w + 1) / TN][(w + 1) % TN],
                                       acc[(w + 2) / TN][(w + 2) % TN], acc[(w + 3) / TN][(w + 3) % TN]));
    if (!last_arrival(&tickets[tile], S)) return;
    float sum[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) sum[i][j] = 0.f;
    for (int zz = 0; zz < S; ++zz) {
      if (zz == z) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) sum[i][j] += acc[i][j];
      } else {
        const float4* p = slot(zz);
#pragma unroll
        for (int w = 0; w < W; w += 4) {
          const float4 v = __ldcg(p + w / 4);
          sum[w / TN][w % TN] += v.x;
          sum[(w + 1) / TN][(w + 1) % TN] += v.y;
          sum[(w + 2) / TN][(w + 2) % TN] += v.z;
          sum[(w + 3) / TN][(w + 3) % TN] += v.w;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = sum[i][j];
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int t = t0 + ty + TY * i;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int e = e0 + tx + TX * j;
      if (t < num_tokens && e < E) logits[(i64)t * E + e] = acc[i][j];
    }
  }
}

// The launch: PDL wait / trigger around the tile, 16- / 8-byte staging where x's and the gate's
// bases allow it (else element loads).  `partials`: the split workspace (S * tiles * NT * TM * TN
// floats; unused and possibly empty when S = 1); `tickets`: TICKETS counters, zero between
// launches.  The lowering splits only while the tiles fit the tickets; past that (uniform) the
// CTA exits with the logits unwritten rather than index past them.
template <typename T, int E, int D, int BM, int BN, int BK, int TM, int TN, int NT, int XV, int GV, int TICKETS>
__device__ __forceinline__ void router_gemm(const T* __restrict__ x, const float* __restrict__ gate,
                                            float* __restrict__ logits, float* __restrict__ partials, int num_tokens,
                                            unsigned int* __restrict__ tickets, float* smem) {
  prefetch_gate_tile_l2<E, D, BN, BK, NT>(gate);
  pdl_wait();
  pdl_launch_dependents();
  if (gridDim.z > 1 && gridDim.x * gridDim.y > TICKETS) return;
  if constexpr (XV > 1 || GV > 1) {
    if (aligned_to<vec_align<T, XV>()>(x) && aligned_to<vec_align<float, GV>()>(gate)) {
      router_gemm_body<T, E, D, BM, BN, BK, TM, TN, NT, XV, GV, TICKETS>(x, gate, logits, partials, num_tokens,
                                                                         tickets, smem);
      return;
    }
  }
  router_gemm_body<T, E, D, BM, BN, BK, TM, TN, NT, 1, 1, TICKETS>(x, gate, logits, partials, num_tokens, tickets,
                                                                   smem);
}

}  // namespace moe
}  // namespace dsg
