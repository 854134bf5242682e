"""Property test: templates/include/int4.cuh's W4A8 unpack in its unit kernel (tests/gpu/int4_unit.py)
gives the exact integer sums acc [8, O] = x . W^T of msModelSlim's packed int4 weights (two channels a
byte along O, the low nibble the even channel: ir/formats_int.py unpack_int4), bit for bit against
the int64 reference.  Packed bytes are uniform over 0..255 (every nibble, both signs, -8 included),
activations over the whole int8 range (-128 included); the accumulator is poisoned first.  Planted
mutants (tests/gpu/test_mutants.py): the nibbles swapped, the >> 4 of the shifted unpack dropped.

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_int4_unpack.py
"""
from __future__ import annotations

import functools

import torch
from hypothesis import example, given, strategies as st

import int4_unit
from harness import GPU_MARKS, poison
from kernel_cases import kernel_test, templates_dir

from ir.formats_int import unpack_int4

pytestmark = GPU_MARKS
SETTINGS = kernel_test(30)


@functools.lru_cache(maxsize=None)
def _function(folder: str | None):
    from runtime.cuda_driver import LoadedModule
    module = LoadedModule.load(int4_unit.compile_unit(folder).cubin, int4_unit.NAME)
    return module, module.function(int4_unit.NAME)


def run_unit(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """acc [8, O] int32 from packed [O / 2, K] int8 and x [8, K] int8 (CUDA tensors)."""
    from runtime.cuda_driver import I32, launch
    half, K = packed.shape
    O = 2 * half
    acc = poison(torch.empty((int4_unit.TOKENS, O), dtype=torch.int32, device="cuda"))
    _, fn = _function(templates_dir())
    launch(fn, (O // int4_unit.CHANNELS_PER_CTA, 1, 1), (int4_unit.THREADS, 1, 1), 0,
           [packed, x, acc, I32(K), I32(O)])
    torch.cuda.synchronize()
    return acc


@SETTINGS
@given(tiles=st.integers(1, 40), steps=st.integers(1, 64), seed=st.integers(0, 2**31))
@example(tiles=1, steps=1, seed=1)
@example(tiles=32, steps=112, seed=2)      # V3's expert gate / up: K = 7168 (512 of its 2048 channels)
@example(tiles=8, steps=32, seed=3)        # V2-Lite's: K = 2048
def test_int4_unpack_exact(tiles, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    O, K = tiles * int4_unit.CHANNELS_PER_CTA, steps * int4_unit.K_STEP
    packed = torch.randint(-128, 128, (O // 2, K), generator=gen, dtype=torch.int32).to(torch.int8)
    x = torch.randint(-128, 128, (int4_unit.TOKENS, K), generator=gen, dtype=torch.int32).to(torch.int8)
    got = run_unit(packed.cuda(), x.cuda())
    want = (x.long() @ unpack_int4(packed).long().T).to(torch.int32)
    bad = (got.cpu() != want).nonzero()[:5].tolist()
    assert not bad, f"O={O} K={K}: {int((got.cpu() != want).sum())} sums differ, first at {bad}: " + \
        ", ".join(f"{int(got[t, o])} vs {int(want[t, o])}" for t, o in bad)
