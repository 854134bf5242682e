"""The unit kernel of templates/include/int4.cuh's W4A8 unpack (compiled on the CPU by
tests/codegen/test_int4_unpack.py, run by tests/gpu/test_kernels_int4_unpack.py): the exact int32
sums acc [8, O] = x [8, K] (int8) . W [O, K]^T of packed int4 weights stored as msModelSlim writes
them ([O / 2, K] bytes, two channels a byte along O), through the mma fragments a kernel would use.

One warp a CTA, a CTA per 16 channels (8 packed rows), one n8 tile of 8 tokens; K % 64 == 0 and
16-byte aligned rows (the unit's simplifications: a kernel adds the edges)."""
from __future__ import annotations

NAME = "int4_unpack_unit"
THREADS = 32
CHANNELS_PER_CTA = 16
TOKENS = 8
K_STEP = 64

SOURCE = r'''
#include "int4.cuh"

extern "C" __global__ void __launch_bounds__(32) int4_unpack_unit(
    const unsigned char* __restrict__ w, const signed char* __restrict__ x, int* __restrict__ acc, int K, int O) {
  const int lane = threadIdx.x, g = lane >> 2, c = lane & 3;
  const int j = blockIdx.x * 8 + g;                 // this thread's packed row: channels 2j, 2j + 1
  int d[4] = {0, 0, 0, 0};
  for (int k = 16 * c; k < K; k += 64) {
    const uint4 p = *reinterpret_cast<const uint4*>(w + (long long)j * K + k);
    const uint4 v = *reinterpret_cast<const uint4*>(x + (long long)g * K + k);
    dsg::int4::mma_chunk_s4(d, p, v);
  }
  // d0 d1: channel 2j at tokens 2c, 2c + 1; d2 d3: channel 2j + 1
  acc[(2 * c) * O + 2 * j] = dsg::int4::unscale16(d[0]);
  acc[(2 * c + 1) * O + 2 * j] = dsg::int4::unscale16(d[1]);
  acc[(2 * c) * O + 2 * j + 1] = dsg::int4::unscale16(d[2]);
  acc[(2 * c + 1) * O + 2 * j + 1] = dsg::int4::unscale16(d[3]);
}
'''


def compile_unit(templates_dir=None, arch: str = "sm_90", options: tuple[str, ...] = ()):
    """NVRTC's CompileResult for the unit kernel, with int4.cuh from `templates_dir` (None: templates/)."""
    from codegen.nvrtc import compile_cubin
    from codegen.render import include_closure
    return compile_cubin(SOURCE, NAME, arch=arch, options=options, headers=include_closure(SOURCE, templates_dir))
