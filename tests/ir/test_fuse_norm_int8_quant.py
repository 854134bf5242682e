"""fuse_norm_int8_quant (ir/passes/fuse_norm_int8_quant.py): the norms whose output feeds weights that
quantise it per token to int8 write the quantised rows too.  Checked with the reference interpreter on a
tiny model in msModelSlim's W4A8 layout (int8 linears, int4 routed experts), in float64: the logits and
the KV cache are the same before and after the pass, and the rows a norm writes are quantized_rows of
its output, bit for bit; the pass runs only where its knob is named; it marks exactly the norms with
such readers."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

import ir
from ir.config_to_spec import msmodelslim_weight_formats, spec_from_config
from ir.formats_int import qrow, quantize_activation, quantized_rows
from ir.ops import TType
from ir.passes import PIPELINE, run_pipeline
from ir.passes.fuse_norm_int8_quant import fuse_norm_int8_quant
from ir.passes.norm_rows import NORMS, row_names
from runtime.model_loader import random_weights, weight_specs

KNOB = frozenset({"linear.norm_int8"})
TINY = {  # V3-style with q_lora (q_a_layernorm feeds q_b), a dense first layer, odd widths
    "model_type": "deepseek_v3", "hidden_size": 40, "num_attention_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 18,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3, "intermediate_size": 22,
    "moe_intermediate_size": 10, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 1, "vocab_size": 50, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
}


def _spec(cfg=TINY, layout=("w8a8_dynamic", "w4a8_dynamic")):
    text = spec_from_config(cfg, name="tiny")
    if layout:
        text += msmodelslim_weight_formats(*layout, True)
    return ir.load_spec(text, file="tiny.yaml")


@lru_cache(maxsize=None)
def _graphs():
    spec = _spec()
    plain = {ph: run_pipeline(ir.build_graph(spec, ph)) for ph in ir.PHASES}
    fused = {ph: run_pipeline(ir.build_graph(spec, ph), knobs=KNOB) for ph in ir.PHASES}
    return spec, plain, fused


def _quant_norms(G) -> dict:
    return {n: d for n, d in G.nodes(data=True) if d["attrs"].get("quant") is not None}


def test_the_pass_is_in_the_pipeline_behind_its_knob():
    (p,) = [p for p in PIPELINE if p.run is fuse_norm_int8_quant]
    assert p.knob == "linear.norm_int8"
    _, plain, fused = _graphs()
    for ph in ir.PHASES:
        assert not _quant_norms(plain[ph]), ph
        assert _quant_norms(fused[ph]), ph


@pytest.mark.parametrize("phase", ir.PHASES)
def test_the_results_do_not_change_and_the_rows_are_the_quantised_output(phase):
    from test_passes import Step, assert_same_step   # the same packed prefill + paged decode harness
    spec, plain, fused = _graphs()
    specs = {**weight_specs(plain), **weight_specs(fused)}
    weights = random_weights(specs, dtype=torch.float64, device="cpu", seed=5, std=0.2)
    assert any(t.dtype == torch.int8 for t in weights.values())
    step = Step(spec, [3, 5], 4, seed=5)
    assert_same_step(plain[phase], fused[phase], weights, step, plain["prefill"])
    # the rows each norm writes: quantize_activation of its output, padded to qrow bytes, four a word
    G = fused[phase]
    norms = _quant_norms(G)
    keep = tuple(v for d in norms.values() for v in (d["outputs"][0], *row_names(d["outputs"][0], "int8")))
    cache = [c.clone() for c in step.cache]
    if phase == "prefill":
        got = ir.run_graph(G, {"ids": step.prefill_ids}, weights, step.prefill_ctx(cache), keep=keep)
    else:
        ir.run_graph(fused["prefill"], {"ids": step.prefill_ids}, weights, step.prefill_ctx(cache))
        got = ir.run_graph(G, {"ids": step.decode_ids}, weights, step.decode_ctx(cache), keep=keep)
    for d in norms.values():
        h = d["outputs"][0]
        q, s = row_names(h, "int8")
        want_q, want_s = quantize_activation(got[h])
        K = got[h].shape[1]
        rows = got[q].view(torch.int8)
        assert got[q].dtype == torch.int32 and rows.shape == (got[h].shape[0], qrow(K)), h
        assert torch.equal(rows[:, :K], want_q) and not rows[:, K:].any(), h
        assert torch.equal(got[s], want_s.reshape(-1)), h


def test_it_marks_exactly_the_norms_read_by_per_token_int_weights():
    """Every layer's input norm (the attention's linears, int8) and its MoE / MLP input norm (the
    routed int4 experts, the shared / dense int8 MLP), q_a_layernorm (q_b, int8); not the final norm
    (the lm head stays 16-bit) and not kv_a_layernorm (kv_b stays 16-bit; it is inside the cache write)."""
    spec, _, fused = _graphs()
    layers = spec.dims["layers"]
    for ph in ir.PHASES:
        G = fused[ph]
        norms = _quant_norms(G)
        assert all(d["op"] in NORMS for d in norms.values())
        outs = {d["outputs"][0] for d in norms.values()}
        assert len(outs) == 3 * layers, sorted(outs)    # input norm, q_a norm, MoE / MLP input norm a layer
        assert not any(o.startswith("head.") for o in outs), sorted(outs)
        for d in norms.values():
            h = d["outputs"][0]
            assert d["outputs"][-2:] == list(row_names(h, "int8"))
            T, n = G.graph["values"][h].shape
            assert G.graph["values"][f"{h}.qi8"] == TType((T, qrow(n) // 4), "i32")
            assert G.graph["values"][f"{h}.si8"] == TType((T,), "f32")
            assert "fuse_norm_int8_quant" in str(d.get("passes")), d.get("passes")


def test_a_16_bit_model_is_left_as_it_is():
    spec = _spec(layout=None)
    for ph in ir.PHASES:
        G = run_pipeline(ir.build_graph(spec, ph))
        H = fuse_norm_int8_quant(G)
        assert not _quant_norms(H)
        assert sorted(G.nodes) == sorted(H.nodes) and G.graph["values"] == H.graph["values"]


def test_the_pass_is_idempotent_and_leaves_its_input_alone():
    _, plain, fused = _graphs()
    G = plain["decode"]
    values = dict(G.graph["values"])
    once = fuse_norm_int8_quant(G)
    assert G.graph["values"] == values and not _quant_norms(G)
    twice = fuse_norm_int8_quant(once)
    assert twice.graph["values"] == once.graph["values"] == fused["decode"].graph["values"]


def test_quantized_rows_pads_with_zeros_and_packs_four_bytes_a_word():
    x = torch.randn(3, 21, dtype=torch.float64)
    x[1] = 0
    q, s = quantized_rows(x)
    assert q.shape == (3, 8) and q.dtype == torch.int32 and s.shape == (3,)
    rows = q.view(torch.int8)
    want_q, want_s = quantize_activation(x)
    assert torch.equal(rows[:, :21], want_q) and not rows[:, 21:].any()
    assert torch.equal(s, want_s.reshape(-1)) and s[1] == 0 and not rows[1].any()
