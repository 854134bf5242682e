// The int8 x int8 GEMM of the int8 linears above the skinny range (msModelSlim W8A8_DYNAMIC, ir/formats.py
// int8_channel; the arithmetic is ir/formats_int.py int_linear's), on Hopper's wgmma + TMA (sm_90a):
//
//   acc[t, o] = sum_k qx[t, k] * qw[o, k]           exact: int32 (|acc| <= K * 2^14 < 2^31 for K < 2^17)
//   y[t, o]   = (float(acc) * s_w[o]) * s_x[t]      quant_int8.cuh dequant: two correctly rounded products
//   out       = y rounded to the activation type
//
// so every output is bit-equal to the reference's.  qx [T, QROW] int8 (zero padded rows) and s_x [T] fp32
// from the per-token quantiser (quant_int8.cuh), qw [O, K] int8 with s_w [O] fp32.  SILU (gate_up_silu):
// gate and up each as above and rounded to the activation type, then silu(g) rounded, times u (the int8
// skinny kernel's store_silu, and the unfused ops' roundings).
//
// The tile walk, the ring, the producer and the staged stores are gemm_ring.cuh's.  The consumers run
// wgmma m64n128k32 .s32.s8.s8 straight into one int32 accumulator a tile, four k32 steps a stage: integer
// sums are exact in any order, so no per-block promotion.  A stage's wgmmas stay in flight while the
// next stage's barrier is awaited (wait_group 1); the stage before it is then released.  Partial last
// K box: its bytes past K are zeros on both sides (TMA fills the weight's, the copies the tokens').
// O % 128 != 0: the weight rows past O are zeros and their columns are never stored.
//
// Split K (decode batches): gemm_split.cuh's -- `splits` CTAs a tile, each the int32 sum of a contiguous
// range of K stages, written as an int32 partial tile; the tile's last CTA adds the partials as integers
// (exact: the same int32 sums as the unsplit walk) before the dequant above, so a split result is
// bit-equal to the unsplit one and to the reference.
//
// Needs K % 16 == 0 (16-byte strides for the weight's tensor map) and K < 2^17 (exact int32 sums); the
// lowering emits it only then (codegen/families/gemm_int8.py).
#pragma once
#include "common.cuh"
#include "gemm_ring.cuh"
#include "gemm_split.cuh"
#include "mbarrier.cuh"
#include "pdl.cuh"
#include "quant_int8.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace dsg {
namespace gemm_int8 {

using namespace dsg::gemm_ring;
using namespace dsg::gemm_split;
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 256 <= 65536, "gemm_int8: register file");

// ---- d (64 x 128 int32) (+)= a (64 x 32 s8) * b (32 x 128 s8), both K-major in shared memory ----
// wgmma.cuh's register layout: d[4j + 2h + c] = (row 16 w + l / 4 + 8 h, column 8 j + 2 (l % 4) + c),
// j < 16.  accumulate = 0: d = a * b (a tile's first step).
#define DSG_I8_D8(i) "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3]), "+r"(d[i + 4]), "+r"(d[i + 5]), "+r"(d[i + 6]), "+r"(d[i + 7])
__device__ __forceinline__ void mma_m64n128k32(int (&d)[64], unsigned long long a_desc, unsigned long long b_desc,
                                               int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8\n"
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"
      " %64, %65, p;\n}\n"
      : DSG_I8_D8(0), DSG_I8_D8(8), DSG_I8_D8(16), DSG_I8_D8(24), DSG_I8_D8(32), DSG_I8_D8(40), DSG_I8_D8(48),
        DSG_I8_D8(56)
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
#undef DSG_I8_D8

// Keep the compiler from moving accumulator reads across the asynchronous region (wgmma.cuh's
// fence_operands, for int32 accumulators).
__device__ __forceinline__ void fence_acc(int (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// Consumer warpgroup cw (0, 1): token rows 64 cw .. + 64 of each tile against its 128 weight rows.
template <typename T, int MODE, int O, int K, int ST, typename G>
__device__ __forceinline__ void consume(const float* __restrict__ sx, const float* __restrict__ sw0,
                                        const float* __restrict__ sw1, int num_tokens, int splits,
                                        int* __restrict__ partials, unsigned int* __restrict__ tickets,
                                        unsigned ring, unsigned long long* full, unsigned long long* empty,
                                        char* staging, T* __restrict__ y, int cw, G grid) {
  constexpr int KB = (K + BK - 1) / BK, COLS = tile_cols(MODE), NCT = (O + COLS - 1) / COLS;
  constexpr int CH = COLS / 8;                         // 16-byte chunks of a staged row
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, tid = threadIdx.x & 127;
  const bool vec = O % 8 == 0 && (reinterpret_cast<unsigned long long>(y) & 15ull) == 0;   // uniform
  const int tiles = num_tiles(num_tokens, MODE, O);
  __shared__ int last;                                 // split_arrive's answer to the consumers
  int acc[64];
  int it = 0;
  for (int i = grid.cta(); i < tiles * splits; i += grid.ctas()) {
    const Item w = item_of(i, tiles);
    const KRange kr = k_range(w.split, splits, KB);
    const int m0 = w.tile / NCT * BM, n0 = w.tile % NCT * COLS;
    const int ra = m0 + 64 * cw + 16 * warp + (lane >> 2), rb = ra + 8;   // this thread's two token rows
    // rows past T: any row's scale (never stored); loaded now, used after the K loop
    const float xs[2] = {sx[min(ra, num_tokens - 1)], sx[min(rb, num_tokens - 1)]};
    int prev = -1;                                     // the stage whose wgmmas may still be in flight
    for (int kb = kr.first; kb < kr.end; ++kb, ++it) {
      const StageDescs d = landed_stage<ST>(ring, full, it, cw);
#pragma unroll
      for (int k32 = 0; k32 < BK / 32; ++k32)
        mma_m64n128k32(acc, wgmma::desc_advance(d.a, k32), wgmma::desc_advance(d.b, k32),
                       (kb - kr.first) | k32);
      wgmma::commit();
      wgmma::wait<1>();                                // the previous stage's wgmmas are done: free it
      if (prev >= 0 && lane == 0) mbar::arrive(&empty[prev]);
      prev = it % ST;
    }
    wgmma::wait<0>();
    fence_acc(acc);
    if (lane == 0) mbar::arrive(&empty[prev]);
    const bool row_ok[2] = {ra < num_tokens, rb < num_tokens};
    if (splits > 1 && !split_arrive(acc, partials, tickets, w, tiles, splits, row_ok, &last)) continue;

    // Epilogue: acc[4j + 2h + c] is tile row 64 cw + 16 warp + lane / 4 + 8h, column 8j + 2 (lane % 4) + c
    // (SILU: j < 8 gate, j + 8 the same column's up).  Rounded into this warpgroup's staging rows (16-byte
    // chunk j of row r at chunk j ^ (r % 8): conflict-free writes and reads), then stored as whole chunks.
    wgmma::warpgroup_sync(1 + cw);                     // the last tile's chunks have all been read
#pragma unroll
    for (int jj = 0; jj < CH; ++jj) {
      float swg[2], swu[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = min(n0 + 8 * jj + 2 * (lane & 3) + c, O - 1);   // columns past O: never stored
        swg[c] = __ldg(sw0 + col);
        swu[c] = MODE == SILU ? __ldg(sw1 + col) : 0.f;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = warp * 16 + (lane >> 2) + 8 * h, at = 4 * jj + 2 * h;
        float v[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if constexpr (MODE == SILU) {
            const float g = round_to<T>(quant::dequant(acc[at + c], swg[c], xs[h]));
            const float u = round_to<T>(quant::dequant(acc[32 + at + c], swu[c], xs[h]));
            v[c] = round_to<T>(g / (1.f + expf(-g))) * u;
          } else {
            v[c] = quant::dequant(acc[at + c], swg[c], xs[h]);
          }
        }
        struct alignas(4) Pair { T lo, hi; } pr = {from_float<T>(v[0]), from_float<T>(v[1])};
        *reinterpret_cast<Pair*>(staging + rr * OUT_ROW_BYTES + 4 * (lane & 3) + ((jj ^ (rr & 7)) << 4)) = pr;
      }
    }
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

// y [T, O] (16-bit) = the int8 product above; w0 / sw0 the weight (SILU: the gate) and its channel
// scales, w1 / sw1 SILU's up (unused for LINEAR); qx rows QROW bytes apart.  `splits`: CTAs a tile (1: no
// split; the lowering's grid is then at most the tiles, else exactly tiles * splits); `partials`: splits *
// tiles * PARTIAL_WORDS int32 where splits > 1 (else possibly empty); `tickets`: TICKETS counters, zero
// between launches.  The lowering splits only while the tiles fit the tickets; past that (uniform) the
// CTA exits with y unwritten rather than index past them.  EARLY (Tuning.linear.gemm_weights_early): the
// first ring stages' weights issued before pdl_wait (gemm_ring.cuh begin_early).
// grid: the CTAs that run this GEMM (gemm_ring.cuh WholeGrid: a launch of one; PartGrid: a part's CTAs of a
// launch of several, gemm_multi.cuh).
template <typename T, int MODE, int O, int K, int QROW, int ST, int TICKETS, bool EARLY = false,
          typename G = WholeGrid>
__device__ __forceinline__ void gemm(const signed char* __restrict__ qx, const float* __restrict__ sx,
                                     const TensorMap* w0, const float* __restrict__ sw0, const TensorMap* w1,
                                     const float* __restrict__ sw1, T* __restrict__ y, int* __restrict__ partials,
                                     unsigned int* __restrict__ tickets, int num_tokens, int splits, char* smem,
                                     G grid = G{}) {
  static_assert(sizeof(T) == 2, "gemm_int8: 16-bit output");
  static_assert(K % 16 == 0, "gemm_int8: weight rows 16-byte multiples apart (TMA strides)");
  static_assert(K < 131072, "gemm_int8: int32 accumulators are exact below K = 2^17");
  static_assert(ST >= 2, "gemm_int8: a ring of at least two stages (one stage's wgmmas stay in flight)");
  static_assert(smem_bytes(ST) + 2 * ST * 8 <= 227 * 1024, "gemm_int8: ring + staging exceed a CTA's 227 KB");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST];
  if constexpr (EARLY) begin_early<MODE, O, K, QROW, ST, TICKETS>(w0, w1, num_tokens, splits, smem, full, empty, grid);
  dsg::pdl_wait();                                     // qx and sx are the quantiser's output
  if (splits > 1 && num_tiles(num_tokens, MODE, O) > TICKETS) return;
  const unsigned raw = smem_u32(smem);
  const unsigned ring = (raw + 1023u) & ~1023u;        // 128B-swizzle tiles start on 1024-byte boundaries
  if (!EARLY && threadIdx.x == 0) ring_init<ST>(full, empty);
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    wgmma::setmaxnreg_dec<PRODUCER_REGS>();
    produce<MODE, O, K, QROW, ST, EARLY ? AFTER_AHEAD : ALL>(reinterpret_cast<const unsigned char*>(qx), w0, w1,
                                                             num_tokens, splits, smem + (ring - raw), full, empty,
                                                             grid);
  } else {
    wgmma::setmaxnreg_inc<CONSUMER_REGS>();
    char* staging = smem + (ring - raw) + ST * STAGE_BYTES + (wg - 1) * OUT_BYTES;
    consume<T, MODE, O, K, ST>(sx, sw0, sw1, num_tokens, splits, partials, tickets, ring, full, empty, staging, y,
                               wg - 1, grid);
  }
  dsg::pdl_launch_dependents();
}

}  // namespace gemm_int8
}  // namespace dsg
