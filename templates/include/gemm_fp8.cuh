// The FP8 x FP8 GEMM of the dense linears above the skinny range (prefill): DeepGEMM's recipe on
// Hopper's wgmma + TMA (sm_90a).
//
//   y[t, o] = sum over K blocks kb of  sx[t, kb] * sw[o / 128, kb] * (qx[t, kb-block] . qw[o, kb-block])
//
// qx [T, K] e4m3 and sx [T, KB] fp32 from quant_fp8.cuh (per token per 128 columns), qw [O, K] e4m3
// with sw [ceil(O / 128), KB] fp32 (fp8_e4m3_block128, ir/formats.py), KB = ceil(K / 128).  Each
// 128-wide K block is multiplied by wgmma into a fresh fp32 tile, which is then promoted into the
// fp32 accumulator with its two scales (the tensor cores' FP8 accumulation keeps fewer bits than
// fp32: promoting every block keeps the sum exact to fp32).  Ceil blocks: K % 128 != 0 -- the last
// block's columns past K are zeros on both sides (TMA fills the weight's, the copies the tokens');
// O % 128 != 0 -- the weight rows past O are zeros and their columns are never stored.
//
// The tile walk, the ring, the producer and the staged stores are gemm_ring.cuh's (the structure of
// moe_wgmma.cuh's grouped GEMM, without the routing; a stage is one 128-wide K block, one scale block):
//   * LINEAR: the tile's 128 weight rows are one 128-row scale block (n0 % 128 == 0), one weight
//     scale a stage.  SILU (gate_up_silu): 64 gate rows then the same 64 up rows (n0 % 64 == 0: one
//     scale block each), so a thread's column j < 8 (gate) and j + 8 (up) are one output column and
//     silu(gate) * up fuses in registers; 64 output columns a tile.
//
// Split K (decode batches): gemm_split.cuh's -- `splits` CTAs a tile, each a contiguous range of K
// blocks with the promotion per block as above, fp32 partial tiles summed in split order by the
// tile's last CTA.  S = 1 is the walk above, unchanged.
//
// Needs K % 16 == 0 (whole 16-byte chunks of q rows; 16-byte strides for the weight's tensor map);
// the lowering emits it only then (codegen/families/gemm_fp8.py).
#pragma once
#include "cluster.cuh"
#include "common.cuh"
#include "gemm_ring.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "gemm_split.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace dsg {
namespace gemm_fp8 {

using namespace dsg::gemm_ring;
using namespace dsg::gemm_split;
constexpr int BLOCK = 128;            // the scale blocks of both operands: one a stage's K (BK)
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 256 <= 65536, "gemm_fp8: register file");

// ---- d (64 x 128 fp32) (+)= a (64 x 32 e4m3) * b (32 x 128 e4m3), both K-major in shared memory ----
// Same register layout as wgmma.cuh's: d[4j + 2h + c] = (row 16 w + l / 4 + 8 h, column 8 j + 2 (l % 4) + c),
// j < 16.  accumulate = 0: d = a * b (a fresh tile: each K block starts one).
#define DSG_F8_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
__device__ __forceinline__ void mma_m64n128k32(float (&d)[64], unsigned long long a_desc, unsigned long long b_desc,
                                               int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3\n"
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"
      " %64, %65, p, 1, 1;\n}\n"
      : DSG_F8_D8(0), DSG_F8_D8(8), DSG_F8_D8(16), DSG_F8_D8(24), DSG_F8_D8(32), DSG_F8_D8(40), DSG_F8_D8(48),
        DSG_F8_D8(56)
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
#undef DSG_F8_D8

// ---- The consumers' K loop, shared with the grouped experts (moe_gemm_fp8.cuh) ----
// Where a thread's two rows' scales (sxa, sxb: rows a and a + 8) and the tile's weight scale blocks
// (swg; swu: the second half's, gate_up's up rows) are, one float a K block.
struct ScaleRows {
  const float *sxa, *sxb, *swg, *swu;
};
// One K block's four scales.
struct BlockScales {
  float xa, xb, wg, wu;
};
__device__ __forceinline__ BlockScales block_scales(const ScaleRows& r, int kb) {
  const float xa = r.sxa[kb], xb = r.sxb[kb], wg = r.swg[kb], wu = r.swu[kb];
  return {xa, xb, wg, wu};
}

// Ring step `it`'s stage, once landed, times consumer warpgroup cw's 64 rows: 4 wgmma into a fresh fp32
// tile `part`, committed as one group (not waited for).
template <int ST>
__device__ __forceinline__ void issue_block(float (&part)[64], unsigned ring, unsigned long long* full, int it,
                                            int cw) {
  const StageDescs d = landed_stage<ST>(ring, full, it, cw);
#pragma unroll
  for (int k32 = 0; k32 < BK / 32; ++k32)
    mma_m64n128k32(part, wgmma::desc_advance(d.a, k32), wgmma::desc_advance(d.b, k32), k32);
  wgmma::commit();
}

// A consumer warp's arrival that frees a stage: on this CTA's empty barrier and, MC (a cluster of two
// whose weight boxes are multicast), on the peer's, since the peer's producer writes this CTA's slot too.
template <bool MC>
__device__ __forceinline__ void release_stage(unsigned long long* empty_s) {
  mbar::arrive(empty_s);
  if constexpr (MC) mbar::arrive_cluster(empty_s, cluster::rank() ^ 1u);
}

// A block's product, its wgmma group complete: free the stage of ring step `it` (its reads are done),
// then promote -- the fp32 tile scaled by its rows' and weight block's scales into the sum.  HALVES:
// columns 64.. (j >= 8) take the second weight scale.
template <bool HALVES, int ST, bool MC = false>
__device__ __forceinline__ void retire_block(float (&acc)[64], float (&part)[64], const BlockScales& sc,
                                             unsigned long long* empty, int it, int lane) {
  wgmma::fence_operands(part);
  if (lane == 0) release_stage<MC>(&empty[it % ST]);  // the stage is read: free it (MC: the peer's too)
  const float ga = sc.xa * sc.wg, gb = sc.xb * sc.wg, ua = sc.xa * sc.wu, ub = sc.xb * sc.wu;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const bool up = HALVES && j >= 8;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      acc[4 * j + c] = fmaf(part[4 * j + c], up ? ua : ga, acc[4 * j + c]);
      acc[4 * j + 2 + c] = fmaf(part[4 * j + 2 + c], up ? ub : gb, acc[4 * j + 2 + c]);
    }
  }
}

// K blocks [kb0, kb1) of a tile (ring steps it, it + 1, ...): acc += each block's promoted product, one
// block at a time (its wgmma group waited for, then promoted).  MC: each stage freed on the cluster peer's
// empty barrier too (release_stage: the peer multicasts into this CTA's ring).
template <bool HALVES, int ST, bool MC = false>
__device__ __forceinline__ void mainloop(float (&acc)[64], float (&part)[64], const ScaleRows& r, unsigned ring,
                                         unsigned long long* full, unsigned long long* empty, int cw, int lane,
                                         int kb0, int kb1, int& it) {
  for (int kb = kb0; kb < kb1; ++kb, ++it) {
    const BlockScales sc = block_scales(r, kb);        // the scales first: their loads run while the stage lands
    issue_block<ST>(part, ring, full, it, cw);
    wgmma::wait<0>();
    retire_block<HALVES, ST, MC>(acc, part, sc, empty, it, lane);
  }
}

// mainloop's sums, with each block's promotion under the next block's wgmma: block kb + 1's group goes into
// the other fp32 tile before block kb's is waited for (wait<1>: all but the newest group done), so the
// tensor cores are busy while kb is promoted.  The same FMAs in the same order per accumulator (blocks
// promoted in kb order): bit-equal sums.  ST >= 2: kb's stage stays held while kb + 1's lands.
template <bool HALVES, int ST, bool MC = false>
__device__ __forceinline__ void mainloop_overlap(float (&acc)[64], float (&p0)[64], float (&p1)[64],
                                                 const ScaleRows& r, unsigned ring, unsigned long long* full,
                                                 unsigned long long* empty, int cw, int lane, int kb0, int kb1,
                                                 int& it) {
  static_assert(ST >= 2, "gemm_fp8: the overlapped K loop holds two stages");
  const int it0 = it - kb0;                            // block kb's ring step: it0 + kb
  it += kb1 - kb0;
  if (kb0 >= kb1) return;
  BlockScales s0 = block_scales(r, kb0);
  issue_block<ST>(p0, ring, full, it0 + kb0, cw);
  // two blocks a trip, so that each fp32 tile is a fixed set of registers: p0 holds the even steps, and
  // at the top of a trip block kb's group (in p0) is in flight
  int kb = kb0;
  for (; kb + 2 < kb1; kb += 2) {
    const BlockScales s1 = block_scales(r, kb + 1);
    issue_block<ST>(p1, ring, full, it0 + kb + 1, cw);
    wgmma::wait<1>();
    retire_block<HALVES, ST, MC>(acc, p0, s0, empty, it0 + kb, lane);
    s0 = block_scales(r, kb + 2);
    issue_block<ST>(p0, ring, full, it0 + kb + 2, cw);
    wgmma::wait<1>();
    retire_block<HALVES, ST, MC>(acc, p1, s1, empty, it0 + kb + 1, lane);
  }
  if (kb + 1 < kb1) {                                  // two blocks left: kb in flight, then kb + 1
    const BlockScales s1 = block_scales(r, kb + 1);
    issue_block<ST>(p1, ring, full, it0 + kb + 1, cw);
    wgmma::wait<1>();
    retire_block<HALVES, ST, MC>(acc, p0, s0, empty, it0 + kb, lane);
    wgmma::wait<0>();
    retire_block<HALVES, ST, MC>(acc, p1, s1, empty, it0 + kb + 1, lane);
  } else {                                             // one: kb in flight
    wgmma::wait<0>();
    retire_block<HALVES, ST, MC>(acc, p0, s0, empty, it0 + kb, lane);
  }
}

// The epilogue's staging of a consumer warpgroup's tile: acc[4j + 2h + c] is row 16 warp + lane / 4 + 8h of
// its 64, column 8j + 2 (lane % 4) + c.  Rounded into the staging rows as CH 16-byte chunks (chunk j of row r
// at j ^ (r % 8): conflict-free writes and reads); row r is written by warp r / 16 alone.  SILU_MUL: columns
// j < 8 are gate's, acc[32 + ...] the same columns of up: silu(gate) * up staged.
template <typename T, bool SILU_MUL, int CH>
__device__ __forceinline__ void stage_acc_rows(const float (&acc)[64], char* staging, int warp, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = warp * 16 + (lane >> 2) + 8 * h;
    char* row = staging + rr * OUT_ROW_BYTES + 4 * (lane & 3);
#pragma unroll
    for (int jj = 0; jj < CH; ++jj) {
      const int at = 4 * jj + 2 * h;
      float v[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        if constexpr (SILU_MUL) {
          // silu(g) * u rounded where the unfused ops round (moe_wgmma.cuh's fast SiLU)
          const float gr = round_to<T>(acc[at + c]), ur = round_to<T>(acc[32 + at + c]);
          v[c] = round_to<T>(__fdividef(gr, 1.f + __expf(-gr))) * ur;
        } else {
          v[c] = acc[at + c];
        }
      }
      struct alignas(4) Pair { T lo, hi; } pr = {from_float<T>(v[0]), from_float<T>(v[1])};
      *reinterpret_cast<Pair*>(row + ((jj ^ (rr & 7)) << 4)) = pr;
    }
  }
}

// Consumer warpgroup cw (0, 1): token rows 64 cw .. + 64 of each tile against its 128 weight rows.  OVL
// (Tuning.moe.fp8_overlap): each K block's promotion under the next block's wgmma (mainloop_overlap).
template <typename T, int MODE, int O, int K, int ST, bool OVL, typename G>
__device__ __forceinline__ void consume(const float* __restrict__ sx, const float* __restrict__ sw0,
                                        const float* __restrict__ sw1, int num_tokens, int splits,
                                        float* __restrict__ partials, unsigned int* __restrict__ tickets,
                                        unsigned ring, unsigned long long* full, unsigned long long* empty,
                                        char* staging, T* __restrict__ y, int cw, G grid) {
  constexpr int KB = (K + BK - 1) / BK, COLS = tile_cols(MODE), NCT = (O + COLS - 1) / COLS;
  constexpr int CH = COLS / 8;                         // 16-byte chunks of a staged row
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, tid = threadIdx.x & 127;
  const bool vec = O % 8 == 0 && (reinterpret_cast<unsigned long long>(y) & 15ull) == 0;   // uniform: whole 16-byte chunks, else elements
  const int tiles = num_tiles(num_tokens, MODE, O);
  __shared__ int last;                                 // split_arrive's answer to the consumers
  float acc[64], part[64];
  int it = 0;
  for (int i = grid.cta(); i < tiles * splits; i += grid.ctas()) {
    const Item w = item_of(i, tiles);
    const KRange kr = k_range(w.split, splits, KB);
    const int m0 = w.tile / NCT * BM, n0 = w.tile % NCT * COLS;
    const int ra = m0 + 64 * cw + 16 * warp + (lane >> 2), rb = ra + 8;   // this thread's two token rows
    const float* sxa = sx + (i64)min(ra, num_tokens - 1) * KB;   // rows past T: any row's scales (never stored)
    const float* sxb = sx + (i64)min(rb, num_tokens - 1) * KB;
    const float* swg = sw0 + (n0 / BLOCK) * KB;        // the tile's weight scale block (gate's for SILU)
    const float* swu = MODE == SILU ? sw1 + (n0 / BLOCK) * KB : swg;
#pragma unroll
    for (int k = 0; k < 64; ++k) acc[k] = 0.f;
    const ScaleRows sr = {sxa, sxb, swg, swu};
    if constexpr (OVL) {
      float next[64];                                  // the next block's fp32 tile, in flight while one is promoted
      mainloop_overlap<MODE == SILU, ST>(acc, part, next, sr, ring, full, empty, cw, lane, kr.first, kr.end, it);
    } else {
      mainloop<MODE == SILU, ST>(acc, part, sr, ring, full, empty, cw, lane, kr.first, kr.end, it);
    }
    const bool row_ok[2] = {ra < num_tokens, rb < num_tokens};
    if (splits > 1 && !split_arrive(acc, partials, tickets, w, tiles, splits, row_ok, &last)) continue;

    // Epilogue: rounded into this warpgroup's staging rows, then stored as whole chunks.
    wgmma::warpgroup_sync(1 + cw);                     // the last tile's chunks have all been read
    stage_acc_rows<T, MODE == SILU, CH>(acc, staging, warp, lane);
    wgmma::warpgroup_sync(1 + cw);                     // the staging rows are whole
#pragma unroll
    for (int q = 0; q < 64 * CH / 128; ++q) {
      const int idx = tid + 128 * q, r = idx / CH, ch = idx % CH;
      const int row = m0 + 64 * cw + r, col = n0 + 8 * ch;
      if (row >= num_tokens || col >= O) continue;
      const uint4 chunk = *reinterpret_cast<const uint4*>(staging + r * OUT_ROW_BYTES + ((ch ^ (r & 7)) << 4));
      store_chunk<T, O>(y + (i64)row * O + col, chunk, col, vec);
    }
  }
}

// y [T, O] (16-bit) = the FP8 product above; w0 / sw0 the weight (SILU: the gate) and its scales,
// w1 / sw1 SILU's up (unused for LINEAR).  `splits`: CTAs a tile (1: no split; the lowering's grid is
// then at most the tiles, else exactly tiles * splits); `partials`: splits * tiles * PARTIAL_WORDS
// floats where splits > 1 (else possibly empty); `tickets`: TICKETS counters, zero between launches.
// The lowering splits only while the tiles fit the tickets; past that (uniform) the CTA exits with
// y unwritten rather than index past them.  OVL: the consumers' overlapped K loop (consume).  EARLY
// (Tuning.linear.gemm_weights_early): the first ring stages' weights issued before pdl_wait (begin_early).
// grid: the CTAs that run this GEMM (gemm_ring.cuh WholeGrid: a launch of one; PartGrid: a part's CTAs of a
// launch of several, gemm_multi.cuh).
template <typename T, int MODE, int O, int K, int ST, int TICKETS, bool OVL = false, bool EARLY = false,
          typename G = WholeGrid>
__device__ __forceinline__ void gemm(const unsigned char* __restrict__ qx, const float* __restrict__ sx,
                                     const TensorMap* w0, const float* __restrict__ sw0, const TensorMap* w1,
                                     const float* __restrict__ sw1, T* __restrict__ y, float* __restrict__ partials,
                                     unsigned int* __restrict__ tickets, int num_tokens, int splits, char* smem,
                                     G grid = G{}) {
  static_assert(sizeof(T) == 2, "gemm_fp8: 16-bit output");
  static_assert(K % 16 == 0, "gemm_fp8: token rows of whole 16-byte chunks");
  static_assert(ST >= 2, "gemm_fp8: a ring of at least two stages");
  static_assert(BK == BLOCK && BN % BLOCK == 0 && (MODE == LINEAR || BN / 2 <= BLOCK),
                "gemm_fp8: a stage holds one scale block of K, a tile one of the weight's rows (each half for SILU)");
  static_assert(smem_bytes(ST) + 2 * ST * 8 + 16 <= 227 * 1024, "gemm_fp8: ring + staging exceed a CTA's 227 KB");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST];
  if constexpr (EARLY) begin_early<MODE, O, K, K, ST, TICKETS>(w0, w1, num_tokens, splits, smem, full, empty, grid);
  dsg::pdl_wait();                                     // qx and sx are the quantiser's output
  if (splits > 1 && num_tiles(num_tokens, MODE, O) > TICKETS) return;
  const unsigned raw = smem_u32(smem);
  const unsigned ring = (raw + 1023u) & ~1023u;        // 128B-swizzle tiles start on 1024-byte boundaries
  if (!EARLY && threadIdx.x == 0) ring_init<ST>(full, empty);
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    wgmma::setmaxnreg_dec<PRODUCER_REGS>();
    produce<MODE, O, K, K, ST, EARLY ? AFTER_AHEAD : ALL>(qx, w0, w1, num_tokens, splits, smem + (ring - raw), full,
                                                          empty, grid);
  } else {
    wgmma::setmaxnreg_inc<CONSUMER_REGS>();
    char* staging = smem + (ring - raw) + ST * STAGE_BYTES + (wg - 1) * OUT_BYTES;
    consume<T, MODE, O, K, ST, OVL>(sx, sw0, sw1, num_tokens, splits, partials, tickets, ring, full, empty, staging,
                                    y, wg - 1, grid);
  }
  dsg::pdl_launch_dependents();
}

}  // namespace gemm_fp8
}  // namespace dsg
