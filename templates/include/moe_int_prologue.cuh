// The integer experts' down that quantises its own pair rows (Tuning.moe.int_down_prologue_upto): at a few
// tokens down's quantiser launch (quant_int8.cuh over the SwiGLU's NP pair rows) is a kernel boundary on the
// step's chain for a few KB of work, so here each CTA quantises the pair rows its expert reads (top-k picks
// an expert at most once a token: at T <= XQ tokens no expert has more than XQ pairs) into shared memory,
// int8_prologue.cuh's quantize_rows_shared (the quantiser's arithmetic: bit-equal), then runs moe_int.cuh's
// grouped_wi4 from there.  The rows sit at their pair index p, as in the quantiser's workspace, so grouped_wi4
// reads them unchanged: shared memory holds XQ * PAIRS rows (PAIRS: pairs a token), of which the CTA fills
// its expert's.  The CTAs of an expert's column tiles repeat the same few-KB quantisation.
//
// The expert of a CTA is known only after the PDL wait (the route's offsets), so, as grouped_wi4 itself,
// nothing is read before it.
#pragma once
#include "int8_prologue.cuh"
#include "moe_int.cuh"

namespace dsg {
namespace moe {

// The dynamic shared-memory layout (bytes from the base): int8 rows [XQ * PAIRS, qrow(KD)], their scales,
// the partial maxima of up to XQ rows.
template <int KD, int XQ, int PAIRS>
struct DownXqSmem {
  static constexpr int ROWS = XQ * PAIRS;
  static constexpr int Q = 0;
  static constexpr int S = ROWS * dsg::quant::qrow(KD);
  static constexpr int MAX = S + 4 * ROWS;
  static constexpr int BYTES = MAX + 4 * XQ * WI4_WARPS;
};

// out [NP, N] = grouped_wi4 DOWN of a [NP, KD] (dense pair rows) quantised per row in this CTA's prologue,
// for T <= XQ tokens of PAIRS pairs (the lowering's grid is 0 above).  smem: DownXqSmem::BYTES.
template <typename T, int E, int N, int KD, int PACK, int GROUP, int XQ, int PAIRS>
__device__ __forceinline__ void grouped_wi4_down_xq(const T* __restrict__ a, const signed char* __restrict__ w,
                                                    const float* __restrict__ s, const float* __restrict__ g,
                                                    const i32* __restrict__ order, const i32* __restrict__ offsets,
                                                    T* __restrict__ out, unsigned char* smem) {
  typedef DownXqSmem<KD, XQ, PAIRS> L;
  signed char* q = reinterpret_cast<signed char*>(smem + L::Q);
  float* sx = reinterpret_cast<float*>(smem + L::S);
  dsg::pdl_wait();   // the routing and the SwiGLU rows are other kernels' outputs
  const int e = nth_light_expert<E, 0>(offsets, blockIdx.y, false);   // the same in every warp
  if (e >= 0 && (int)blockIdx.x * wi4_channels(DOWN) < N) {
    const int beg = offsets[e];
    const int n = min(offsets[e + 1] - beg, XQ);
    auto pair_of = [&](int t) { return order[beg + t]; };
    auto row_of = [&](int t) { return a + (i64)pair_of(t) * KD; };
    dsg::quant::quantize_rows_shared<T, KD, WI4_THREADS>(row_of, pair_of, n, KD % 8 == 0 && aligned16(a), q, sx,
                                                         reinterpret_cast<float*>(smem + L::MAX));
  }
  grouped_wi4<T, DOWN, E, N, KD, 1, PACK, GROUP>(q, sx, w, w, s, s, g, g, order, offsets, out);
}

}  // namespace moe
}  // namespace dsg
