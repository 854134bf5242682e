// 4g. The grouped expert GEMM with FP8 weights AND FP8 activations on Hopper's wgmma + TMA (sm_90a):
// prefill's many pairs per expert.  The contract of 4d (moe_wgmma.cuh: pairs grouped by expert
// through the routing `order` / `offsets`, the same outputs rounded at the same points, no host
// sync), with the product of gemm_fp8.cuh (DeepGEMM's recipe):
//
//   y[p, o] = sum over K blocks kb of  sx[r(p), kb] * sw[e][o / 128, kb] * (qx[r(p), kb-block] . qw[e][o, kb-block])
//
// qx [R, KD] e4m3 and sx [R, ceil(KD / 128)] fp32: the activations quantised per row per 128 columns
// by quant_fp8.cuh's launch before this one (gate_up: the MoE input x, R = T, r(p) = p / K: one
// quantisation per token shared by its K pairs; down: the SwiGLU output a, R = NP, r(p) = p);
// qw [E, N, KD] e4m3 with sw [E, ceil(N / 128), ceil(KD / 128)] fp32 (fp8_e4m3_block128).  Each
// 128-wide K block is multiplied by wgmma into a fresh fp32 tile, then promoted into the fp32 sum
// with its two scales (the FP8 tensor cores accumulate with fewer bits than fp32).
//
// The walk of 4d: a persistent grid over (row tile of 128 pairs of one expert, column tile), the row
// tiles numbered over the experts in order (wgmma_row_tiles); warpgroup 0 produces, warpgroups 1 and
// 2 consume 64 pairs each through a ring of ST stages.  The tile and stage of gemm_ring.cuh:
//   * a stage is one 128-wide K block (one scale block): the tile's 128 weight rows as two TMA boxes
//     of 64 rows x 128 bytes (128B swizzle) from the 3-D tensor map [E, N, KD]; the 128 pair rows
//     GATHERED from qx by the producer's threads with 16-byte cp.async (TMA cannot gather rows);
//   * gate_up: 64 gate rows, then the same 64 up rows (n0 % 64 == 0: one 128-row scale block each),
//     so a thread's column j < 8 (gate) and j + 8 (up) are one output column: silu(gate) * up fuses
//     in registers (GATE_UP_SILU) or the halves go to the two outputs (GATE_UP); 64 columns a tile.
//     DOWN: 128 weight rows from n0 (one scale block), 128 output columns a tile;
//   * the epilogue rounds the tile into the consumer's 16 KB of shared memory and stores whole
//     16-byte chunks of each pair's output row.
// Ceil blocks: KD % 128 != 0 -- the last block's columns past KD are zeros on both sides (TMA fills
// the weight's, the gather the rows'); N % 128 != 0 -- weight rows past N are zeros, never stored.
//
// MC (Tuning.moe.fp8_multicast, launched with __cluster_dims__(2, 1, 1)): a cluster of two CTAs takes
// an item of two consecutive row tiles of one expert against one column tile -- rank r row tile 2 i + r
// (wgmma_row_tiles over 2 * BM pairs, fp8x_tile); the second one empty where the expert's count is odd:
// that CTA runs the stages on zero rows and stores nothing.  The two CTAs' rings stay in step (the same
// items, the same K blocks), and each CTA's thread 0 issues ONE of a stage's two weight boxes, multicast
// into both CTAs (rank 0 box 0, rank 1 box 1): each full barrier still expects the stage's whole weight
// bytes, each empty barrier a release from both CTAs' consumers (release_stage), since a refill writes
// the peer's slot too.  The weight bytes a stage moves from L2 into an SM halve (32 -> 24 KB a stage).
// The tile's arithmetic is unchanged -- only where its weight bytes come from -- so the outputs are
// bit-equal to the kernel without it.
//
// Down's quantiser stays its own launch over a: quantising a in gate_up_silu's epilogue (a 128-column
// scale group's amax spans two SILU tiles) measured slower on an H100 (docs/notes/fp8act.md).
//
// Needs 16-bit T (the outputs) and KD % 16 == 0 (whole 16-byte chunks of the quantised rows, 16-byte
// strides of the weight's tensor map); the lowering emits it only then (_moe_gemm_fp8.py).
#pragma once
#include "gemm_fp8.cuh"
#include "moe_wgmma.cuh"

namespace dsg {
namespace moe {

namespace f8 = dsg::gemm_fp8;

// Output columns a tile covers.
__host__ __device__ constexpr int fp8x_tile_cols(int mode) { return mode == DOWN ? f8::BN : f8::BN / 2; }
// Dynamic shared memory: gemm_ring.cuh's ring, staging and alignment slack.
__host__ __device__ constexpr int fp8x_smem(int stages) { return f8::smem_bytes(stages); }

// The quantised row of each of a producer thread's tile rows r0 + 16 i (-1: none): the pair's token
// (pair / K) for the gate_up modes, the pair itself for DOWN.
template <int MODE, int K, int R>
__device__ __forceinline__ void fp8x_src_rows(const i32* __restrict__ order, const WgTile& tl, int r0, int (&src)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = r0 + 16 * i;
    const int pr = r < tl.rows ? order[tl.pbeg + r] : -1;
    src[i] = pr < 0 ? -1 : (MODE == DOWN ? pr : pr / K);
  }
}

// The walk's first item and stride: a CTA's (blockIdx.x / gridDim.x), MC a cluster's of two.
template <bool MC> __device__ __forceinline__ int fp8x_first() { return MC ? blockIdx.x >> 1 : blockIdx.x; }
template <bool MC> __device__ __forceinline__ int fp8x_stride() { return MC ? gridDim.x >> 1 : gridDim.x; }

// Item t of the walk (t < tiles[E] * NCT): wgmma_tile's tile, MC this CTA's row tile of the item's two.
template <int E, int NCT, int COLS, bool MC>
__device__ __forceinline__ WgTile fp8x_tile(const int* tiles, const i32* __restrict__ offsets, int t) {
  if constexpr (!MC) {
    return wgmma_tile<E, NCT, COLS>(tiles, offsets, t);
  } else {
    WgTile tl = wgmma_tile<E, NCT, COLS, 2 * f8::BM>(tiles, offsets, t);
    const int r = (int)cluster::rank();
    tl.pbeg += r * f8::BM;                             // rank r: row tile 2 i + r
    tl.rows = max(0, min(f8::BM, tl.rows - r * f8::BM));
    return tl;
  }
}

// One tile's stages (weight rows from n0, the tile's gathered rows src) into the ring.  MC: thread 0
// issues this rank's box only, multicast to both CTAs (the stage's whole weight bytes expected all the same).
template <int MODE, int N, int KD, int ST, bool MC, int R>
__device__ __forceinline__ void fp8x_produce_tile(const unsigned char* __restrict__ qx, const TensorMap* w0,
                                                  const TensorMap* w1, const int (&src)[R], int e, int n0, int p,
                                                  char* ring, unsigned long long* full, unsigned long long* empty,
                                                  int& it) {
  constexpr int KB = (KD + f8::BK - 1) / f8::BK;
  const int c = p & 7, r0 = p >> 3;
  const int chunk = (c ^ (r0 & 7)) * 16;               // 128B swizzle: c ^ (row % 8)
  // DOWN's second box starts past N when N - n0 <= 64: left out (its columns are never stored),
  // so no box lies wholly outside the tensor
  const bool box1 = MODE != DOWN || n0 + f8::BOX < N;
  for (int kb = 0; kb < KB; ++kb, ++it) {
    const int s = it % ST;
    mbar::wait(&empty[s], ((it / ST) & 1) ^ 1);
    char* a = ring + s * f8::STAGE_BYTES;
    char* b = a + f8::BM * f8::ROW_BYTES;
    const int k0 = kb * f8::BK;
    if (p == 0) {
      mbar::arrive_expect_tx(&full[s], (box1 ? 2 : 1) * f8::BOX * f8::ROW_BYTES);
      if constexpr (MC) {
        if (cluster::rank() == 0)
          tma::load_3d_multicast(b, w0, k0, n0, e, &full[s], 0b11);
        else if (box1)
          tma::load_3d_multicast(b + f8::BOX * f8::ROW_BYTES, MODE == DOWN ? w0 : w1, k0,
                                 MODE == DOWN ? n0 + f8::BOX : n0, e, &full[s], 0b11);
      } else {
        tma::load_3d(b, w0, k0, n0, e, &full[s]);
        if (box1)
          tma::load_3d(b + f8::BOX * f8::ROW_BYTES, MODE == DOWN ? w0 : w1, k0, MODE == DOWN ? n0 + f8::BOX : n0, e,
                       &full[s]);
      }
    }
    const int kc = k0 + 16 * c;                        // this thread's 16 columns (bytes) of K
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const bool ok = src[i] >= 0 && kc < KD;          // else zeros: rows past the tile, K past the ceil block
      const unsigned char* from = qx + (ok ? (i64)src[i] * KD + kc : 0);
      dsg::mma::cp_async16(a + (r0 + 16 * i) * f8::ROW_BYTES + chunk, from, ok ? 16 : 0);
    }
    mbar::arrive_on_cp_async(&full[s]);
  }
}

// Producer: the 128 threads of warpgroup 0.  Thread p copies 16-byte chunk p % 8 of tile rows
// p / 8 + 16 i (i < 8); thread 0 also issues the weight boxes.
template <int MODE, int E, int N, int KD, int K, int ST, bool MC>
__device__ __forceinline__ void fp8x_produce(const unsigned char* __restrict__ qx, const TensorMap* w0,
                                             const TensorMap* w1, const i32* __restrict__ order,
                                             const i32* __restrict__ offsets, const int* tiles, char* ring,
                                             unsigned long long* full, unsigned long long* empty) {
  constexpr int COLS = fp8x_tile_cols(MODE), NCT = (N + COLS - 1) / COLS;
  const int p = threadIdx.x, r0 = p >> 3;
  if (p == 0) {
    tma::prefetch(w0);
    if (MODE != DOWN) tma::prefetch(w1);
  }
  const int total = tiles[E] * NCT;
  int it = 0;
  for (int t = fp8x_first<MC>(); t < total; t += fp8x_stride<MC>()) {
    const WgTile tl = fp8x_tile<E, NCT, COLS, MC>(tiles, offsets, t);
    int src[f8::BM / 16];
    fp8x_src_rows<MODE, K>(order, tl, r0, src);
    fp8x_produce_tile<MODE, N, KD, ST, MC>(qx, w0, w1, src, tl.e, tl.n0, p, ring, full, empty, it);
  }
  dsg::mma::cp_async_wait<0>();                        // nothing of this thread's left in flight at exit
}

// Consumer warpgroup cw (0, 1): tile rows 64 cw .. + 64 against the tile's 128 weight rows.  OVL
// (Tuning.moe.fp8_overlap): each K block's promotion under the next block's wgmma (gemm_fp8.cuh
// mainloop_overlap; the same sums bit for bit).  MC: stages freed on the peer's barriers too.
template <typename T, int MODE, int E, int N, int KD, int K, int ST, bool OVL, bool MC>
__device__ __forceinline__ void fp8x_consume(const float* __restrict__ sx, const float* __restrict__ sw0,
                                             const float* __restrict__ sw1, const i32* __restrict__ order,
                                             const i32* __restrict__ offsets, const int* tiles, unsigned ring,
                                             unsigned long long* full, unsigned long long* empty, char* staging,
                                             T* __restrict__ out0, T* __restrict__ out1, int cw) {
  constexpr int KB = (KD + f8::BK - 1) / f8::BK, NB = (N + f8::BLOCK - 1) / f8::BLOCK;
  constexpr int COLS = fp8x_tile_cols(MODE), NCT = (N + COLS - 1) / COLS;
  constexpr int CH = (MODE == GATE_UP_SILU ? fp8x_tile_cols(MODE) : f8::BN) / 8;   // 16-byte chunks a tile stages
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, tid = threadIdx.x & 127;
  // 16-byte row chunks where rows are whole chunks and the bases allow them (uniform), else elements
  const bool vec = N % 8 == 0 && aligned_to<16>(out0) && aligned_to<16>(out1);
  const int total = tiles[E] * NCT;
  float acc[64], part[64];
  int it = 0;
  for (int t = fp8x_first<MC>(); t < total; t += fp8x_stride<MC>()) {
    const WgTile tl = fp8x_tile<E, NCT, COLS, MC>(tiles, offsets, t);
    // this thread's two tile rows' quantised rows (rows past the tile: row 0's scales, never stored)
    const int ra = 64 * cw + 16 * warp + (lane >> 2), rb = ra + 8;
    const int pa = ra < tl.rows ? order[tl.pbeg + ra] : -1, pb = rb < tl.rows ? order[tl.pbeg + rb] : -1;
    const int qa = pa < 0 ? 0 : (MODE == DOWN ? pa : pa / K), qb = pb < 0 ? 0 : (MODE == DOWN ? pb : pb / K);
    const float* sxa = sx + (i64)qa * KB;
    const float* sxb = sx + (i64)qb * KB;
    // the tile's weight scale block (gate's; up's for the gate_up modes)
    const float* swg = sw0 + ((i64)tl.e * NB + tl.n0 / f8::BLOCK) * KB;
    const float* swu = MODE == DOWN ? swg : sw1 + ((i64)tl.e * NB + tl.n0 / f8::BLOCK) * KB;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    // acc += the FP8 product of the tile's 64 rows against its 128 weight rows, promoted per 128-K block
    const f8::ScaleRows sr = {sxa, sxb, swg, swu};
    if constexpr (OVL) {
      float next[64];                                  // the next block's fp32 tile, in flight while one is promoted
      f8::mainloop_overlap<MODE != DOWN, ST, MC>(acc, part, next, sr, ring, full, empty, cw, lane, 0, KB, it);
    } else {
      f8::mainloop<MODE != DOWN, ST, MC>(acc, part, sr, ring, full, empty, cw, lane, 0, KB, it);
    }
    // then stored as whole chunks of each pair's row; GATE_UP sends each staged half to its output
    wgmma::warpgroup_sync(1 + cw);                     // the last tile's chunks have all been read
    f8::stage_acc_rows<T, MODE == GATE_UP_SILU, CH>(acc, staging, warp, lane);   // GATE_UP: [gate 64 | up 64]
    wgmma::warpgroup_sync(1 + cw);                     // the staging rows are whole
#pragma unroll
    for (int i = 0; i < 64 * CH / 128; ++i) {
      const int idx = tid + 128 * i, r = idx / CH, ch = idx % CH;
      const int tr = 64 * cw + r;
      const int orow = tr < tl.rows ? order[tl.pbeg + tr] : -1;
      const bool second = MODE == GATE_UP && ch >= 8;  // GATE_UP: the up half
      const int col = tl.n0 + 8 * (second ? ch - 8 : ch);
      if (orow < 0 || col >= N) continue;
      const uint4 chunk = *reinterpret_cast<const uint4*>(staging + r * f8::OUT_ROW_BYTES + ((ch ^ (r & 7)) << 4));
      store_chunk<T, N>((second ? out1 : out0) + (i64)orow * N + col, chunk, col, vec);
    }
  }
}

// out0 (out1: GATE_UP's up) [NP, N] = the FP8 product above for every pair; w0 / sw0 the weight
// (gate for the gate_up modes) and its scales, w1 / sw1 up's (DOWN: w0 / sw0 again).
// OVL: the consumers' overlapped K loop (fp8x_consume).  MC: clusters of two sharing each stage's weight
// boxes (the header); the kernel is then launched with __cluster_dims__(2, 1, 1) and an even grid.
template <typename T, int MODE, int E, int N, int KD, int K, int ST, bool OVL = false, bool MC = false>
__device__ __forceinline__ void grouped_gemm_fp8x(const unsigned char* __restrict__ qx, const float* __restrict__ sx,
                                                  const TensorMap* w0, const float* __restrict__ sw0,
                                                  const TensorMap* w1, const float* __restrict__ sw1,
                                                  const i32* __restrict__ order, const i32* __restrict__ offsets,
                                                  T* __restrict__ out0, T* __restrict__ out1, char* smem) {
  static_assert(sizeof(T) == 2, "fp8 x fp8 experts: 16-bit outputs");
  static_assert(KD % 16 == 0, "fp8 x fp8 experts: quantised rows of whole 16-byte chunks");
  static_assert(ST >= 2, "fp8 x fp8 experts: a ring of at least two stages");
  static_assert(f8::BM == WG_BM, "fp8 x fp8 experts: the row tiles of wgmma_row_tiles");
  static_assert(f8::BN == f8::BLOCK && f8::BN / 2 % f8::BOX == 0,
                "fp8 x fp8 experts: a tile's weight rows (each half for gate_up) lie in one scale block");
  static_assert(fp8x_smem(ST) + 2 * ST * 8 + 4 * (E + 1) <= 227 * 1024,
                "fp8 x fp8 experts: ring + staging + row-tile table exceed a CTA's 227 KB (_moe_gemm_fp8.fits)");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST];
  __shared__ int tiles[E + 1];
  dsg::pdl_wait();                                     // offsets, order, qx and sx: earlier kernels' outputs
  const unsigned raw = smem_u32(smem);
  const unsigned ring = (raw + 1023u) & ~1023u;        // 128B-swizzle tiles start on 1024-byte boundaries
  if (threadIdx.x < 32) wgmma_row_tiles<E, MC ? 2 * f8::BM : f8::BM>(offsets, tiles);   // MC: items of two row tiles
  if (threadIdx.x == 0) f8::ring_init<ST, MC ? 2 : 1>(full, empty);
  __syncthreads();
  if constexpr (MC) cluster::sync();                   // the peer's barriers ready before its multicast / releases
  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    wgmma::setmaxnreg_dec<f8::PRODUCER_REGS>();
    fp8x_produce<MODE, E, N, KD, K, ST, MC>(qx, w0, w1, order, offsets, tiles, smem + (ring - raw), full, empty);
  } else {
    wgmma::setmaxnreg_inc<f8::CONSUMER_REGS>();
    char* staging = smem + (ring - raw) + ST * f8::STAGE_BYTES + (wg - 1) * f8::OUT_BYTES;
    fp8x_consume<T, MODE, E, N, KD, K, ST, OVL, MC>(sx, sw0, sw1, order, offsets, tiles, ring, full, empty, staging,
                                                    out0, out1, wg - 1);
  }
  if constexpr (MC) cluster::sync();                   // no CTA exits while its peer may still write into it
  dsg::pdl_launch_dependents();
}

}  // namespace moe
}  // namespace dsg
