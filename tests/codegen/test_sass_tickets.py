"""The self-resetting tickets (tickets.cuh) take one acquire-release atomic and a relaxed reset,
with no sequentially consistent fence (fence.sc, MEMBAR.SC.GPU) and no exchange; each spec's fused
route (moe_route.cuh, whose one-tile path keeps its pairs' ids in shared memory) compiles without
spills.  Compiled with NVRTC on the CPU from the committed goldens."""
from __future__ import annotations

import os
import re
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
def test_tickets_are_acquire_release_atomics_without_a_sequentially_consistent_fence(name):
    src = open(os.path.join(GOLDEN, name + ".cu")).read()
    ops = opcodes(compile_cubin(src, name, arch="sm_90a").cubin)
    assert ops["MEMBAR.SC.GPU"] == 0 and ops["ATOMG.E.EXCH.STRONG.GPU"] == 0, sorted(ops)
    assert ops["ATOMG.E.ADD.STRONG.GPU"] > 0, sorted(ops)


FUSED_ROUTES = {   # each spec's fused route: (golden folder, kernel, its one tile's pairs T * (K + S))
    "v2_lite": ("deepseek_v2_lite", "moe_route__bf16__d2048__e64_k6__softmax_greedy__shared2__fused_t256", 8 * 8),
    "v2": ("deepseek_v2", "moe_route__bf16__d5120__e160_k6__g8_tg3__softmax_group_limited_greedy__rsf16p0__shared2"
                          "__fused_t256", 8 * 8),
    "v3": ("deepseek_v3", "moe_route__bf16__d7168__e256_k8__g8_tg4__sigmoid_noaux_tc__norm__rsf2p5__bias__shared1"
                          "__fused_t256", 8 * 9),
}


@pytest.mark.parametrize("spec", sorted(FUSED_ROUTES))
def test_the_fused_route_keeps_one_tiles_ids_in_shared_memory_without_spills(spec):
    """Each spec's fused route compiles without spills, with static shared memory for one tile's
    pair ids (4 bytes each)."""
    folder, name, pairs = FUSED_ROUTES[spec]
    src = open(os.path.join(os.path.dirname(GOLDEN), folder, name + ".cu")).read()
    res = compile_cubin(src, name, arch="sm_90a", options=("--ptxas-options=-v",))
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
    assert int(re.search(r"(\d+) bytes smem", res.log).group(1)) >= 4 * pairs, res.log
