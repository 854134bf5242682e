"""fuse_v_up_fp8_quant (ir/passes/fuse_v_up_fp8_quant.py): decode's mla_v_up whose output feeds FP8 weights
(o_proj) writes o's e4m3 rows and per-128-column scales too.  Checked with the reference interpreter on a tiny
V3-style model whose linears are all FP8 and whose V is 128 (one head's V columns = one 128-column group), in
float64: the logits and the KV cache are the same before and after the pass, the rows are quantize_act_fp8 of
o bit for bit; the pass runs only at decode and where its knob is named; V != 128 is refused, logged."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

import ir
from ir.act_quant import quantize_act_fp8
from ir.ops import TType
from ir.passes import PIPELINE, run_pipeline
from ir.passes.fuse_v_up_fp8_quant import fuse_v_up_fp8_quant
from ir.passes.norm_rows import row_names
from runtime.model_loader import random_weights, weight_specs

from test_fuse_norm_fp8_quant import _spec

KNOB = frozenset({"linear.v_up_fp8"})
V128 = {"v_head_dim": 128, "hidden_size": 128}   # o [T, 2 * 128]: two heads, two groups


@lru_cache(maxsize=None)
def _graphs():
    spec = _spec(**V128)
    plain = {ph: run_pipeline(ir.build_graph(spec, ph)) for ph in ir.PHASES}
    fused = {ph: run_pipeline(ir.build_graph(spec, ph), knobs=KNOB) for ph in ir.PHASES}
    return spec, plain, fused


def _quant_v_ups(G) -> dict:
    return {n: d for n, d in G.nodes(data=True) if d["op"] == "mla_v_up" and d["attrs"].get("quant")}


def test_the_pass_runs_at_decode_behind_its_knob():
    (p,) = [p for p in PIPELINE if p.run is fuse_v_up_fp8_quant]
    assert p.knob == "linear.v_up_fp8" and p.phases == ("decode",)
    spec, plain, fused = _graphs()
    assert not _quant_v_ups(plain["decode"]) and not _quant_v_ups(fused["prefill"])
    marked = _quant_v_ups(fused["decode"])
    assert len(marked) == spec.dims["layers"]
    for d in marked.values():
        o = d["outputs"][0]
        assert d["attrs"]["quant"] == "fp8" and d["outputs"][1:] == list(row_names(o, "fp8"))
        T, n = fused["decode"].graph["values"][o].shape
        assert n == 2 * 128
        assert fused["decode"].graph["values"][f"{o}.qf8"] == TType((T, n // 4), "i32")
        assert fused["decode"].graph["values"][f"{o}.sf8"] == TType((T, 2), "f32")
        assert "fuse_v_up_fp8_quant" in str(d.get("passes")), d.get("passes")


def test_the_results_do_not_change_and_the_rows_are_the_quantised_output():
    from test_passes import Step, assert_same_step   # the same packed prefill + paged decode harness
    spec, plain, fused = _graphs()
    specs = {**weight_specs(plain), **weight_specs(fused)}
    weights = random_weights(specs, dtype=torch.float64, device="cpu", seed=11, std=0.2)
    step = Step(spec, [3, 5], 4, seed=11)
    assert_same_step(plain["decode"], fused["decode"], weights, step, plain["prefill"])
    G = fused["decode"]
    marked = _quant_v_ups(G)
    keep = tuple(v for d in marked.values() for v in d["outputs"])
    cache = [c.clone() for c in step.cache]
    ir.run_graph(fused["prefill"], {"ids": step.prefill_ids}, weights, step.prefill_ctx(cache))
    got = ir.run_graph(G, {"ids": step.decode_ids}, weights, step.decode_ctx(cache), keep=keep)
    for d in marked.values():
        o, q, s = d["outputs"]
        want_q, want_s = quantize_act_fp8(got[o])
        assert torch.equal(got[q].view(torch.uint8), want_q.view(torch.uint8)), o
        assert got[s].dtype == torch.float32 and torch.equal(got[s], want_s), o
        assert (got[s] > 0).all(), o


def test_a_v_other_than_128_is_refused_and_logged(caplog):
    spec = _spec()   # V = 6
    with caplog.at_level("INFO", logger="dsgraph.passes"):
        G = run_pipeline(ir.build_graph(spec, "decode"), knobs=KNOB)
    assert not _quant_v_ups(G)
    why = [r for r in G.graph["refusals"] if "V = 6" in r]
    assert why and all("\n" not in r for r in why), G.graph["refusals"]
    assert any("V = 6" in r.getMessage() for r in caplog.records)


def test_a_16_bit_model_is_left_as_it_is():
    G = run_pipeline(ir.build_graph(_spec(quantization_config=None, **V128), "decode"))
    H = fuse_v_up_fp8_quant(G)
    assert not _quant_v_ups(H) and G.graph["values"] == H.graph["values"]


def test_the_pass_is_idempotent_and_leaves_its_input_alone():
    _, plain, fused = _graphs()
    G = plain["decode"]
    values = dict(G.graph["values"])
    once = fuse_v_up_fp8_quant(G)
    assert G.graph["values"] == values and not _quant_v_ups(G)
    assert fuse_v_up_fp8_quant(once).graph["values"] == once.graph["values"] == fused["decode"].graph["values"]


def test_a_spec_cannot_ask_for_int8_rows():
    from types import SimpleNamespace

    from ir.ops import OPS, ShapeError
    spec, plain, _ = _graphs()
    ol = TType(("T", 2, spec.dims["kv_lora_rank"]), "act")
    with pytest.raises(ShapeError, match="fp8 rows or none"):
        OPS["mla_v_up"].infer(SimpleNamespace(attrs={"quant": "int8"}), [ol], plain["decode"].graph["model"])
