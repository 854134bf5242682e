"""templates/include/int4.cuh's W4A8 unpack, compiled on the CPU (NVRTC sm_90 and sm_90a) in its unit
kernel (tests/gpu/int4_unit.py): integer tensor-core mma on the unpacked operands, two LOP3 a packed
word (no sign-extension or byte permutes), the accumulator's exact shift, no spills or local memory.
Also: the unpack's arithmetic itself, emulated on the CPU over every byte value."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, opcodes  # noqa: E402
from tiny import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import int4_unit  # noqa: E402

from ir.formats_int import pack_int4, unpack_int4  # noqa: E402


def _unpack16(word: int) -> tuple[int, int]:
    """int4.cuh's unpack16 on one 32-bit word (Python ints)."""
    return (word << 4) & 0xF0F0F0F0, word & 0xF0F0F0F0


def _bytes(word: int) -> list[int]:
    return [((word >> (8 * i)) & 0xFF) - (256 if (word >> (8 * i)) & 0x80 else 0) for i in range(4)]


def test_the_unpack_gives_sixteen_times_each_nibble_of_every_byte():
    """Every byte value, as msModelSlim packs it: the even channel's operand byte is 16 * the low
    nibble's int4, the odd channel's 16 * the high nibble's (the definition: formats_int.unpack_int4)."""
    packed = torch.arange(256, dtype=torch.int16).sub(128).to(torch.int8).reshape(1, 256)
    q = unpack_int4(packed)                              # [2, 256]: row 0 the low nibbles
    assert torch.equal(pack_int4(q), packed)
    for b in range(256):
        word = (b & 0xFF) * 0x01010101
        even, odd = _unpack16(word)
        byte = b - 256 if b > 127 else b
        col = byte + 128
        assert _bytes(even) == [16 * int(q[0, col])] * 4 and _bytes(odd) == [16 * int(q[1, col])] * 4, b


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
def test_the_unit_kernel_unpacks_with_lop3_into_imma(arch):
    res = int4_unit.compile_unit(arch=arch, options=("--ptxas-options=-v",))
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
    ops = opcodes(res.cubin)
    mmas = ops["IMMA.16832.S8.S8"]
    assert mmas >= 2 and mmas % 2 == 0, sorted(ops)         # two k32 mmas a chunk (the loop unrolled)
    assert ops["LOP3.LUT"] >= 4 * mmas, "a LOP3 for each channel of a packed word, two words an mma"
    assert ops["SHF.R.S32.HI"] >= 4, "the exact >> 4 of each accumulator"
    assert not any(o.startswith(("PRMT", "I2F", "F2I", "HMMA", "LDL", "STL")) for o in ops), sorted(ops)
