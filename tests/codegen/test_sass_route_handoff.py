"""The route's hand-off to the expert kernels (templates/include/handoff.cuh, DSG_ROUTE_HANDOFF,
off by default): off, no kernel spins and the routing's loads are what they were; on, the fused
route writes its total with a release store behind a fence, gate_up_silu and down spin (acquire,
with a sleep) on it, every load they make of the routing goes through L2 (no read-only-cache load
is left in them: each of theirs was the routing's), and neither writes, exits nor runs off the end
on a path that has not waited (test_sass_pdl's check).  Compiled with NVRTC on the CPU from the
committed goldens (V2-Lite's decode kernels).  And the skinny expert launches (the consumers) run
only at token counts the fused route (the publisher) serves."""
from __future__ import annotations

import collections
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402
from test_sass_pdl import wait_problem  # noqa: E402

from codegen.nvrtc import compile_cubin  # noqa: E402

needs_sass = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "deepseek_v2_lite")
ROUTE = "moe_route__bf16__d2048__e64_k6__softmax_greedy__shared2__fused_t256"
EXPERTS = ["moe_gate_up_silu__bf16__e66_k8__m1408_d2048__sh2w__wgmma_skinny",
           "moe_down__bf16__e66__d2048_m1408__wgmma_skinny",
           "moe_down__bf16__e66__d2048_m1408__wgmma_skinny_t1"]


def _instrs(name: str, on: int):
    src = open(os.path.join(GOLDEN, name + ".cu")).read()
    cubin = compile_cubin(src, name, arch="sm_90a", options=(f"-DDSG_ROUTE_HANDOFF={on}",)).cubin
    return instructions(cubin)[name]


def _ops(instrs) -> collections.Counter:
    return collections.Counter(i.opcode for i in instrs)


def test_the_skinny_expert_launches_run_only_where_the_fused_route_does():
    """The hand-off's consumers wait for a total only the fused route publishes (the three-launch
    route's align never invalidates it): their token window must lie inside the fused route's."""
    from codegen.families import _moe_wgmma_skinny, moe_route
    assert moe_route.ROUTE_FUSED_TOKENS is not None
    assert _moe_wgmma_skinny.upper() <= moe_route.ROUTE_FUSED_TOKENS


@needs_sass
def test_the_route_publishes_its_total_behind_a_fence():
    off, on = _ops(_instrs(ROUTE, 0)), _ops(_instrs(ROUTE, 1))
    assert on["STG.E.STRONG.GPU"] > off["STG.E.STRONG.GPU"], "no release store of the total"
    assert on["MEMBAR.SC.GPU"] > off["MEMBAR.SC.GPU"], "no fence before the total (or after its invalidation)"
    assert wait_problem(_instrs(ROUTE, 1), weight_loads=True) is None


@needs_sass
@pytest.mark.parametrize("name", EXPERTS)
def test_the_experts_spin_on_the_total_and_read_the_routing_through_l2(name):
    off_i, on_i = _instrs(name, 0), _instrs(name, 1)
    off, on = _ops(off_i), _ops(on_i)
    assert off["NANOSLEEP"] == 0 and on["NANOSLEEP"] >= 1, "no spin on the route's total"
    assert off["LDG.E.CONSTANT"] > 0 and on["LDG.E.CONSTANT"] == 0, "a routing load still through the read-only cache"
    assert wait_problem(on_i, two_back=True, gathers=True) is None
