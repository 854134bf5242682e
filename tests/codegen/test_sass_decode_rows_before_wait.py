"""The decode attention's tensor-core split has a switch (mla_decode.cuh DSG_DECODE_ROWS_BEFORE_WAIT,
on by default since PERF_NOTES v26): on, it reads the step's metadata and the cache
rows of earlier steps before its pdl_wait() (cp.async, LDGSTS) and still writes nothing and leaves
no path before it; off, nothing global is read before the wait (test_sass_pdl's strict check).
Compiled with NVRTC on the CPU from the committed goldens."""
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


def _sass(path: str, on: int, *defines: str):
    name = os.path.basename(path)
    src = open(os.path.join(GOLDEN, path + ".cu")).read()
    options = (f"-DDSG_DECODE_ROWS_BEFORE_WAIT={on}",) + tuple(f"-D{d}" for d in defines)
    cubin = compile_cubin(src, name, arch="sm_90a", options=options).cubin
    return instructions(cubin)[name]


def _before_wait(instrs) -> list:
    first = min(i.addr for i in instrs if i.opcode == "ACQBULK")
    return [i.opcode for i in instrs if i.addr < first]


@pytest.mark.parametrize("path", KERNELS)
def test_rows_before_wait_switch(path):
    off, on = _sass(path, 0), _sass(path, 1)
    assert wait_problem(off) is None
    assert not any(op.startswith(("LDG", "LDGSTS")) for op in _before_wait(off))
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
    # one sequence and log2(B) + 2 at B (PERF_NOTES v31)
    on = _sass("deepseek_v2_lite/mla_decode_attention__bf16__c512_r64__h16__page64__s8", 1)
    assert _loads_before_first_use(on) >= 4
    # and the block table's row towards L1 with them (DecodeSplit::warm_table): the page lookups
    # after rows() hit L1 instead of a second round trip
    first_load = min(i.addr for i in on if i.opcode.startswith("LDG"))
    assert any(i.opcode.startswith("CCTL") and ".PF1" in i.opcode and i.addr < first_load for i in on)


@pytest.mark.parametrize("path", KERNELS[::2])
def test_this_steps_rows_are_copied_by_a_short_loop(path):
    # After its wait the split copies this step's own rows (one a sequence at decode) in a loop over
    # them (DSG_DECODE_FRESH_COMPACT, on by default since PERF_NOTES v32), not with the unrolled
    # walk over every row of its first tiles: ~1,000 instructions fewer, each fetched cold every
    # layer (an H200 fetches cold code at ~104 SM cycles a KB: b=1 -0.02 to -0.03 ms a step)
    walk, loop = _sass(path, 1, "DSG_DECODE_FRESH_COMPACT=0"), _sass(path, 1)
    assert len(loop) <= len(walk) - 800, (len(walk), len(loop))

    def copies_after_wait(instrs):
        first = min(i.addr for i in instrs if i.opcode == "ACQBULK")
        return sum(1 for i in instrs if i.addr > first and i.opcode.startswith("LDGSTS"))
    assert copies_after_wait(loop) <= copies_after_wait(walk) // 2
