"""The self-resetting tickets (tickets.cuh) and the fused route's one-tile path (moe_route.cuh)
have switches, on since PERF_NOTES v23: on (the default), one acquire-release atomic and a relaxed
reset, and no fence.sc left; off (-D...=0, for an A/B), __threadfence's fence.sc (MEMBAR.SC.GPU)
around plain atomics.  Compiled with NVRTC on the CPU from the committed goldens."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, opcodes  # noqa: E402

from codegen.nvrtc import compile_cubin  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "deepseek_v2_lite")
KERNELS = ["moe_route__bf16__d2048__e64_k6__softmax_greedy__shared2__fused_t256",
           "mla_decode_attention__bf16__c512_r64__h16__page64__s8"]


@pytest.mark.parametrize("name", KERNELS)
def test_acquire_release_tickets_leave_no_sequentially_consistent_fence(name):
    src = open(os.path.join(GOLDEN, name + ".cu")).read()
    on = opcodes(compile_cubin(src, name, arch="sm_90a").cubin)
    off = opcodes(compile_cubin(src, name, arch="sm_90a", options=("-DDSG_TICKETS_ACQ_REL=0",
                                                                  "-DDSG_ROUTE_ONE_TILE_NO_TICKET=0")).cubin)
    assert off["MEMBAR.SC.GPU"] > 0 and off["ATOMG.E.EXCH.STRONG.GPU"] > 0, sorted(off)
    assert on["MEMBAR.SC.GPU"] == 0 and on["ATOMG.E.EXCH.STRONG.GPU"] == 0, sorted(on)
    assert on["ATOMG.E.ADD.STRONG.GPU"] > 0, sorted(on)
