// W4A8 weights (msModelSlim's int4_channel, ir/formats.py): two signed int4 a byte along the output
// dimension, byte[j, k] = (q[2j + 1, k] << 4) | (q[2j, k] & 0xF), widened to int8 mma operands in
// registers (Hopper has no int4 mma), QServe-style:
//
// - Map mma row g of a 16-row tile to channel 2j and row g + 8 to channel 2j + 1 (j = j0 + g: the tile
//   is packed rows j0 .. j0 + 7, channels 2 j0 .. 2 j0 + 15 interleaved).  One packed 32-bit word of
//   row j at 4 consecutive k then holds both of a thread's rows at those k: a0 / a1 (and a2 / a3) of
//   imma.cuh's fragment come from one word.
// - Low nibbles (channel 2j): (w << 4) & 0xF0F0F0F0; high nibbles (2j + 1): w & 0xF0F0F0F0.  Each byte
//   is then the nibble in the top half of a signed byte: 16 * q exactly (-128 .. 112): a LOP3 for the
//   odd channel's four weights, a shift and a LOP3 for the even's (3 integer ops per 8 weights, as
//   ptxas emits them for sm_90), no sign extension, no PRMT.
// - The mma sums 16 * q * x; the int32 accumulator is a multiple of 16, and an arithmetic shift right
//   by 4 is the exact sum (|16 q x| <= 2^14, as for int8: exact below K = 2^17).
// - K: a thread takes 16 consecutive packed bytes of its row (16 k of two channels) and the same 16 k
//   of its token's int8 activations, as int8.cuh does, so activations are loaded and permuted exactly
//   as for int8 weights (a dot product does not see the order of k inside a step).
//
// The accumulator of channel 2j and that of 2j + 1 for one token sit in one thread (d0 / d2, d1 / d3),
// so an epilogue writing y [T, O] stores the two neighbouring channels as one 32-bit pair.
#pragma once
#include "imma.cuh"

namespace dsg {
namespace int4 {

// One packed word (4 k of packed row j) -> the mma operands of channel 2j (even) and 2j + 1 (odd),
// each byte 16 * q.
__device__ __forceinline__ void unpack16(unsigned w, unsigned& even, unsigned& odd) {
  even = (w << 4) & 0xF0F0F0F0u;
  odd = w & 0xF0F0F0F0u;
}

// The exact sum from an accumulator of 16 * q products.
__device__ __forceinline__ int unscale16(int acc) { return acc >> 4; }

// d += 16 * (channels 2j, 2j + 1 as mma rows g, g + 8) x (token row g) over the 16 k of one chunk:
// `packed` is 16 bytes of packed row j at k0 .. k0 + 15, `x` the token's int8 activations at the
// same k; two k32 mmas.
__device__ __forceinline__ void mma_chunk_s4(int (&d)[4], const uint4& packed, const uint4& x) {
  unsigned e0, o0, e1, o1;
  unpack16(packed.x, e0, o0);
  unpack16(packed.y, e1, o1);
  dsg::mma::mma16832_s8(d, e0, o0, e1, o1, x.x, x.y);
  unpack16(packed.z, e0, o0);
  unpack16(packed.w, e1, o1);
  dsg::mma::mma16832_s8(d, e0, o0, e1, o1, x.z, x.w);
}

}  // namespace int4
}  // namespace dsg
