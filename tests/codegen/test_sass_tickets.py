"""The self-resetting tickets (tickets.cuh) and the fused route's one-tile path (moe_route.cuh)
have switches, on since PERF_NOTES v23: on (the default), one acquire-release atomic and a relaxed
reset, and no fence.sc left; off (-D...=0, for an A/B), __threadfence's fence.sc (MEMBAR.SC.GPU)
around plain atomics.  The one-tile path's shared-id switch (PERF_NOTES v35-v36) compiles on and
off, without spills.  Compiled with NVRTC on the CPU from the committed goldens."""
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
def test_acquire_release_tickets_leave_no_sequentially_consistent_fence(name):
    src = open(os.path.join(GOLDEN, name + ".cu")).read()
    on = opcodes(compile_cubin(src, name, arch="sm_90a").cubin)
    off = opcodes(compile_cubin(src, name, arch="sm_90a", options=("-DDSG_TICKETS_ACQ_REL=0",
                                                                  "-DDSG_ROUTE_ONE_TILE_NO_TICKET=0")).cubin)
    assert off["MEMBAR.SC.GPU"] > 0 and off["ATOMG.E.EXCH.STRONG.GPU"] > 0, sorted(off)
    assert on["MEMBAR.SC.GPU"] == 0 and on["ATOMG.E.EXCH.STRONG.GPU"] == 0, sorted(on)
    assert on["ATOMG.E.ADD.STRONG.GPU"] > 0, sorted(on)


FUSED_ROUTES = {   # each spec's fused route: (golden folder, kernel, its one tile's pairs T * (K + S))
    "v2_lite": ("deepseek_v2_lite", "moe_route__bf16__d2048__e64_k6__softmax_greedy__shared2__fused_t256", 8 * 8),
    "v2": ("deepseek_v2", "moe_route__bf16__d5120__e160_k6__g8_tg3__softmax_group_limited_greedy__rsf16p0__shared2"
                          "__fused_t256", 8 * 8),
    "v3": ("deepseek_v3", "moe_route__bf16__d7168__e256_k8__g8_tg4__sigmoid_noaux_tc__norm__rsf2p5__bias__shared1"
                          "__fused_t256", 8 * 9),
}


@pytest.mark.parametrize("spec", sorted(FUSED_ROUTES))
def test_the_routes_shared_id_switch_adds_one_tiles_ids_and_spills_nothing(spec):
    """DSG_ROUTE_ONE_TILE_SHARED_IDS (moe_route.cuh, on by default since PERF_NOTES v36): on and off,
    each spec's fused route compiles without spills, on with one tile's pair ids (4 bytes each) more
    of static shared memory than off."""
    folder, name, pairs = FUSED_ROUTES[spec]
    src = open(os.path.join(os.path.dirname(GOLDEN), folder, name + ".cu")).read()
    smem = {}
    for flag in ("0", "1"):
        res = compile_cubin(src, name, arch="sm_90a",
                            options=("--ptxas-options=-v", f"-DDSG_ROUTE_ONE_TILE_SHARED_IDS={flag}"))
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        smem[flag] = int(re.search(r"(\d+) bytes smem", res.log).group(1))
    assert smem["1"] == smem["0"] + 4 * pairs, smem
