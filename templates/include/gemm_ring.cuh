// The pieces of a persistent one-byte-operand wgmma GEMM (sm_90a) that do not depend on the operand
// type: its tile, the mbarrier ring, the producer warpgroup and the epilogue's staged 16-byte stores.
// gemm_int8.cuh (int8 x int8 -> int32) and gemm_fp8.cuh (e4m3 x e4m3 -> fp32, and through it the
// grouped experts of moe_gemm_fp8.cuh) build on it.
//
//   * a persistent grid walks work items i = cta, + ctas, ...: tile t = i % tiles, row tile t / NCT
//     (BM tokens), column tile t % NCT, so the CTAs running together share the tokens' row tile; K split
//     i / tiles of `splits` (gemm_split.cuh; 1: the whole of K, item = tile).  cta / ctas: blockIdx.x /
//     gridDim.x (WholeGrid), or the CTA's place among its part's CTAs where one launch runs several GEMMs
//     (PartGrid, gemm_multi.cuh);
//   * warpgroup 0 produces (registers given back with setmaxnreg), warpgroups 1 and 2 consume, each
//     64 of the tile's 128 tokens against its 128 weight rows, through a ring of ST stages handshaken
//     on mbarriers (full: landed; empty: both consumers are done with it);
//   * a stage is 128 bytes of K a row: the 128B swizzle wgmma reads.  The weight rows as two TMA boxes
//     of 64 rows (the second left out where it would start past O); the token rows by the producer's
//     128 threads with 16-byte cp.async into the same swizzled layout (their address changes with T
//     every call, so no tensor map of them is encoded on the host), reported to the stage's barrier;
//   * LINEAR tiles hold 128 weight rows; SILU tiles 64 gate rows then the same 64 up rows, so a
//     consumer thread's accumulator column j < 8 (gate) and j + 8 (up) are one output column;
//   * the epilogue rounds a tile into its consumer's 16 KB of staging and stores whole 16-byte chunks.
#pragma once
#include "common.cuh"
#include "gemm_split.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace dsg {
namespace gemm_ring {

constexpr int LINEAR = 0, SILU = 1;
constexpr int BM = 128;               // tokens per tile: two consumer warpgroups x 64
constexpr int BN = 128;               // weight rows per tile
constexpr int BK = 128;               // K bytes per stage: one 128-byte swizzled row
constexpr int BOX = 64;               // weight rows per TMA box, two a stage
constexpr int THREADS = 384;          // producer warpgroup + two consumer warpgroups
constexpr int ROW_BYTES = BK;                           // 128: the swizzle span
constexpr int STAGE_BYTES = (BM + BN) * ROW_BYTES;      // 32 KB
constexpr int OUT_ROW_BYTES = 128 * 2;                  // a staged row: up to 128 16-bit columns
constexpr int OUT_BYTES = 64 * OUT_ROW_BYTES;           // 16 KB a consumer warpgroup

// The CTAs that walk one GEMM's work items: the whole grid (a launch of one GEMM) -- read where the walk
// reads them, so that its machine code is that of a walk over blockIdx.x / gridDim.x ...
struct WholeGrid {
  __device__ __forceinline__ int cta() const { return blockIdx.x; }
  __device__ __forceinline__ int ctas() const { return gridDim.x; }
};
// ... or one part's CTAs of a launch of several (gemm_multi.cuh): CTA `first` of `count`.
struct PartGrid {
  int first, count;
  __device__ __forceinline__ int cta() const { return first; }
  __device__ __forceinline__ int ctas() const { return count; }
};

// Output columns a tile covers.
__host__ __device__ constexpr int tile_cols(int mode) { return mode == SILU ? BN / 2 : BN; }
// Dynamic shared memory: the ring, the two consumers' staging, and slack to start the ring on a
// 1024-byte boundary (128B swizzle).
__host__ __device__ constexpr int smem_bytes(int stages) { return stages * STAGE_BYTES + 2 * OUT_BYTES + 1024; }
// Tiles of a launch over num_tokens tokens and O output columns.
__host__ __device__ constexpr int num_tiles(int num_tokens, int mode, int O) {
  return (num_tokens + BM - 1) / BM * ((O + tile_cols(mode) - 1) / tile_cols(mode));
}

// One staged 16-byte chunk (8 columns from `col`) of an output row to dst: whole where vec (O % 8 == 0
// and a 16-byte aligned base), else element by element up to O.
template <typename T, int O>
__device__ __forceinline__ void store_chunk(T* dst, const uint4& chunk, int col, bool vec) {
  if (vec) {
    *reinterpret_cast<uint4*>(dst) = chunk;
  } else {
    const T* e = reinterpret_cast<const T*>(&chunk);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (col + k < O) dst[k] = e[k];
  }
}

// The ring's barriers (thread 0; the caller's __syncthreads publishes them): full[s] awaits the
// producer's 128 copy arrivals + its expect_tx, empty[s] one arrival per consumer warp of each of the
// CTAS CTAs whose consumers read the stage's multicast weights (1: this CTA's alone).
template <int ST, int CTAS = 1>
__device__ __forceinline__ void ring_init(unsigned long long* full, unsigned long long* empty) {
#pragma unroll
  for (int s = 0; s < ST; ++s) {
    mbar::init(&full[s], 128 + 1);
    mbar::init(&empty[s], 8 * CTAS);
  }
  mbar::init_fence();
}

// Consumer warpgroup cw's operands of ring step `it`'s stage, once landed: its 64 token rows (a) and the
// 128 weight rows (b) as 128B-swizzle wgmma descriptors, the wgmma fence issued.
struct StageDescs {
  unsigned long long a, b;
};
template <int ST>
__device__ __forceinline__ StageDescs landed_stage(unsigned ring, unsigned long long* full, int it, int cw) {
  const int s = it % ST;
  mbar::wait(&full[s], (it / ST) & 1);
  mbar::fence_proxy_async();                           // the token rows were cp.async (generic) writes
  const unsigned a = ring + s * STAGE_BYTES + cw * 64 * ROW_BYTES;
  const unsigned b = ring + s * STAGE_BYTES + BM * ROW_BYTES;
  const StageDescs d = {wgmma::desc_sw128(a), wgmma::desc_sw128(b)};
  wgmma::fence();
  return d;
}

// Which part of the producer's work a call does.  ALL: the whole of it.  AHEAD (Tuning.linear.gemm_weights_early;
// thread 0 alone, before pdl_wait): the weight boxes of the first min(ST, the CTA's ring steps) steps only --
// the steps a fresh ring admits with no empty-barrier wait -- so that the weights' DRAM round trip overlaps the
// kernel before (weights, which no kernel writes: pdl.cuh; num_tokens and splits are launch arguments).
// AFTER_AHEAD (after the wait): the rest, the token rows of those first steps included.
enum Part { ALL, AHEAD, AFTER_AHEAD };

// Producer: the 128 threads of warpgroup 0.  Token rows of q [T, QROW] bytes (QROW % 16 == 0, its
// first K bytes the row's); thread p copies 16-byte chunk p % 8 of token rows p / 8 + 16 j (j < 8):
// a warp covers four whole 128-byte row slices per instruction, and all of a thread's rows share
// r % 8, so one swizzled chunk position.  Bytes past K and rows past T land as zeros (as TMA fills
// the weight's box past K and past O).  Thread 0 also issues the weight boxes.  A work item's stages
// are its split's K blocks.  PART: which of this work the call does (Part).  grid: the CTAs of the walk
// (WholeGrid, PartGrid).
template <int MODE, int O, int K, int QROW, int ST, int PART = ALL, typename G = WholeGrid>
__device__ __forceinline__ void produce(const unsigned char* __restrict__ q, const TensorMap* w0, const TensorMap* w1,
                                        int num_tokens, int splits, char* ring, unsigned long long* full,
                                        unsigned long long* empty, G grid) {
  static_assert(QROW % 16 == 0 && QROW >= K, "gemm_ring: token rows of whole 16-byte chunks");
  constexpr int KB = (K + BK - 1) / BK, NCT = (O + tile_cols(MODE) - 1) / tile_cols(MODE);
  const int p = threadIdx.x, c = p & 7, r0 = p >> 3;
  const int chunk = (c ^ (r0 & 7)) * 16;               // 128B swizzle: c ^ (row % 8)
  if (p == 0) {
    tma::prefetch(w0);
    if (MODE == SILU) tma::prefetch(w1);
  }
  const int tiles = num_tiles(num_tokens, MODE, O);
  int it = 0;
  for (int i = grid.cta(); i < tiles * splits; i += grid.ctas()) {
    const gemm_split::Item w = gemm_split::item_of(i, tiles);
    const gemm_split::KRange kr = gemm_split::k_range(w.split, splits, KB);
    const int m0 = w.tile / NCT * BM, n0 = w.tile % NCT * tile_cols(MODE);
    // the second LINEAR box starts past O when O - n0 <= BOX: left out (its columns are never
    // stored), so no box lies wholly outside the tensor
    const bool box1 = MODE == SILU || n0 + BOX < O;
    for (int kb = kr.first; kb < kr.end; ++kb, ++it) {
      if constexpr (PART == AHEAD) {
        if (it == ST) return;
      }
      const int s = it % ST;
      if constexpr (PART != AHEAD) mbar::wait(&empty[s], ((it / ST) & 1) ^ 1);
      char* a = ring + s * STAGE_BYTES;
      char* b = a + BM * ROW_BYTES;
      const int k0 = kb * BK;
      if (p == 0 && (PART == ALL || (PART == AHEAD) == (it < ST))) {
        mbar::arrive_expect_tx(&full[s], (box1 ? 2 : 1) * BOX * ROW_BYTES);
        tma::load_2d(b, w0, k0, n0, &full[s]);
        if (box1) tma::load_2d(b + BOX * ROW_BYTES, MODE == SILU ? w1 : w0, k0, MODE == SILU ? n0 : n0 + BOX, &full[s]);
      }
      if constexpr (PART == AHEAD) continue;
      const int kc = k0 + 16 * c;                      // this thread's 16 columns (bytes) of K
#pragma unroll
      for (int j = 0; j < BM / 16; ++j) {
        const int r = r0 + 16 * j;
        const bool ok = m0 + r < num_tokens && kc < K;  // else zeros: rows past T, K past the last box's end
        const unsigned char* from = q + (ok ? (i64)(m0 + r) * QROW + kc : 0);
        dsg::mma::cp_async16(a + r * ROW_BYTES + chunk, from, ok ? 16 : 0);
      }
      mbar::arrive_on_cp_async(&full[s]);
    }
  }
  if constexpr (PART != AHEAD) dsg::mma::cp_async_wait<0>();   // nothing of this thread's left in flight at exit
}

// The start of a GEMM whose weights go before pdl_wait: thread 0 inits the ring's barriers and issues the
// first stages' weights (produce's AHEAD part), unless the CTA will take the kernel's split-K exit after the
// wait (splits > 1 and more tiles than TICKETS: uniform, from the launch arguments) -- a CTA must not exit
// with TMA in flight into its shared memory.  The caller's __syncthreads after the wait publishes the
// barriers; its producer then runs the AFTER_AHEAD part.
template <int MODE, int O, int K, int QROW, int ST, int TICKETS, typename G>
__device__ __forceinline__ void begin_early(const TensorMap* w0, const TensorMap* w1, int num_tokens, int splits,
                                            char* smem, unsigned long long* full, unsigned long long* empty, G grid) {
  if (threadIdx.x != 0 || (splits > 1 && num_tiles(num_tokens, MODE, O) > TICKETS)) return;
  ring_init<ST>(full, empty);
  const unsigned raw = smem_u32(smem);
  produce<MODE, O, K, QROW, ST, AHEAD>(nullptr, w0, w1, num_tokens, splits, smem + (((raw + 1023u) & ~1023u) - raw),
                                       full, empty, grid);
}

}  // namespace gemm_ring
}  // namespace dsg
