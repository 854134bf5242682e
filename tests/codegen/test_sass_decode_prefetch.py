"""The decode attention's tensor-core split (mla_decode.cuh) reads the step's metadata and the
cache rows of earlier steps before its pdl_wait() (cp.async, LDGSTS), and still writes nothing and
leaves no path before it; its metadata is one round trip.  Compiled with NVRTC on the CPU from the
committed goldens."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402
from test_sass_pdl import wait_problem  # noqa: E402

from codegen.nvrtc import compile_cubin  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
KERNELS = ["deepseek_v2_lite/mla_decode_attention__bf16__c512_r64__h16__page64__s8",
           "deepseek_v2_lite/mla_decode_attention__bf16__c512_r64__h16__page64",
           "deepseek_v3/mla_decode_attention__bf16__c512_r64__h128__page64__s2"]


def _sass(path: str):
    name = os.path.basename(path)
    src = open(os.path.join(GOLDEN, path + ".cu")).read()
    cubin = compile_cubin(src, name, arch="sm_90a").cubin
    return instructions(cubin)[name]


def _before_wait(instrs) -> list:
    first = min(i.addr for i in instrs if i.opcode == "ACQBULK")
    return [i.opcode for i in instrs if i.addr < first]


@pytest.mark.parametrize("path", KERNELS)
def test_earlier_steps_rows_are_copied_before_the_wait(path):
    on = _sass(path)
    assert wait_problem(on, weight_loads=True) is None      # loads only: no write, no exit before it
    early = _before_wait(on)
    assert any(op.startswith("LDGSTS") for op in early), "no cache row is copied before the wait"


def _loads_before_first_use(instrs) -> int:
    """Global loads issued, in address order from the kernel's start, before the first instruction
    that reads a register one of them loads into (a load's address included): the loads that share
    the first round trip.  Branch targets are not followed, which also leaves out a loop's body."""
    pending, issued = set(), 0
    for i in instrs:
        regs = re.findall(r"\bR(\d+)(?:\.64)?\b", i.operands)
        first_is_dest = re.match(r"\s*R\d+\b", i.operands) is not None and not i.opcode.startswith(("ST", "RED"))
        sources = regs[1:] if first_is_dest else regs
        wide = [int(r) for r in re.findall(r"\bR(\d+)\.64\b", i.operands)]
        reads = {int(r) for r in sources} | {r + 1 for r in wide}
        if reads & pending:
            return issued
        if i.opcode.startswith("LDG") and not i.opcode.startswith("LDGSTS"):
            n = 2 if ".64" in i.opcode else 4 if ".128" in i.opcode else 1
            d = int(regs[0])
            pending |= set(range(d, d + n))
            issued += 1
    return issued


def test_the_step_metadata_is_one_round_trip_before_the_wait():
    # DecodeSplit::rows(): the sequence guessed (one token a sequence), so the query range, the
    # context length and the position are loaded together; searching first took two round trips at
    # one sequence and log2(B) + 2 at B
    on = _sass("deepseek_v2_lite/mla_decode_attention__bf16__c512_r64__h16__page64__s8")
    assert _loads_before_first_use(on) >= 4
    # and the block table's row towards L1 with them (DecodeSplit::warm_table): the page lookups
    # after rows() hit L1 instead of a second round trip
    first_load = min(i.addr for i in on if i.opcode.startswith("LDG"))
    assert any(i.opcode.startswith("CCTL") and ".PF1" in i.opcode and i.addr < first_load for i in on)
