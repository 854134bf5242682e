// 4h. The grouped expert GEMM with msModelSlim's per-channel integer weights and int8 activations on
// Hopper's int8 wgmma + TMA (sm_90a): prefill's many pairs per expert.  The walk, gather and tiles of
// 4g (moe_gemm_fp8.cuh: a persistent grid over (row tile of 128 pairs of one expert, column tile),
// warpgroup 0 producing, warpgroups 1 and 2 consuming 64 pairs each through gemm_ring.cuh's ring), with
// the product of gemm_int8.cuh and the arithmetic of moe_int.cuh (ir/formats_int.py int_linear):
//
//   acc[p, o] = sum over all of KD of qx[r(p), k] * qw[e][o, k]        int32, exact (below)
//   y[p, o]   = (float(acc) * s_w[e][o]) * s_x[r(p)]                  quant_int8.cuh dequant
//
// qx [R, KD] int8 and s_x [R] fp32: the rows quantised per row by _moe_int's quantiser launch (gate_up:
// x's token rows, r(p) = p / K, one quantisation a token shared by its pairs; down: the pair rows, r(p) =
// p).  The epilogue rounds as moe_int.cuh's does (DOWN: y rounded; GATE_UP_SILU: gate and up rounded,
// silu(gate) rounded, times up), so where both sum exactly every output is bit-equal to mma_int's.
// No per-K-block promotion: the int32 tile sums all of K (|16 q x| <= 128 * 127 < 2^14 a product, so
// |acc| < KD * 2^14 < 2^31 for KD < 2^17).
//
// PACK 1 (int8_channel): the weight rows are int8 boxes, produced by moe_gemm_fp8.cuh's producer unchanged
// (fp8x_produce: the same ring, boxes and gather for any one-byte operands).  PACK 2 (int4_channel, two
// int4 a byte along N: byte[j, k] = (q[2j + 1, k] << 4) | (q[2j, k] & 0xF)): TMA brings the PACKED rows
// into a staging buffer of the stage (DOWN: 64 packed rows = 128 channels; the gate_up modes: 32 packed
// gate rows, then the same 32 up rows), and the producer's 128 threads unpack each 16-byte chunk into the
// stage's int8 weight rows at the SAME swizzled offset (the halves are multiples of 1024 bytes apart, so
// a chunk keeps its 128B-swizzle position): even channels (w << 4) & 0xF0F0F0F0, odd ones w & 0xF0F0F0F0,
// each byte 16 * q exactly (int4.cuh), the /16 an exact shift of the int32 sum.  Tile row r of a half of
// H rows (DOWN: H = 64; gate and up: H = 32 each) is channel n0 + 2r for r < H, n0 + 2(r - H) + 1 above;
// gate and up use the same permutation, so a consumer's gate column and up column stay one channel.
// Barriers of a PACK 2 stage: `landed` (thread 0's expect_tx, the TMA's bytes) gates the unpackers; `full`
// counts the 128 gather arrivals (cp.async) and the 128 unpackers' arrivals, so the consumers see the
// stage only once unpacked; the staging buffer is overwritten only after `empty`, i.e. after every
// unpacker arrived on `full`.  The unpack of a step runs IWG_LAG steps behind its issue (iwg_unpack_step).
//
// Ceil widths: KD % 128 != 0 -- the last box's bytes past KD are zeros on both sides (TMA fills the weight's,
// the gather the rows'); N % (tile channels) != 0 -- the packed or int8 rows past N (N / 2 packed) are zeros
// from TMA and their channels are never stored (a box always starts inside the tensor: n0 < N; PACK 1 DOWN
// leaves out a second box that would start past N).
//
// Needs 16-bit outputs, KD % 16 == 0 (whole 16-byte chunks; 16-byte strides of the tensor maps), KD < 2^17
// and, for PACK 2, N even; the lowering emits it only then (codegen/families/_moe_gemm_int.py), else mma_int
// serves.
#pragma once
#include "gemm_int8.cuh"
#include "int4.cuh"
#include "moe_gemm_fp8.cuh"
#include "quant_int8.cuh"

namespace dsg {
namespace moe {

namespace ring = dsg::gemm_ring;
namespace i8g = dsg::gemm_int8;

// Output columns a tile covers.
__host__ __device__ constexpr int iwg_tile_cols(int mode) { return mode == DOWN ? ring::BN : ring::BN / 2; }
// Bytes of a stage's packed staging buffer (PACK 2: 64 packed rows of 128 bytes; PACK 1: none).
__host__ __device__ constexpr int iwg_unpack_bytes(int pack) { return pack == 2 ? ring::BOX * ring::ROW_BYTES : 0; }
// Dynamic shared memory: gemm_ring.cuh's ring, staging and alignment slack, then the packed staging.
__host__ __device__ constexpr int iwg_smem(int pack, int stages) {
  return ring::smem_bytes(stages) + stages * iwg_unpack_bytes(pack);
}
// Tile rows a packed half unpacks into (DOWN: one half of 64 even + 64 odd rows; gate, up: 32 + 32 each).
__host__ __device__ constexpr int iwg_half(int mode) { return mode == DOWN ? 64 : 32; }

// The output column (from n0) of the tile's weight row w (the accumulator's column).
template <int MODE, int PACK>
__device__ __forceinline__ int iwg_col(int w) {
  constexpr int H = iwg_half(MODE);
  if constexpr (PACK == 2) return w < H ? 2 * w : 2 * (w - H) + 1;
  return w;
}

// The exact sum from an accumulator (PACK 2 summed 16 * q * x).
template <int PACK>
__device__ __forceinline__ int iwg_sum(int acc) {
  return PACK == 2 ? acc >> 4 : acc;
}

// The ring's barriers (thread 0; the caller's __syncthreads publishes them).  full[s]: the producer's 128
// copy arrivals, plus its expect_tx (PACK 1) or its 128 unpackers' arrivals (PACK 2); landed[s] (PACK 2):
// thread 0's expect_tx of the packed boxes; empty[s]: one arrival per consumer warp.
template <int PACK, int ST>
__device__ __forceinline__ void iwg_ring_init(unsigned long long* full, unsigned long long* empty,
                                              unsigned long long* landed) {
#pragma unroll
  for (int s = 0; s < ST; ++s) {
    mbar::init(&full[s], PACK == 2 ? 128 + 128 : 128 + 1);
    mbar::init(&empty[s], 8);
    if (PACK == 2) mbar::init(&landed[s], 1);
  }
  mbar::init_fence();
}

// PACK 2: thread p's four 16-byte chunks of the landed packed staging `pk` into the stage's int8 weight
// rows b, each at its own swizzled offset in its half.
template <int MODE>
__device__ __forceinline__ void iwg_unpack(const char* pk, char* b, int p) {
  constexpr int H = iwg_half(MODE) * ring::ROW_BYTES;    // bytes of a packed half = of its even rows
#pragma unroll
  for (int i = 0; i < iwg_unpack_bytes(2) / 16 / 128; ++i) {
    const int off = 16 * (p + 128 * i), g = off / H, r = off % H;
    const uint4 w = *reinterpret_cast<const uint4*>(pk + off);
    uint4 ev, od;
    dsg::int4::unpack16(w.x, ev.x, od.x);
    dsg::int4::unpack16(w.y, ev.y, od.y);
    dsg::int4::unpack16(w.z, ev.z, od.z);
    dsg::int4::unpack16(w.w, ev.w, od.w);
    char* even_row = b + g * 2 * H + r;
    char* odd_row = even_row + H;
    *reinterpret_cast<uint4*>(even_row) = ev;
    *reinterpret_cast<uint4*>(odd_row) = od;
  }
}

// PACK 2: ring step `step`'s packed boxes, once landed, unpacked into its stage, which is then full (with its
// gathered rows).  The producer unpacks step it - IWG_LAG after issuing step it, so each packed box has
// IWG_LAG steps' time to land while the producer issues on (a step waiting on its own box would expose the
// TMA's latency every step).  IWG_LAG <= ST - 2 keeps the ring live: step it's empty wait needs step it - ST
// released, and a consumer releases a stage only after its wgmmas of the NEXT step are issued (wait<1>), i.e.
// after step it - ST + 1 is full -- unpacked at producer step it - ST + 1 + IWG_LAG, which must come before
// step it (IWG_LAG = ST - 1 deadlocks at the first step it whose it - ST and it - ST + 1 are one tile's).
constexpr int IWG_LAG = 2;
template <int MODE, int ST>
__device__ __forceinline__ void iwg_unpack_step(char* ring_, char* unpack, unsigned long long* full,
                                                unsigned long long* landed, int step, int p) {
  const int s = step % ST;
  mbar::wait(&landed[s], (step / ST) & 1);
  iwg_unpack<MODE>(unpack + s * iwg_unpack_bytes(2), ring_ + s * ring::STAGE_BYTES + ring::BM * ring::ROW_BYTES, p);
  mbar::fence_proxy_async();                           // the unpacked rows are generic writes wgmma reads
  mbar::arrive(&full[s]);
}

// PACK 2, one tile's stages (packed weight rows from n0 / 2 of expert e, the tile's gathered rows src) into the
// ring, unpacking the step IWG_LAG before each (iwg_unpack_step).  (PACK 1 runs moe_gemm_fp8.cuh's producer
// as it is: the same ring, boxes and gather for one-byte operands.)
template <int MODE, int KD, int ST, int R>
__device__ __forceinline__ void iwg_produce_tile(const unsigned char* __restrict__ qx, const TensorMap* w0,
                                                 const TensorMap* w1, const int (&src)[R], int e, int n0, int p,
                                                 char* ring_, char* unpack, unsigned long long* full,
                                                 unsigned long long* empty, unsigned long long* landed, int& it) {
  constexpr int KB = (KD + ring::BK - 1) / ring::BK;
  const int c = p & 7, r0 = p >> 3;
  const int chunk = (c ^ (r0 & 7)) * 16;               // 128B swizzle: c ^ (row % 8)
  for (int kb = 0; kb < KB; ++kb, ++it) {
    const int s = it % ST;
    mbar::wait(&empty[s], ((it / ST) & 1) ^ 1);
    char* a = ring_ + s * ring::STAGE_BYTES;
    char* pk = unpack + s * iwg_unpack_bytes(2);
    const int k0 = kb * ring::BK;
    if (p == 0) {                                      // DOWN one box of 64 packed rows, gate_up gate's 32, up's 32
      mbar::arrive_expect_tx(&landed[s], iwg_unpack_bytes(2));
      tma::load_3d(pk, w0, k0, n0 / 2, e, &landed[s]);
      if (MODE != DOWN) tma::load_3d(pk + iwg_unpack_bytes(2) / 2, w1, k0, n0 / 2, e, &landed[s]);
    }
    // the pair rows: thread p's 16 bytes of K of rows r0 + 16 i (zeros past the tile and past KD)
#pragma unroll
    for (int i = 0, kc = k0 + 16 * c; i < R; ++i) {
      const int off = src[i] >= 0 && kc < KD ? 16 : 0;
      dsg::mma::cp_async16(a + (r0 + 16 * i) * ring::ROW_BYTES + chunk, qx + (off ? (i64)src[i] * KD + kc : 0), off);
    }
    mbar::arrive_on_cp_async(&full[s]);
    if (it >= IWG_LAG) iwg_unpack_step<MODE, ST>(ring_, unpack, full, landed, it - IWG_LAG, p);
  }
}

// PACK 2's producer: the 128 threads of warpgroup 0 on fp8x_produce's walk, then the last steps' unpacks.
template <int MODE, int E, int N, int KD, int K, int ST>
__device__ __forceinline__ void iwg_produce(const unsigned char* __restrict__ qx, const TensorMap* w0,
                                            const TensorMap* w1, const i32* __restrict__ order,
                                            const i32* __restrict__ offsets, const int* tiles, char* ring_,
                                            char* unpack, unsigned long long* full, unsigned long long* empty,
                                            unsigned long long* landed) {
  constexpr int COLS = iwg_tile_cols(MODE), NCT = (N + COLS - 1) / COLS;
  const int p = threadIdx.x;
  if (p == 0) {
    tma::prefetch(w0);
    if (MODE != DOWN) tma::prefetch(w1);
  }
  int it = 0;
  for (int t = blockIdx.x; t < tiles[E] * NCT; t += gridDim.x) {
    const WgTile tl = wgmma_tile<E, NCT, COLS>(tiles, offsets, t);
    int src[ring::BM / 16];
    fp8x_src_rows<MODE, K>(order, tl, p >> 3, src);
    iwg_produce_tile<MODE, KD, ST>(qx, w0, w1, src, tl.e, tl.n0, p, ring_, unpack, full, empty, landed, it);
  }
  for (int step = it < IWG_LAG ? 0 : it - IWG_LAG; step < it; ++step)   // the last steps' boxes
    iwg_unpack_step<MODE, ST>(ring_, unpack, full, landed, step, p);
  dsg::mma::cp_async_wait<0>();                        // nothing of this thread's left in flight at exit
}

// Consumer warpgroup cw (0, 1): tile rows 64 cw .. + 64 against the tile's 128 weight rows, the int32
// sums of all of K (gemm_int8.cuh's K loop), then dequantised, rounded and stored as moe_int.cuh does.
template <typename T, int MODE, int E, int N, int KD, int K, int PACK, int ST>
__device__ __forceinline__ void iwg_consume(const float* __restrict__ sx, const float* __restrict__ sw0,
                                            const float* __restrict__ sw1, const i32* __restrict__ order,
                                            const i32* __restrict__ offsets, const int* tiles, unsigned ring_,
                                            unsigned long long* full, unsigned long long* empty, char* staging,
                                            T* __restrict__ out, int cw) {
  constexpr int KB = (KD + ring::BK - 1) / ring::BK;
  constexpr int COLS = iwg_tile_cols(MODE), NCT = (N + COLS - 1) / COLS, CH = COLS / 8;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, tid = threadIdx.x & 127;
  const bool vec = N % 8 == 0 && aligned_to<16>(out);  // uniform
  const int total = tiles[E] * NCT;
  int acc[64];
  int it = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const WgTile tl = wgmma_tile<E, NCT, COLS>(tiles, offsets, t);
    // this thread's two tile rows' quantised rows (rows past the tile: row 0's scale, never stored)
    const int ra = 64 * cw + 16 * warp + (lane >> 2), rb = ra + 8;
    const int pa = ra < tl.rows ? order[tl.pbeg + ra] : -1, pb = rb < tl.rows ? order[tl.pbeg + rb] : -1;
    const float xs[2] = {sx[pa < 0 ? 0 : (MODE == DOWN ? pa : pa / K)], sx[pb < 0 ? 0 : (MODE == DOWN ? pb : pb / K)]};
    const float* swg = sw0 + (i64)tl.e * N;
    const float* swu = (MODE == DOWN ? sw0 : sw1) + (i64)tl.e * N;
    int prev = -1;                                     // the stage whose wgmmas may still be in flight
    for (int kb = 0; kb < KB; ++kb, ++it) {
      const ring::StageDescs d = ring::landed_stage<ST>(ring_, full, it, cw);
#pragma unroll
      for (int k32 = 0; k32 < ring::BK / 32; ++k32)
        i8g::mma_m64n128k32(acc, wgmma::desc_advance(d.a, k32), wgmma::desc_advance(d.b, k32), kb | k32);
      wgmma::commit();
      wgmma::wait<1>();                                // the previous stage's wgmmas are done: free it
      if (prev >= 0 && lane == 0) mbar::arrive(&empty[prev]);
      prev = it % ST;
    }
    wgmma::wait<0>();
    i8g::fence_acc(acc);
    if (lane == 0) mbar::arrive(&empty[prev]);

    // Epilogue: acc[4j + 2h + c] is tile row 64 cw + 16 warp + lane / 4 + 8h, weight row w = 8j + 2 (lane % 4)
    // + c (GATE_UP_SILU: j < 8 gate, j + 8 the same channel's up), output column iwg_col(w).  Rounded into
    // this warpgroup's staging rows (16-byte chunk j of row r at chunk j ^ (r % 8)), then stored as chunks.
    wgmma::warpgroup_sync(1 + cw);                     // the last tile's chunks have all been read
#pragma unroll
    for (int i = 0; i < (MODE == DOWN ? 64 : 32); ++i) {
      const int j = i >> 2, h = (i >> 1) & 1, c = i & 1;
      const int col = iwg_col<MODE, PACK>(8 * j + 2 * (lane & 3) + c);
      const int ch = min(tl.n0 + col, N - 1);          // columns past N: never stored
      const int rr = warp * 16 + (lane >> 2) + 8 * h;
      float v;
      if constexpr (MODE == GATE_UP_SILU) {
        const float g = round_to<T>(quant::dequant(iwg_sum<PACK>(acc[i]), __ldg(swg + ch), xs[h]));
        const float u = round_to<T>(quant::dequant(iwg_sum<PACK>(acc[32 + i]), __ldg(swu + ch), xs[h]));
        v = round_to<T>(g / (1.f + expf(-g))) * u;
      } else {
        v = quant::dequant(iwg_sum<PACK>(acc[i]), __ldg(swg + ch), xs[h]);
      }
      *reinterpret_cast<T*>(staging + rr * ring::OUT_ROW_BYTES + (((col >> 3) ^ (rr & 7)) << 4) + 2 * (col & 7)) =
          from_float<T>(v);
    }
    wgmma::warpgroup_sync(1 + cw);                     // the staging rows are whole
#pragma unroll
    for (int q = 0; q < 64 * CH / 128; ++q) {
      const int idx = tid + 128 * q, r = idx / CH, chn = idx % CH;
      const int tr = 64 * cw + r;
      const int orow = tr < tl.rows ? order[tl.pbeg + tr] : -1;
      const int col = tl.n0 + 8 * chn;
      if (orow < 0 || col >= N) continue;
      const uint4 chunk = *reinterpret_cast<const uint4*>(staging + r * ring::OUT_ROW_BYTES + ((chn ^ (r & 7)) << 4));
      ring::store_chunk<T, N>(out + (i64)orow * N + col, chunk, col, vec);
    }
  }
}

// out [NP, N] = the integer product above for every pair; w0 / sw0 the weight (gate for GATE_UP_SILU)
// as a tensor map of its stored bytes [E, N / PACK, KD] and its channel scales [E, N, 1], w1 / sw1 up's
// (DOWN: w0 / sw0 again).
template <typename T, int MODE, int E, int N, int KD, int K, int PACK, int ST>
__device__ __forceinline__ void grouped_gemm_int(const signed char* __restrict__ qx, const float* __restrict__ sx,
                                                 const TensorMap* w0, const float* __restrict__ sw0,
                                                 const TensorMap* w1, const float* __restrict__ sw1,
                                                 const i32* __restrict__ order, const i32* __restrict__ offsets,
                                                 T* __restrict__ out, char* smem) {
  static_assert(MODE == GATE_UP_SILU || MODE == DOWN, "int wgmma experts: GATE_UP_SILU or DOWN");
  static_assert(sizeof(T) == 2, "int wgmma experts: 16-bit outputs");
  static_assert(KD % 16 == 0, "int wgmma experts: quantised rows of whole 16-byte chunks");
  static_assert(KD < 131072, "int wgmma experts: int32 accumulators are exact below KD = 2^17");
  static_assert(PACK == 1 || (PACK == 2 && N % 2 == 0), "int wgmma experts: packed int4, two output channels a byte");
  static_assert(ST >= 2 && (PACK == 1 || ST >= IWG_LAG + 2), "int wgmma experts: a ring of at least two stages, "
                "packed int4 at least two more than the unpack's lag (iwg_unpack_step)");
  static_assert(ring::BM == WG_BM, "int wgmma experts: the row tiles of wgmma_row_tiles");
  static_assert(iwg_smem(PACK, ST) + 3 * ST * 8 + 4 * (E + 1) <= 227 * 1024,
                "int wgmma experts: ring + staging + row-tile table exceed a CTA's 227 KB (_moe_gemm_int.fits)");
  __shared__ __align__(8) unsigned long long full[ST], empty[ST], landed[ST];
  __shared__ int tiles[E + 1];
  dsg::pdl_wait();                                     // offsets, order, qx and sx: earlier kernels' outputs
  const unsigned raw = smem_u32(smem);
  const unsigned base = (raw + 1023u) & ~1023u;        // 128B-swizzle tiles start on 1024-byte boundaries
  char* ring_ = smem + (base - raw);
  if (threadIdx.x < 32) wgmma_row_tiles<E>(offsets, tiles);
  if (threadIdx.x == 0) iwg_ring_init<PACK, ST>(full, empty, landed);
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    wgmma::setmaxnreg_dec<i8g::PRODUCER_REGS>();
    const unsigned char* q = reinterpret_cast<const unsigned char*>(qx);
    if constexpr (PACK == 2) {
      char* unpack = ring_ + ST * ring::STAGE_BYTES + 2 * ring::OUT_BYTES;   // 1024-byte aligned: whole stages
      iwg_produce<MODE, E, N, KD, K, ST>(q, w0, w1, order, offsets, tiles, ring_, unpack, full, empty, landed);
    } else {
      fp8x_produce<MODE, E, N, KD, K, ST, false>(q, w0, w1, order, offsets, tiles, ring_, full, empty);
    }
  } else {
    wgmma::setmaxnreg_inc<i8g::CONSUMER_REGS>();
    char* staging = ring_ + ST * ring::STAGE_BYTES + (wg - 1) * ring::OUT_BYTES;
    iwg_consume<T, MODE, E, N, KD, K, PACK, ST>(sx, sw0, sw1, order, offsets, tiles, base, full, empty, staging, out,
                                                wg - 1);
  }
  dsg::pdl_launch_dependents();
}

}  // namespace moe
}  // namespace dsg
