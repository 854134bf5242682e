"""DSG_ROLL_ONCE_LOOPS (common.cuh): loops a b=1 decode step runs once or twice a launch stay
rolled when it is 1, so the code each layer fetches cold is smaller (PERF_NOTES v32-v33); 0 (the
default) leaves them to the compiler.  Compiled with NVRTC on the CPU from the committed goldens."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402

from codegen.nvrtc import compile_cubin  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def _sass(path: str, on: int):
    name = os.path.basename(path)
    src = open(os.path.join(GOLDEN, path + ".cu")).read()
    cubin = compile_cubin(src, name, arch="sm_90a", options=(f"-DDSG_ROLL_ONCE_LOOPS={on}",)).cubin
    return instructions(cubin)[name]


# (kernel, fewest instructions the switch must remove): the fused route's top-k rounds, its
# alignment's scan rounds and strided loops, its copy of the ids (~650 of ~2,600); the decode
# attention's copy of the queries (~190 of ~4,000)
CUTS = [("deepseek_v2_lite/moe_route__bf16__d2048__e64_k6__softmax_greedy__shared2__fused_t256", 500),
        ("deepseek_v2_lite/mla_decode_attention__bf16__c512_r64__h16__page64__s8", 150)]


@pytest.mark.parametrize("path,fewer", CUTS)
def test_once_loops_rolled_are_less_code(path, fewer):
    off, on = _sass(path, 0), _sass(path, 1)
    assert len(off) - len(on) >= fewer, f"{len(off)} -> {len(on)} instructions"


def test_the_route_runs_one_argmax_round_in_a_loop():
    # topk_scored's K = 6 rounds of a 5-step warp argmax (two shuffles a step): 60 SHFL unrolled,
    # one round's 10 rolled (plus the softmax's max and sum, 10 more)
    path = CUTS[0][0]
    shfl = {on: sum(1 for i in _sass(path, on) if i.opcode.startswith("SHFL")) for on in (0, 1)}
    assert shfl[1] <= shfl[0] - 40, shfl
