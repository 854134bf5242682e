"""The integer experts' down that quantises its pair rows in its own prologue (Tuning.moe.int_down_prologue_upto,
off by default; templates/include/moe_int_prologue.cuh) on the CPU: the grouped_experts table's rows, the
lowering (one launch up to the knob's tokens, the quantiser and the int launch above, today's with the knob off;
moe_expert_ffn's down too), the shared-memory fact, and its machine code (NVRTC: IMMA, no spills, the PDL
contract)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions, opcodes  # noqa: E402
from test_moe_int_lowering import FACTS, _compile, _lower, _node  # noqa: E402
from test_sass_pdl import wait_problem  # noqa: E402

from codegen import dispatch, sizes  # noqa: E402
from codegen.families import _moe_int  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402
from ir.formats import FORMATS  # noqa: E402


def _opts(n: int, **kw) -> Options:
    return Options(tuning=Tuning(moe=MoeTuning(int_down_prologue_upto=n)), **kw)


def _running(launches, T: int, pairs: int) -> list[str]:
    env = {"T": T, "NP": T * pairs, "SMS": 132}
    return [la.stage for la in launches if all(sizes.evaluate(g, env) > 0 for g in la.grid)]


def test_the_grouped_table_gives_down_the_prologue_where_its_rows_fit():
    t4 = Tuning(moe=MoeTuning(int_down_prologue_upto=4))
    rows = dispatch.rows("moe_down", {**FACTS, "int_xq_fits": True}, t4)
    assert [(r.variant, r.span) for r in rows] == [(_moe_int.XQ_VARIANT, "1..4"), (_moe_int.VARIANT, "5..inf")]
    assert "prologue" in rows[0].reason
    today = dispatch.rows("moe_down", FACTS)
    assert dispatch.rows("moe_down", {**FACTS, "int_xq_fits": False}, t4) == today
    assert dispatch.rows("moe_gate_up_silu", {**FACTS, "int_xq_fits": True}, t4) == today   # down's only
    assert "int_xq_fits" not in dispatch.table("moe_down").facts


def test_with_the_knob_on_down_runs_one_launch_up_to_its_tokens():
    G, nid = _node("moe_down", 1408, 2048, E=64, K=6)
    xq, quant, gemm = _lower(G, nid, _opts(4))
    assert xq.name == "moe_down__bf16_wi4__e64__d2048_m1408__xq4_p6" and xq.stage == _moe_int.XQ_VARIANT
    assert xq.params["pairs"] == 6 and not xq.workspace and xq.smem == _moe_int.xq_smem(1408, 4, 6) == 4 * 6 * 1412 + 64
    args = {a.name: a for a in xq.args}
    assert "a" in args and "xq" not in args and args["w"].ctype == "const signed char*"
    assert (quant.stage, gemm.stage) == (_moe_int.QUANT_STAGE, _moe_int.VARIANT)
    for T in (1, 4):
        assert _running([xq, quant, gemm], T, 6) == [_moe_int.XQ_VARIANT], T
    assert _running([xq, quant, gemm], 5, 6) == [_moe_int.QUANT_STAGE, _moe_int.VARIANT]
    off = _lower(G, nid, _opts(0))
    assert off == _lower(G, nid) and [la.stage for la in off] == [_moe_int.QUANT_STAGE, _moe_int.VARIANT]
    assert off[0].grid == ("NP", 1, 1) and quant.grid[0] == "NP * min(1, T // 5)"


def test_the_expert_ffns_down_takes_the_prologue_too():
    G, nid = _node("moe_expert_ffn", 2048, 1408, E=64, K=6)
    launches = _lower(G, nid, _opts(4))
    assert [(la.family, la.stage) for la in launches] == [
        ("moe_gate_up_silu", "quant_i8"), ("moe_gate_up_silu", "mma_int"), ("moe_down", _moe_int.XQ_VARIANT),
        ("moe_down", "quant_i8"), ("moe_down", "mma_int")]
    assert _running(launches, 2, 6) == ["quant_i8", "mma_int", _moe_int.XQ_VARIANT]


def test_rows_that_do_not_fit_keep_the_quantiser():
    """V3's experts (KD = 2048, 8 pairs a token): 4 tokens' rows are 66 KB and fit, 16 tokens' 263 KB do not."""
    G, nid = _node("moe_down", 2048, 7168, E=256, K=8)
    assert _lower(G, nid, _opts(4))[0].stage == _moe_int.XQ_VARIANT
    assert _lower(G, nid, _opts(16)) == _lower(G, nid)


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("KD,N,dtype,fmt", [(1408, 2048, "bf16", "int4_channel"),     # V2-Lite
                                            (2048, 7168, "bf16", "int4_channel"),     # V3
                                            (1001, 90, "fp16", "int4_channel"),       # element loads
                                            (1408, 2048, "bf16", "int8_channel"),
                                            (1536, 2048, "bf16", "int4_group256_packed")])
def test_the_prologue_down_is_imma_without_spills(KD, N, dtype, fmt):
    G, nid = _node("moe_down", KD, N, E=64, K=6, fmt=FORMATS[fmt])
    xq = _lower(G, nid, _opts(4, dtype=dtype))[0]
    res = _compile(xq, "sm_90")
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
    ops = opcodes(res.cubin)
    assert ops["IMMA.16832.S8.S8"] > 0 and ops["FCHK"] > 0 and ops["F2I.NTZ"] > 0, sorted(ops)
    assert not any(o.startswith(("HMMA", "LDL", "STL")) for o in ops), sorted(ops)
    assert wait_problem(instructions(res.cubin)[xq.name]) is None
