"""The dispatch tables (codegen/dispatch.py): under every combination of the facts a table reads,
at the default tuning and at tunings that move its bounds, the case that holds splits the token
range [1, inf) among its rows exactly once (no gap, no overlap); the lowering's launches are the
rows of that case; `select` answers by token count."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from codegen import dispatch
from codegen.tuning import SECTIONS, Tuning

# Facts and the values they take (a table reads some of them).
FACT_VALUES = {"dtype": ("bf16", "fp16", "fp32"), "sm_90a": (True, False), "tma_rows": (True, False),
               "decode_wgmma_fits": (True, False), "prefill_wgmma_fits": (True, False), "one_token": (True, False),
               "decode_wgmma": (True, False), "precision": ("fp32", "act"), "mma": (True, False),
               "weight_format": dispatch.WEIGHT_FORMATS, "fp8_rows": (True, False), "fp8_fits": (True, False),
               "fp8x_fits": (True, False), "int_rows": (True, False), "i8_rows": (True, False),
               "i8_fits": (True, False), "i8_xq_fits": (True, False), "int_wgmma_rows": (True, False),
               "int_wgmma_fits": (True, False),
               "phase": dispatch.PHASES, "segments": (True, False)}


def tuned(**knobs) -> Tuning:
    """Tuning(...) from "section.knob" -> value (keys as `section__knob`)."""
    by: dict = {}
    for key, value in knobs.items():
        sec, knob = key.split("__")
        by.setdefault(sec, {})[knob] = value
    return Tuning(**{s: SECTIONS[s](**kv) for s, kv in by.items()})


TUNINGS = [Tuning(), tuned(moe__decode_wgmma=False), tuned(moe__decode_wgmma_from=8),
           tuned(moe__prefill_wgmma_above=None), tuned(moe__prefill_wgmma_above=4, moe__gemv_upto=16),
           tuned(moe__one_token_down_stages=0), tuned(moe__expert_ffn_from=1, moe__expert_ffn_upto=4096),
           tuned(moe__expert_ffn_upto=0), tuned(moe__expert_ffn_from=300), tuned(moe__align_parallel_above=None),
           tuned(route__fused_upto=0), tuned(route__gemm_above=None), tuned(route__gemm_above=0, route__fused_upto=8),
           tuned(linear__skinny_upto=0), tuned(linear__skinny_upto=1), tuned(attention__prologue_upto=0),
           tuned(moe__fp8_activations=False), tuned(linear__i8_prologue_upto=4),
           tuned(linear__i8_prologue_upto=16), tuned(linear__i8_prologue_upto=16, linear__skinny_upto=8),
           tuned(persistent__segments=True),
           tuned(moe__fp8_one_token_down=True), tuned(moe__fp8_one_token_down=True, moe__fp8_activations=False),
           tuned(linear__fp8_chunks_upto=0), tuned(linear__fp8_chunks_upto=128), tuned(linear__fp8_chunks_upto=32, linear__skinny_upto=0),
           tuned(linear__fp8_chunks_upto=256, linear__skinny_upto=8),
           tuned(linear__i8_chunks_upto=128), tuned(linear__i8_chunks_upto=32, linear__skinny_upto=0),
           tuned(linear__i8_chunks_upto=256, linear__skinny_upto=8, linear__i8_prologue_upto=16),
           tuned(moe__int_wgmma_above=16), tuned(moe__int_wgmma_above=1024, moe__decode_wgmma=False)]


def _partitions(rows, probe=(1, 2, 3, 4, 7, 8, 9, 16, 17, 255, 256, 257, 300, 4096, 4097, 1 << 20)):
    ends = sorted({1, *(r.lo for r in rows), *(r.hi + 1 for r in rows if r.hi is not None), *probe})
    return [(t, [r for r in rows if r.covers(t)]) for t in ends]


@pytest.mark.parametrize("tuning", TUNINGS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.changed().items()) or "defaults")
@pytest.mark.parametrize("op", sorted(dispatch.TABLES))
def test_every_token_count_is_served_by_exactly_one_row(op, tuning):
    """Each case that some combination of the facts reaches is checked once (a fact more doubles the
    combinations, not the checks)."""
    table = dispatch.table(op, tuning)
    checked: set = set()
    for values in itertools.product(*(FACT_VALUES[f] for f in table.facts)):
        facts = dict(zip(table.facts, values))
        case = table.case(facts)
        if id(case) in checked:
            continue
        checked.add(id(case))
        rows = case.rows
        assert rows, (op, facts)
        assert all(r.reason and (r.hi is None or r.lo <= r.hi) and r.lo >= 1 for r in rows), rows
        # the rows read in token order and every range starts where the one before ended
        assert [r.lo for r in rows] == sorted(r.lo for r in rows), rows
        assert rows[0].lo == 1 and rows[-1].hi is None, rows
        for a, b in zip(rows, rows[1:]):
            assert b.lo == a.hi + 1, (op, facts, a, b)
        for t, serving in _partitions(rows):
            assert len(serving) == 1, (op, facts, t, serving)
            assert dispatch.select(op, t, facts, tuning) == serving[0]


def test_a_table_says_which_case_holds_and_refuses_no_case():
    t = dispatch.grouped_experts()
    assert t.case({"dtype": "fp32"}).note == "fp32"
    assert dispatch.select("moe_gate_up_silu", 48, {"dtype": "bf16", "sm_90a": True, "tma_rows": True,
                                                    "decode_wgmma_fits": True, "prefill_wgmma_fits": True}).variant \
        == "wgmma_skinny"
    assert dispatch.select("moe_down", 1, {"dtype": "bf16", "sm_90a": True, "tma_rows": True, "decode_wgmma_fits": True,
                                           "prefill_wgmma_fits": True, "one_token": True}).variant == "wgmma_skinny_t1"
    assert dispatch.select("moe_down", 300, {"dtype": "bf16", "sm_90a": False}).variant == "mma"
    assert dispatch.select("moe_expert_ffn", 48, {"dtype": "bf16", "sm_90a": True, "decode_wgmma": True}).variant \
        == "fused"
    assert dispatch.select("linear", 17, {"precision": "act"}).variant == "library"
    fp8 = {"precision": "act", "weight_format": "fp8_e4m3_block128", "sm_90a": True, "fp8_rows": True, "fp8_fits": True}
    assert [dispatch.select("linear", t, fp8).variant for t in (16, 17, 64, 65, 16384)] == \
        ["skinny", "skinny_fp8_chunks", "skinny_fp8_chunks", "fp8_wgmma", "fp8_wgmma"]
    assert dispatch.select("linear", 17, {**fp8, "sm_90a": False}).variant == "library"
    assert dispatch.select("linear", 17, {**fp8, "fp8_rows": False}).variant == "library"
    assert dispatch.select("linear", 17, {**fp8, "weight_format": "same"}).variant == "library"
    assert dispatch.select("align", 6145, {}).variant == "count_scan_scatter"
    with pytest.raises(dispatch.DispatchError, match="no dispatch table for op 'rms_norm'"):
        dispatch.table("rms_norm")
    with pytest.raises(dispatch.DispatchError, match=">= 1"):
        dispatch.select("linear", 0, {"precision": "act"})


def test_weight_format_is_a_column_with_the_current_formats():
    assert dispatch.WEIGHT_FORMATS == ("same", "fp8_e4m3_block128", "int8_channel", "int8_static", "int4_channel",
                                       "int4_channel_byte", "int4_group256", "int4_group256_packed") and set(dispatch.DTYPES) == {"bf16", "fp16", "fp32"}


def test_the_lowering_emits_the_rows_of_the_case_that_holds():
    """V2-Lite's grouped experts at the default tuning on sm_90: one launch per row variant, in the
    lowering's fixed order, each running over exactly its rows' token range."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_families_moe import DIMS, lower, moe_graphs
    from codegen import sizes
    from codegen.families import _moe_grouped
    from codegen.kernel import Options
    for G, nid in moe_graphs(*DIMS["v2_lite"]):
        op = G.nodes[nid]["op"]
        if op not in ("moe_gate_up_silu", "moe_down"):
            continue
        launches = lower(G, nid, "bf16")
        rows = _moe_grouped.table_rows(Options(), launches[0].params, down=op == "moe_down")
        assert sorted(la.stage for la in launches) == sorted({r.variant for r in rows})
        for T in (1, 2, 3, 255, 256, 257, 9000):
            env = {"T": T, "NP": 6 * T, "SMS": 132}
            running = [la.stage for la in launches if all(sizes.evaluate(g, env) > 0 for g in la.grid)]
            assert running == [next(r.variant for r in rows if r.covers(T))], (op, T, running)
    assert dataclasses.is_dataclass(dispatch.Row)


@pytest.mark.parametrize("knob", ["linear__norm_int8", "linear__norm_fp8"])
def test_the_norms_quantised_rows_move_no_row(knob):
    """linear.norm_int8 / linear.norm_fp8 change who quantises a norm's output (ir/passes/fuse_norm_int8_quant.py,
    fuse_norm_fp8_quant.py), not which kernel serves a size: every table gives the same cases with it on
    (tests/codegen/test_norm_int8.py and test_norm_fp8.py have the launches that run at each T, on and off)."""
    on = tuned(**{knob: True})
    for op in sorted(dispatch.TABLES):
        assert dispatch.table(op, on) == dispatch.table(op, Tuning()), op
