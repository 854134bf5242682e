"""The int8 skinny linear that quantises x in its own prologue (Tuning.linear.i8_prologue_upto, off by default;
templates/include/int8_prologue.cuh) on the CPU: its dispatch rows, its lowering (no quantiser launch up to the
knob's tokens, the quantiser and the int8 kernel above, as today with the knob off), the shared-memory fact that
keeps it off where the rows do not fit, and its machine code (NVRTC: IMMA, no spills, the weights' L2 prefetch
before the PDL wait)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions, opcodes  # noqa: E402
from test_linear_int8 import I8, NO_90A, _compile, _node  # noqa: E402
from test_sass_pdl import wait_problem  # noqa: E402

from codegen import dispatch, sizes  # noqa: E402
from codegen.families import linear_skinny  # noqa: E402
from codegen.families.mla_decode_attention import smem_limit  # noqa: E402
from codegen.kernel import KernelLaunch, LibraryCall, Options  # noqa: E402
from codegen.tuning import LinearTuning, Tuning  # noqa: E402

# the tunings below keep the int8 chunks (linear.i8_chunks_upto, on at 32 by default) off: gemm_int8 from 17 tokens
FACTS = {"precision": "act", "weight_format": I8, "dtype": "bf16", "sm_90a": True, "i8_rows": True, "i8_fits": True}


def _opts(n: int, **kw) -> Options:
    return Options(tuning=Tuning(linear=LinearTuning(i8_chunks_upto=0, i8_prologue_upto=n, **kw.pop("linear", {}))), **kw)


def _running(steps, T: int) -> list[str]:
    """The names of the launches with work at T (and the library call where it runs)."""
    env = {"T": T, "SMS": 132}
    return [s.name for s in steps if isinstance(s, KernelLaunch) and all(sizes.evaluate(g, env) > 0 for g in s.grid)] \
        + [s.call for s in steps if isinstance(s, LibraryCall) and s.runs_at(T)]


def test_the_linear_table_gives_the_prologue_its_tokens_where_the_rows_fit():
    t4 = Tuning(linear=LinearTuning(i8_chunks_upto=0, i8_prologue_upto=4))
    rows = dispatch.rows("linear", {**FACTS, "i8_xq_fits": True}, t4)
    assert [(r.variant, r.span) for r in rows] == [("skinny_wi8_xq", "1..4"), ("skinny_wi8", "5..16"),
                                                   ("i8_wgmma", "17..inf")]
    assert "prologue" in rows[0].reason and "no launch of its own" in rows[0].reason
    # the rows do not fit, or the knob is off: the rows without the prologue
    off = Tuning(linear=LinearTuning(i8_chunks_upto=0, i8_prologue_upto=0))
    today = dispatch.rows("linear", FACTS, off)
    assert dispatch.rows("linear", {**FACTS, "i8_xq_fits": False}, t4) == today
    assert "i8_xq_fits" not in dispatch.table("linear", off).facts
    assert [r.variant for r in today] == ["skinny_wi8", "i8_wgmma"]
    # at the skinny kernel's whole range the quantiser's row is gone; the knob is capped by skinny_upto
    t16 = Tuning(linear=LinearTuning(i8_chunks_upto=0, i8_prologue_upto=16))
    assert [(r.variant, r.span) for r in dispatch.rows("linear", {**FACTS, "sm_90a": False, "i8_xq_fits": True}, t16)] \
        == [("skinny_wi8_xq", "1..16"), ("int_mm", "17..inf")]
    t16_8 = Tuning(linear=LinearTuning(i8_chunks_upto=0, i8_prologue_upto=16, skinny_upto=8))
    assert dispatch.rows("linear", {**FACTS, "i8_xq_fits": True}, t16_8)[0].span == "1..8"


def test_with_the_knob_on_no_quantiser_launch_runs_up_to_its_tokens():
    G, nid = _node()
    steps = linear_skinny.lower(nid, G, _opts(4))
    xq, quant, launch = steps[:3]
    assert xq.name == "linear_skinny__bf16_wi8__k2048__o3072_576__xq4" and xq.stage == "multi_linear_xq"
    assert xq.params["xq"] == 4 and not xq.workspace and xq.smem == linear_skinny.xq_smem(2048, 4, 8) == 8336
    assert [a.name for a in xq.args][:2] == ["x", "x_stride"] and "xq" not in [a.name for a in xq.args]
    assert quant.stage == "quant_int8" and launch.name == "linear_skinny__bf16_wi8__k2048__o3072_576"
    for T in (1, 2, 4):
        assert _running(steps, T) == [xq.name], T
    for T in (5, 16):
        assert _running(steps, T) == [quant.name, launch.name], T
    assert all(s.family == "gemm_int8" for s in steps if s.name in _running(steps, 17))
    # without sm_90a the exact library call above 16 tokens, as today
    steps = linear_skinny.lower(nid, G, _opts(4, arch="sm_89"))
    assert isinstance(steps[-1], LibraryCall) and steps[-1].from_tokens == 17 and len(steps) == 4


def test_at_the_kernels_whole_range_the_node_has_no_quantiser_and_no_workspace():
    G, nid = _node("gate_up_silu")
    xq, call = linear_skinny.lower(nid, G, _opts(16, arch="sm_89"))
    assert xq.name.endswith("__silu10944__xq16") and xq.params["silu"] and not xq.workspace
    assert call.from_tokens == 17 and _running([xq, call], 16) == [xq.name]


def test_with_the_knob_off_the_lowering_is_todays():
    for op in ("multi_linear", "gate_up_silu", "linear"):
        G, nid = _node(op, (I8, I8))
        for arch in ("sm_90", "sm_89"):
            steps = linear_skinny.lower(nid, G, _opts(0, arch=arch))
            launches = [s for s in steps if isinstance(s, KernelLaunch)]
            assert launches[0].stage == "quant_int8" and not any("xq" in s.params for s in launches), op


def test_rows_that_do_not_fit_shared_memory_keep_the_quantiser_launch():
    """V3's dense down (K = 18432): four rows fit (74 KB), sixteen do not (295 KB): the node keeps today's
    launches there; every K of the V2-Lite / V3 int8 linears (2048, 2816, 7168, 10944, 16384, 18432) fits
    at four."""
    G, nid = _node("linear", (I8,), K=18432)
    assert "__xq4" in linear_skinny.lower(nid, G, _opts(4))[0].name
    assert linear_skinny.lower(nid, G, _opts(16)) == linear_skinny.lower(nid, G, _opts(0))
    limit = smem_limit("sm_90")
    for K in (2048, 2816, 7168, 10944, 16384, 18432):
        assert linear_skinny.xq_fits(K, 4, 8, 1, Options()), K
        assert linear_skinny.xq_fits(K, 16, 8, 1, Options()) == (K <= 10944), K
    assert linear_skinny.xq_smem(18432, 4, 8) + 8 * 16 * 16 * 4 <= limit


def test_explain_names_the_prologue_row():
    from runtime.cli_explain import _reason
    G, nid = _node("linear", (I8,))
    steps = linear_skinny.lower(nid, G, _opts(4))
    assert _reason("linear", steps[:1], 2, _opts(4), {}).startswith("skinny_wi8_xq [tokens 1..4]: int8 weights")
    assert _reason("linear", steps[1:3], 8, _opts(4), {}).startswith("skinny_wi8 [tokens 5..16]: int8 weights")


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op, dtype, K, n, arch", [("multi_linear", "bf16", 2048, 4, "sm_90"),
                                                   ("gate_up_silu", "bf16", 2048, 16, "sm_90a"),
                                                   ("linear", "fp16", 1001, 3, "sm_90"),
                                                   ("linear", "bf16", 18432, 4, "sm_90")])   # V3's down K
def test_the_prologue_kernel_is_imma_without_spills_its_weights_prefetched_before_its_wait(op, dtype, K, n, arch):
    G, nid = _node(op, (I8, I8), K=K)
    xq = linear_skinny.lower(nid, G, _opts(n, dtype=dtype))[0]
    res = _compile(xq, arch)
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
    ops = opcodes(res.cubin)
    assert ops["IMMA.16832.S8.S8"] > 0 and ops["I2FP.F32.S32"] > 0, sorted(ops)
    # the quantiser's arithmetic: a correctly rounded division (FCHK), round to nearest even (F2I.NTZ)
    assert ops["FCHK"] > 0 and ops["F2I.NTZ"] > 0, sorted(ops)
    if K % 8 == 0:   # x's rows 16 bytes at a time
        assert ops["LDG.E.128"] + ops["LDG.E.128.CONSTANT"] > 0, sorted(ops)
    assert not any(o.startswith(("LDL", "STL", "HMMA")) for o in ops), sorted(ops)
    code = instructions(res.cubin)[xq.name]
    assert wait_problem(code, weight_loads=True) is None
    first_wait = min(i.addr for i in code if i.opcode == "ACQBULK")
    assert any(i.opcode.startswith("CCTL") and i.addr < first_wait for i in code), "no L2 prefetch before the wait"
