"""Tuning.linear.gemm_weights_early on the CPU: the dense one-byte GEMMs (gemm_fp8, with moe.fp8_overlap off and
on, and gemm_int8) issue their first ring stages' weight boxes before the PDL wait.  Off: the launches'
names, parameters and source as without the knob.  On: name part ew, parameter `early` and the template's
EARLY argument, nothing else changed (the quantisers' launches neither); for sm_90a no spills within the
producer's setmaxnreg budget, a TMA box (UTMALDG) on a path before the wait (griddepcontrol.wait: ACQBULK)
and nothing else of global memory there -- and the knob-off kernel no TMA before it."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402
from test_linear_fp8 import _node as fp8_node  # noqa: E402
from test_linear_int8 import I8  # noqa: E402
from test_linear_int8 import _node as int8_node  # noqa: E402

from codegen.arch import kernel_target  # noqa: E402
from codegen.families import gemm_fp8, gemm_int8, linear_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, Options  # noqa: E402
from codegen.tuning import LinearTuning, MoeTuning, Tuning  # noqa: E402
from ir.formats import FP8  # noqa: E402

OPS = ["linear", "multi_linear", "gate_up_silu"]


def _tuning(early: bool | None, overlap: bool = True) -> Tuning:
    """Each family's quantiser launch (no norm rows, no skinny chunks / prologue), the knob as asked (None: left
    at its default)."""
    knob = {} if early is None else {"gemm_weights_early": early}
    return Tuning(linear=LinearTuning(norm_fp8=False, norm_int8=False, fp8_chunks_upto=0, i8_prologue_upto=0, **knob),
                  moe=MoeTuning(fp8_overlap=overlap))


def _launches(family: str, op: str, tuning: Tuning, K: int = 2048, dtype: str = "bf16") -> list[KernelLaunch]:
    """The family's launches of an op node (the quantiser first, then the GEMMs)."""
    fmt, node, fam = (FP8.name, fp8_node, gemm_fp8) if family == "fp8" else (I8, int8_node, gemm_int8)
    G, nid = node(op, (fmt, fmt), K=K)
    return [s for s in linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=tuning))
            if isinstance(s, KernelLaunch) and s.family == fam.FAMILY]


CASES = [("fp8", op, ovl) for op in OPS for ovl in (False, True)] + [("int8", op, False) for op in OPS]


@pytest.mark.parametrize("family, op, overlap", CASES)
def test_the_knob_reaches_the_gemms_only_when_on(family, op, overlap):
    from codegen.render import render_launch
    default, off, on = (_launches(family, op, _tuning(e, overlap)) for e in (None, False, True))
    assert [(a.name, a.params) for a in default] == [(a.name, a.params) for a in on]      # on by default
    assert on[0].name == off[0].name and on[0].params == off[0].params and len(on) == len(off) > 1
    for a, b in zip(off[1:], on[1:]):
        assert "early" not in a.params and "__ew" not in a.name
        assert b.name == a.name + "__ew" and b.params == {**a.params, "early": True}
        assert (b.grid, b.block, b.smem, b.args, b.workspace) == (a.grid, a.block, a.smem, a.args, a.workspace)
        src_a, src_b = render_launch(a), render_launch(b)
        call = re.compile(r"gemm<([^>]*)>\(")
        (targs_a,), (targs_b,) = call.findall(src_a), call.findall(src_b)
        # the template arguments gain EARLY = true (gemm_fp8: after OVL, spelled out when off)
        assert targs_b == targs_a + (", true" if family == "int8" or overlap else ", false, true")


def _before_wait(instrs) -> list:
    from test_sass_moe_fp8 import _before_wait as walk
    return walk(instrs)


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("family, op, K, overlap", [
    ("fp8", "multi_linear", 2048, True), ("fp8", "gate_up_silu", 2048, True), ("fp8", "linear", 10944, True),
    ("fp8", "linear", 2048, False), ("int8", "multi_linear", 2048, False), ("int8", "gate_up_silu", 2048, False)])
def test_the_early_gemms_issue_tma_before_the_wait_without_spills(family, op, K, overlap):
    """V2-Lite's shapes (q + kv_a, gate_up_silu, the dense down, o_proj without the overlap), knob off and on:
    0 spills (the early issue runs before setmaxnreg, on the launch bound's registers; the producer's loop
    after it within its 56, or ptxas would spill), no serialised wgmma; on a path before the wait: a TMA box
    where the knob is on, none where off, no other global access and no exit (test_sass_pdl.wait_problem with
    TMA boxes allowed)."""
    from test_sass_pdl import wait_problem

    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    for early in (False, True):
        for la in _launches(family, op, _tuning(early, overlap), K=K)[1:]:
            res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                                options=("--ptxas-options=-v",))
            assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
            assert "C7514" not in res.log and "C7517" not in res.log, res.log
            (body,) = instructions(res.cubin).values()
            early_ops = {i.opcode.split(".")[0] for i in _before_wait(body)}
            assert ("UTMALDG" in early_ops) == early, (la.name, sorted(early_ops))
            assert not early_ops & {"LDG", "LDGSTS", "STG", "ATOMG", "RED", "EXIT", "RET"}, (la.name, sorted(early_ops))
            assert wait_problem(body, two_back=True) is None, (la.name, wait_problem(body, two_back=True))
