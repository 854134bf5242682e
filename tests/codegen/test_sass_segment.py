"""The persistent segment kernels of V2-Lite's decode step at b=1 (Tuning.persistent.segments on)
compile for sm_90 without register spills or a stack frame, and their machine code keeps the
segment's memory order (templates/include/segment.cuh): each counter wait is an acquire load
followed by an L1 invalidation (CCTL.IVALL), each signal a release reduction, and the only
non-coherent loads (.CONSTANT) are the weights' (skinny.cuh's ld_weight16): activations another task
of the launch writes never go through ld.global.nc.  They keep pdl.cuh's contract (the PDL check of
tests/codegen/test_sass_pdl.py): nothing but L2 prefetches of weights before the wait."""
from __future__ import annotations

import functools
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import _sass, cuobjdump, instructions, opcodes  # noqa: E402
from test_sass_pdl import wait_problem  # noqa: E402

from codegen.bundle import plan_spec  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.nvrtc import compile_cubin  # noqa: E402
from codegen.render import render_launch  # noqa: E402
from codegen.tuning import parse_tune  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
ON = parse_tune(["persistent.segments=true"])


@functools.lru_cache(maxsize=None)
def _kernels():
    plan = plan_spec("model_specs/deepseek_v2_lite.yaml", Options(tuning=ON), strict=False).plans["decode"]
    return {s.name: s for s in plan.launches if s.family == "segment"}


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    launch = _kernels()[name]
    return compile_cubin(render_launch(launch), name, arch="sm_90", options=("--ptxas-options=-v",))


def test_v2_lite_has_five_segment_kernels():
    assert sorted(len(s.params["members"]) for s in _kernels().values()) == [2, 2, 2, 3, 7]
    assert sum(s.params["members"][0]["kind"] == "combine_norm" for s in _kernels().values()) == 2


@pytest.mark.parametrize("k", range(5))
def test_segment_kernel_compiles_without_spills(k):
    log = _compiled(sorted(_kernels())[k]).log
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 255, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log and "0 bytes stack frame" in log, log


@pytest.mark.parametrize("k", range(5))
def test_segment_kernel_waits_before_it_touches_another_kernels_data(k):
    """pdl.cuh's contract (tests/codegen/test_sass_pdl.py's check): before its wait a segment only
    prefetches its first task's weights towards L2 (prefetches, not loads)."""
    name = sorted(_kernels())[k]
    assert wait_problem(instructions(_compiled(name).cubin)[name]) is None


@pytest.mark.parametrize("k", range(5))
def test_segment_kernel_keeps_its_memory_order(k):
    cubin = _compiled(sorted(_kernels())[k]).cubin
    ops = opcodes(cubin)
    acquires = [l for l in _sass(cubin).splitlines() if "LDG.E.STRONG.GPU" in l]
    assert acquires, "no acquire load of a counter"
    lines = _sass(cubin).splitlines()
    for k, line in enumerate(lines):
        if "LDG.E.STRONG.GPU" in line:
            assert any("CCTL.IVALL" in nxt for nxt in lines[k + 1:k + 4]), line
    assert ops["REDG.E.ADD.STRONG.GPU"] >= 1                      # the release add of a finished task
    constant = sum(n for op, n in ops.items() if op.startswith("LDG") and op.endswith(".CONSTANT"))
    weights = sum(n for op, n in ops.items() if op.startswith("LDG.E.NA.LTC128B.128") and op.endswith(".CONSTANT"))
    assert constant == weights > 0, ops
