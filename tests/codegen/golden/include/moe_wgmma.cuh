// 4d. The grouped expert GEMM on Hopper's wgmma + TMA (sm_90a): experts with many pairs (prefill).
// Same contract as grouped_gemm (moe_grouped.cuh 4b): pairs grouped by expert through the routing
// `order` / `offsets`, the same outputs rounded at the same points, no host sync.  It differs in
// how a tile is fed and multiplied:
//   * a persistent grid (one CTA per SM) walks tiles t = blockIdx.x, + gridDim.x, ...; tile t is
//     (row tile t / NCT, column tile t % NCT), the row tiles numbered over the experts in order
//     (a table built from `offsets` in shared memory at the start), so the CTAs that run at one
//     time share one expert's weights (in L2) and its gathered rows;
//   * warp-specialised: warpgroup 0 produces (registers given back with setmaxnreg), warpgroups 1
//     and 2 consume, each 64 of the tile's 128 pairs against all of its 256 weight rows, through
//     a ring of ST stages handshaken on mbarriers (full: the stage has landed; empty: both
//     consumers are done with it);
//   * a stage is one 64-wide K slice: the 256 weight rows as two TMA boxes of 128 rows (128B
//     swizzle) from one tensor map per weight tensor [E, N, KD]; the 128 pair rows GATHERED
//     through `order` by the producer's 128 threads with 16-byte cp.async into the same swizzled
//     layout (TMA on Hopper cannot gather rows), each thread's copies reported to the stage's
//     mbarrier when they land (cp.async.mbarrier.arrive.noinc);
//   * one wgmma m64n256k16 per 16 of K per consumer; fp32 accumulators, 128 a thread;
//   * the epilogue rounds 128 output columns at a time into the consumer's own 16 KB of shared
//     memory and stores whole 16-byte chunks of rows (the scattered 4-byte stores it replaced cost
//     DOWN a fifth of its time on the H200); SiLU with __expf / __fdividef (exact expf: +8%);
// Weight rows of a tile: GATE_UP*: gate rows n0 .. n0 + 128, then up rows n0 .. n0 + 128, so a
// thread's accumulators for column j < 16 (gate) and j + 16 (up) are the same output column and
// SiLU * up fuses in registers.  DOWN: weight rows n0 .. n0 + 256.
//
// Needs 16-bit T and KD % 8 == 0 (16-byte rows: TMA strides and cp.async); the lowering emits it
// only then (codegen/families/_moe_wgmma.py).  An x base that is not 16-byte aligned takes
// element loads (same layout, same barriers); an output base that is not 4-byte aligned takes
// element stores.  Weight bases must be 16-byte aligned (the runtime refuses to encode others).
#pragma once
#include "moe_grouped.cuh"
#include "mbarrier.cuh"
#include "pdl.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace dsg {
namespace moe {

constexpr int WG_BM = 128;            // pairs per tile: two consumer warpgroups x 64
constexpr int WG_BN = 256;            // weight rows per tile
constexpr int WG_BK = 64;             // K slice: one 128-byte swizzled row of 16-bit elements
constexpr int WG_BOX = 128;           // weight rows per TMA box (box dims are at most 256)
constexpr int WG_THREADS = 384;       // producer warpgroup + two consumer warpgroups
constexpr int WG_PRODUCER_REGS = 56, WG_CONSUMER_REGS = 224;   // 128 x 56 + 256 x 224 <= 64K
constexpr int WG_ROW_BYTES = WG_BK * 2;                         // 128: the swizzle span
constexpr int WG_STAGE_BYTES = (WG_BM + WG_BN) * WG_ROW_BYTES;  // 48 KB
// The epilogue goes through shared memory: a consumer rounds 128 output columns of its 64 rows
// into its own staging area (16 KB), then stores whole 16-byte chunks of rows.
constexpr int WG_OUT_COLS = 128;
constexpr int WG_OUT_ROW_BYTES = WG_OUT_COLS * 2;               // 256: 16 chunks of 16 bytes
constexpr int WG_OUT_BYTES = 64 * WG_OUT_ROW_BYTES;             // 16 KB a consumer warpgroup
static_assert(WG_PRODUCER_REGS * 128 + WG_CONSUMER_REGS * 256 <= 65536, "wgmma gemm: register file");

// Output columns a tile covers.
__host__ __device__ constexpr int wgmma_tile_cols(int mode) { return mode == DOWN ? WG_BN : WG_BN / 2; }
// Dynamic shared memory: the ring, the two consumers' output staging, plus slack to start the ring
// on a 1024-byte boundary (128B swizzle).  4 stages: 225 KB of the 227 KB a CTA may have.
__host__ __device__ constexpr int wgmma_smem(int stages) { return stages * WG_STAGE_BYTES + 2 * WG_OUT_BYTES + 1024; }

struct WgTile {
  int e, pbeg, rows, n0;
};

// tiles[e] = row tiles of experts before e (cdiv(pairs, BM) each), tiles[E] = all of them.
// Warp 0 scans 32 experts a round.  (BM: the decode tiles of moe_wgmma_skinny.cuh hold 64 pairs.)
// L2_ONLY: `offsets` read through L2 (ld.global.cg), for a caller that reads them before its
// pdl_wait (pdl.cuh: what the kernel two launches back wrote), where no L1 line may answer.
template <int E, int BM = WG_BM, bool L2_ONLY = false>
__device__ __forceinline__ void wgmma_row_tiles(const i32* __restrict__ offsets, int* tiles) {
  const int lane = threadIdx.x & 31;
  auto ld = [&](int i) { return L2_ONLY ? __ldcg(offsets + i) : offsets[i]; };
  int base = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const int nt = (e < E) ? (ld(e + 1) - ld(e) + BM - 1) / BM : 0;
    int incl = nt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (e < E) tiles[e] = base + incl - nt;
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) tiles[E] = base;
}

// The expert of row tile rt: the last e with tiles[e] <= rt, which has pairs (an expert without
// pairs has tiles[e] == tiles[e + 1]).  Shared memory only.
template <int E>
__device__ __forceinline__ int wgmma_tile_expert(const int* tiles, int rt) {
  int lo = 0, hi = E;                   // tiles[lo] <= rt < tiles[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tiles[mid] <= rt) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Tile t of the walk (t < tiles[E] * NCT): row tile t / NCT of wgmma_tile_expert, column tile t % NCT.
template <int E, int NCT, int BNO, int BM = WG_BM>
__device__ __forceinline__ WgTile wgmma_tile(const int* tiles, const i32* __restrict__ offsets, int t) {
  const int rt = t / NCT;
  const int lo = wgmma_tile_expert<E>(tiles, rt);
  WgTile tl;
  tl.e = lo;
  tl.pbeg = offsets[lo] + (rt - tiles[lo]) * BM;
  tl.rows = min(BM, offsets[lo + 1] - tl.pbeg);
  tl.n0 = (t % NCT) * BNO;
  return tl;
}

// A 16-bit element through L2 (ld.global.cg): the gathered rows may have been written by another
// CTA of the same launch (moe_expert_ffn.cuh's down tiles), which no L1 line of this SM may answer.
template <typename T>
__device__ __forceinline__ T ld_cg(const T* p) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return *reinterpret_cast<const T*>(&bits);
}

// One stage's gathered rows of a producer thread: 16-byte chunk kc .. kc + 8 of x rows src[i]
// (-1: zeros) into tile rows r0 + 16 i, whose chunk positions share one swizzle (dst is row r0's).
// VEC: 16-byte cp.async (x 16-byte aligned; .cg: through L2); else element loads through L2 and
// a 16-byte shared store.
template <typename T, int KD, bool VEC, int R>
__device__ __forceinline__ void wgmma_gather(const T* __restrict__ x, const int (&src)[R], int kc, char* dst) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const bool ok = src[i] >= 0 && kc < KD;              // else zeros: rows past the tile, K past KD
    const T* from = x + (ok ? (i64)src[i] * KD + kc : 0);
    char* to = dst + i * 16 * WG_ROW_BYTES;
    if constexpr (VEC) {
      dsg::mma::cp_async16(to, from, ok ? 16 : 0);
    } else {
      uint4 raw;
      T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = ok ? ld_cg(from + j) : from_float<T>(0.f);
      *reinterpret_cast<uint4*>(to) = raw;
    }
  }
}

// One staged 16-byte chunk (8 elements) of an output row, at column `col` of N, to dst: whole
// (vec: N % 8 == 0 and a 16-byte aligned base, so the chunk lies inside the row) or element by
// element up to N.  The epilogues that go through shared memory end here (moe_wgmma_skinny.cuh's too).
template <typename T, int N>
__device__ __forceinline__ void store_chunk(T* dst, const uint4& chunk, int col, bool vec) {
  if (vec) {
    *reinterpret_cast<uint4*>(dst) = chunk;
  } else {
    const T* e = reinterpret_cast<const T*>(&chunk);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (col + k < N) dst[k] = e[k];
  }
}

// The ring's barriers (thread 0; the caller's __syncthreads publishes them): full[s] awaits the
// producer's 128 copy arrivals + its expect_tx, empty[s] one arrival per consumer warp.
template <int ST>
__device__ __forceinline__ void wgmma_ring_init(unsigned long long* full, unsigned long long* empty,
                                                int consumer_warps) {
#pragma unroll
  for (int s = 0; s < ST; ++s) {
    mbar::init(&full[s], 128 + 1);
    mbar::init(&empty[s], consumer_warps);
  }
  mbar::init_fence();
}

// Where a tile's pieces sit, for the producer below: pairs per row tile (BM), weight rows per TMA
// box (BOX, two boxes a stage), output columns per tile by mode, and a stage's layout (its
// gathered pair rows at ROWS_AT, its weight boxes at WEIGHTS_AT, both 1024-byte aligned; a weight
// row of a box W_ROW_BYTES: one 64-wide K slice).  The prefill GEMM's; moe_wgmma_skinny.cuh has
// decode's, moe_fp8.cuh decode's with FP8 weights.
struct WgPrefillTiles {
  static constexpr int BM = WG_BM, BOX = WG_BOX, STAGE_BYTES = WG_STAGE_BYTES;
  static constexpr int ROWS_AT = 0, WEIGHTS_AT = WG_BM * WG_ROW_BYTES, W_ROW_BYTES = WG_ROW_BYTES;
  static constexpr bool W_EVICT_FIRST = false;   // (L2's default: a prefill's row tiles share weight boxes)
  __host__ __device__ static constexpr int cols(int mode) { return wgmma_tile_cols(mode); }
};

// One stage's weight boxes (thread 0 of the producer): the K slice at k0 of the tile's weight
// rows from n0, as one or two TMA boxes, announced to the stage's full barrier.  DOWN's second box
// starts past N when N - n0 <= BOX: left out (its accumulator columns are >= N and never stored),
// so no box lies wholly outside the tensor.
template <int MODE, int N, typename L>
__device__ __forceinline__ void wgmma_issue_weights(char* b, const TensorMap* w0, const TensorMap* w1, int k0, int n0,
                                                    int e, unsigned long long* full_s) {
  const bool box1 = MODE != DOWN || n0 + L::BOX < N;
  mbar::arrive_expect_tx(full_s, (box1 ? 2 : 1) * L::BOX * L::W_ROW_BYTES);
  const unsigned long long pol = L::W_EVICT_FIRST ? l2::evict_first() : 0ull;
  auto box = [&](char* dst, const TensorMap* w, int n) {
    if constexpr (L::W_EVICT_FIRST) tma::load_3d(dst, w, k0, n, e, full_s, pol);
    else tma::load_3d(dst, w, k0, n, e, full_s);
  };
  box(b, w0, n0);
  if (box1) box(b + L::BOX * L::W_ROW_BYTES, MODE == DOWN ? w0 : w1, MODE == DOWN ? n0 + L::BOX : n0);
}

// The source row of each of a producer thread's tile rows r0 + 16 i (-1: none): the pair's x row
// (pair / K) for the gate_up modes, the pair's own row of `a` for DOWN.
template <int MODE, int K, int R>
__device__ __forceinline__ void wgmma_pair_rows(const i32* __restrict__ order, const WgTile& tl, int r0,
                                                int (&src)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = r0 + 16 * i;
    const int pr = r < tl.rows ? order[tl.pbeg + r] : -1;
    src[i] = pr < 0 ? -1 : (MODE == DOWN ? pr : pr / K);
  }
}

// A producer thread's part of one stage's gathered rows (wgmma_gather into dst), announced to the
// stage's full barrier: as its cp.async copies land (vec), or after plain stores made visible to
// the async proxy that wgmma reads through.
template <typename T, int KD, int R>
__device__ __forceinline__ void wgmma_gather_slice(const T* __restrict__ x, const int (&src)[R], int kc, char* dst,
                                                   bool vec, unsigned long long* full_s) {
  if (vec) {
    wgmma_gather<T, KD, true, R>(x, src, kc, dst);
    mbar::arrive_on_cp_async(full_s);
  } else {
    wgmma_gather<T, KD, false>(x, src, kc, dst);
    mbar::fence_proxy_async();                           // plain stores, read next by wgmma (async proxy)
    mbar::arrive(full_s);
  }
}

// Producer: the 128 threads of warpgroup 0, one tile from ring position `it` (advanced past the
// tile's last slice).  Thread p copies 16-byte chunk p % 8 of tile rows p / 8 + 16 i (i < BM / 16):
// a warp covers four whole 128-byte row slices per instruction; all its rows share r % 8, so one
// swizzled chunk position.  Thread 0 also issues the weight boxes, except those of the tile's
// first `pre` slices (issued already, after their empty waits: wgmma_issue_free, or before
// pdl_wait by the caller).  VEC: x 16-byte aligned (cp.async), else element loads through L2.
// `at_slice(kt, KT)`: called by every producer thread as it starts slice kt of the tile's KT
// (moe_expert_ffn.cuh takes its next tile there); by default nothing.
struct NoSliceHook {
  __device__ void operator()(int, int) const {}
};
template <typename T, int MODE, int N, int KD, int K, int ST, typename L, typename H = NoSliceHook>
__device__ __forceinline__ void wgmma_produce_tile(const T* __restrict__ x, const TensorMap* w0, const TensorMap* w1,
                                                   const i32* __restrict__ order, const WgTile& tl, char* ring,
                                                   unsigned long long* full, unsigned long long* empty, bool vec,
                                                   int& it, int pre = 0, H at_slice = H{}) {
  constexpr int KT = (KD + WG_BK - 1) / WG_BK;
  const int p = threadIdx.x, c = p & 7, r0 = p >> 3;
  const int chunk = (c ^ (r0 & 7)) * 16;                 // 128B swizzle: c ^ (row % 8)
  int src[L::BM / 16];                                   // x row of each of this thread's tile rows, -1: none
  wgmma_pair_rows<MODE, K>(order, tl, r0, src);
  for (int kt = 0; kt < KT; ++kt, ++it) {
    at_slice(kt, KT);
    const int s = it % ST;
    mbar::wait(&empty[s], ((it / ST) & 1) ^ 1);
    char* a = ring + s * L::STAGE_BYTES + L::ROWS_AT;
    char* b = ring + s * L::STAGE_BYTES + L::WEIGHTS_AT;
    const int k0 = kt * WG_BK;
    if (p == 0 && kt >= pre) wgmma_issue_weights<MODE, N, L>(b, w0, w1, k0, tl.n0, tl.e, &full[s]);
    wgmma_gather_slice<T, KD, L::BM / 16>(x, src, k0 + 8 * c, a + r0 * WG_ROW_BYTES + chunk, vec, &full[s]);
  }
}

// Thread 0 of the producer: the weight boxes of a tile's first slices from ring position `it`
// (not advanced) whose stages are free now, in order, at most `most`, ahead of the tile's pair
// rows; returns how many (wgmma_produce_tile's `pre`, which then gathers their rows).  It never
// blocks: a stage still in use ends it.  The other producer threads wait on those empty barriers
// later at the same parity: a stage cannot be freed again before they fill it.
template <int MODE, int N, int ST, typename L>
__device__ __forceinline__ int wgmma_issue_free(const TensorMap* w0, const TensorMap* w1, const WgTile& tl,
                                                char* ring, unsigned long long* full, unsigned long long* empty,
                                                int it, int most) {
  int kt = 0;
  for (; kt < most; ++kt) {
    const int s = (it + kt) % ST;
    if (!mbar::test(&empty[s], (((it + kt) / ST) & 1) ^ 1)) break;
    wgmma_issue_weights<MODE, N, L>(ring + s * L::STAGE_BYTES + L::WEIGHTS_AT, w0, w1, kt * WG_BK, tl.n0, tl.e,
                                    &full[s]);
  }
  return kt;
}

// Producer: the persistent walk of tiles t = blockIdx.x, + gridDim.x, ...; the walk's first tile
// has its first `preissued` slices' weights issued already (before pdl_wait by the caller); its
// first `skip` tiles were produced already (moe_wgmma_skinny.cuh's shared tile before the wait).
template <typename T, int MODE, int E, int N, int KD, int K, int ST, typename L = WgPrefillTiles>
__device__ __forceinline__ void wgmma_produce(const T* __restrict__ x, const TensorMap* w0, const TensorMap* w1,
                                              const i32* __restrict__ order, const i32* __restrict__ offsets,
                                              const int* tiles, char* ring, unsigned long long* full,
                                              unsigned long long* empty, int preissued = 0, int skip = 0) {
  constexpr int BNO = L::cols(MODE), NCT = (N + BNO - 1) / BNO;
  const bool vec = aligned_to<16>(x);                    // uniform: cp.async, else element loads
  if (threadIdx.x == 0) {
    tma::prefetch(w0);
    if (MODE != DOWN) tma::prefetch(w1);
  }
  const int total = tiles[E] * NCT;
  int it = skip * ((KD + WG_BK - 1) / WG_BK);
  for (int t = blockIdx.x + skip * gridDim.x; t < total; t += gridDim.x) {
    const WgTile tl = wgmma_tile<E, NCT, BNO, L::BM>(tiles, offsets, t);
    wgmma_produce_tile<T, MODE, N, KD, K, ST, L>(x, w0, w1, order, tl, ring, full, empty, vec, it,
                                                 t == (int)blockIdx.x ? preissued : 0);
  }
  dsg::mma::cp_async_wait<0>();                          // nothing of this thread's left in flight at exit
}

// Consumer warpgroup cw (0, 1): tile rows 64 cw .. + 64 against all 256 weight rows.
template <typename T, int MODE, int E, int N, int KD, int ST>
__device__ __forceinline__ void wgmma_consume(const i32* __restrict__ order, const i32* __restrict__ offsets,
                                              const int* tiles, unsigned ring, unsigned long long* full,
                                              unsigned long long* empty, char* staging, T* __restrict__ out0,
                                              T* __restrict__ out1, int cw) {
  constexpr bool BF16 = dsg::mma::MmaType<T>::BF16;
  constexpr int BNO = wgmma_tile_cols(MODE), NCT = (N + BNO - 1) / BNO, KT = (KD + WG_BK - 1) / WG_BK;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, tid = threadIdx.x & 127;
  // 16-byte row chunks where rows are whole chunks and the bases allow them (uniform), else elements.
  const bool vec = N % 8 == 0 && aligned_to<16>(out0) && aligned_to<16>(out1);
  const int total = tiles[E] * NCT;
  float acc[128];
  int it = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const WgTile tl = wgmma_tile<E, NCT, BNO>(tiles, offsets, t);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    wgmma::fence_operands(acc);
    for (int kt = 0; kt < KT; ++kt, ++it) {
      const int s = it % ST;
      mbar::wait(&full[s], (it / ST) & 1);
      mbar::fence_proxy_async();                         // the gathered rows were cp.async (generic) writes
      const unsigned a = ring + s * WG_STAGE_BYTES + cw * 64 * WG_ROW_BYTES;
      const unsigned b = ring + s * WG_STAGE_BYTES + WG_BM * WG_ROW_BYTES;
      const unsigned long long da = wgmma::desc_sw128(a), db = wgmma::desc_sw128(b);
      wgmma::fence();
#pragma unroll
      for (int k16 = 0; k16 < WG_BK / 16; ++k16)
        wgmma::mma_m64n256k16<BF16>(acc, wgmma::desc_advance(da, k16), wgmma::desc_advance(db, k16));
      wgmma::commit();
      wgmma::wait<1>();                                  // the slice before this one is read: free it
      if (kt > 0 && lane == 0) mbar::arrive(&empty[(it - 1) % ST]);
    }
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
    if (lane == 0) mbar::arrive(&empty[(it - 1) % ST]);

    // Epilogue: acc[4j + 2h + c] is tile row 64 cw + 16 warp + lane / 4 + 8h, column 8j + 2 (lane % 4) + c.
    // Row-scattered 4-byte stores straight from the accumulators took ~4 us a tile (a fifth of
    // DOWN's time on the H200): each pass rounds 128 columns into this warpgroup's staging rows,
    // 16-byte chunk j of row r at chunk j ^ (r % 8) (conflict-free writes and reads), then each
    // thread stores whole chunks: thread tid takes chunk tid % 16 of rows tid / 16 + 8 i.
    int orow[8];                                         // output row of those rows, -1: past the tile
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = cw * 64 + (tid >> 4) + 8 * i;
      orow[i] = r < tl.rows ? order[tl.pbeg + r] : -1;
    }
    constexpr int PASSES = (MODE == GATE_UP_SILU) ? 1 : 2;   // DOWN: columns 0-127, 128-255; GATE_UP: gate, up
#pragma unroll
    for (int q = 0; q < PASSES; ++q) {
      wgmma::warpgroup_sync(1 + cw);                     // the last pass's chunks have all been read
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = warp * 16 + (lane >> 2) + 8 * h;
        char* row = staging + rr * WG_OUT_ROW_BYTES + 4 * (lane & 3);
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
          const int a = (MODE == GATE_UP_SILU ? 0 : 64 * q) + 4 * jj + 2 * h;   // DOWN: column 128 q + ...; GATE_UP: up
          float v[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            if constexpr (MODE == GATE_UP_SILU) {
              // silu(g) * u rounded where the unfused ops round; __expf / __fdividef: fast SiLU
              // (an fp32 ulp or two; 1 / (1 + inf) -> 0 as silu's limit wants)
              const float gr = round_to<T>(acc[a + c]), ur = round_to<T>(acc[64 + a + c]);
              v[c] = round_to<T>(__fdividef(gr, 1.f + __expf(-gr))) * ur;
            } else {
              v[c] = acc[a + c];
            }
          }
          struct alignas(4) Pair { T lo, hi; } pr = {from_float<T>(v[0]), from_float<T>(v[1])};
          *reinterpret_cast<Pair*>(row + ((jj ^ (rr & 7)) << 4)) = pr;
        }
      }
      wgmma::warpgroup_sync(1 + cw);                     // the staging rows are whole
      T* out = (MODE == GATE_UP && q == 1) ? out1 : out0;
      const int col = tl.n0 + (MODE == DOWN ? WG_OUT_COLS * q : 0) + 8 * (tid & 15);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = (tid >> 4) + 8 * i;
        if (orow[i] < 0 || col >= N) continue;
        const uint4 chunk = *reinterpret_cast<const uint4*>(staging + r * WG_OUT_ROW_BYTES + (((tid & 15) ^ (r & 7)) << 4));
        store_chunk<T, N>(out + (i64)orow[i] * N + col, chunk, col, vec);
      }
    }
  }
}

template <typename T, int MODE, int E, int N, int KD, int K, int ST>
__device__ __forceinline__ void grouped_gemm_wgmma(const T* __restrict__ x, const TensorMap* w0, const TensorMap* w1,
                                                   const i32* __restrict__ order, const i32* __restrict__ offsets,
                                                   T* __restrict__ out0, T* __restrict__ out1, char* smem) {
  static_assert(sizeof(T) == 2, "wgmma gemm: 16-bit operands");
  static_assert(KD % 8 == 0, "wgmma gemm: rows of whole 16-byte chunks (TMA strides, cp.async)");
  static_assert(ST >= 2, "wgmma gemm: a ring of at least two stages");
  static_assert(wgmma_smem(ST) + 2 * ST * 8 + 4 * (E + 1) <= 227 * 1024,
                "wgmma gemm: ring + staging + row-tile table exceed a CTA's 227 KB (_moe_wgmma.fits)");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST];
  __shared__ int tiles[E + 1];
  // Every read below (offsets, order, x) is of another kernel's output.
  dsg::pdl_wait();
  const unsigned raw = smem_u32(smem);
  const unsigned ring = (raw + 1023u) & ~1023u;         // 128B-swizzle tiles start on 1024-byte boundaries
  if (threadIdx.x < 32) wgmma_row_tiles<E>(offsets, tiles);
  if (threadIdx.x == 0) wgmma_ring_init<ST>(full, empty, 8);   // two consumer warpgroups
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    wgmma::setmaxnreg_dec<WG_PRODUCER_REGS>();
    wgmma_produce<T, MODE, E, N, KD, K, ST>(x, w0, w1, order, offsets, tiles, smem + (ring - raw), full, empty);
  } else {
    wgmma::setmaxnreg_inc<WG_CONSUMER_REGS>();
    char* staging = smem + (ring - raw) + ST * WG_STAGE_BYTES + (wg - 1) * WG_OUT_BYTES;
    wgmma_consume<T, MODE, E, N, KD, ST>(order, offsets, tiles, ring, full, empty, staging, out0, out1, wg - 1);
  }
  dsg::pdl_launch_dependents();
}

}  // namespace moe
}  // namespace dsg
