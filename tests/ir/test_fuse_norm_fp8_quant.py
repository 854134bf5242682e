"""fuse_norm_fp8_quant (ir/passes/fuse_norm_fp8_quant.py): the norms whose output feeds FP8 weights write its
e4m3 rows and per-128-column scales too.  Checked with the reference interpreter on a tiny V3-style model
whose linears and experts are all FP8 (DeepSeek-V3's blocks), in float64: the logits and the KV cache are the
same before and after the pass, and the rows a norm writes are quantize_act_fp8 of its output, bit for bit;
the pass runs only where its knob is named; it marks exactly the norms with FP8 readers, and refuses (logged)
a width the FP8 GEMMs do not take."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

import ir
from ir.act_quant import quantize_act_fp8
from ir.config_to_spec import spec_from_config
from ir.ops import TType
from ir.passes import PIPELINE, run_pipeline
from ir.passes.fuse_norm_fp8_quant import fuse_norm_fp8_quant
from ir.passes.norm_rows import NORMS, row_names
from runtime.model_loader import random_weights, weight_specs

KNOB = frozenset({"linear.norm_fp8"})
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
TINY = {  # V3-style with q_lora (q_a_layernorm feeds q_b), a dense first layer; D = 144: a partial 128-group
    "model_type": "deepseek_v3", "hidden_size": 144, "num_attention_heads": 2, "q_lora_rank": 48, "kv_lora_rank": 32,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "intermediate_size": 48,
    "moe_intermediate_size": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 1, "vocab_size": 50, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "quantization_config": FP8_QUANT,
}


def _spec(**overrides):
    cfg = {k: v for k, v in {**TINY, **overrides}.items() if v is not None}
    return ir.load_spec(spec_from_config(cfg, name="tiny"), file="tiny.yaml")


@lru_cache(maxsize=None)
def _graphs():
    spec = _spec()
    plain = {ph: run_pipeline(ir.build_graph(spec, ph)) for ph in ir.PHASES}
    fused = {ph: run_pipeline(ir.build_graph(spec, ph), knobs=KNOB) for ph in ir.PHASES}
    return spec, plain, fused


def _quant_norms(G) -> dict:
    return {n: d for n, d in G.nodes(data=True) if d["attrs"].get("quant") is not None}


def test_the_pass_is_in_the_pipeline_behind_its_knob():
    (p,) = [p for p in PIPELINE if p.run is fuse_norm_fp8_quant]
    assert p.knob == "linear.norm_fp8"
    _, plain, fused = _graphs()
    for ph in ir.PHASES:
        assert not _quant_norms(plain[ph]), ph
        assert _quant_norms(fused[ph]), ph
        assert {d["attrs"]["quant"] for d in _quant_norms(fused[ph]).values()} == {"fp8"}


@pytest.mark.parametrize("phase", ir.PHASES)
def test_the_results_do_not_change_and_the_rows_are_the_quantised_output(phase):
    from test_passes import Step, assert_same_step   # the same packed prefill + paged decode harness
    spec, plain, fused = _graphs()
    specs = {**weight_specs(plain), **weight_specs(fused)}
    weights = random_weights(specs, dtype=torch.float64, device="cpu", seed=7, std=0.2)
    assert any(t.dtype == torch.float8_e4m3fn for t in weights.values())
    step = Step(spec, [3, 5], 4, seed=7)
    assert_same_step(plain[phase], fused[phase], weights, step, plain["prefill"])
    # the rows each norm writes: quantize_act_fp8 of its output, the e4m3 bytes four a word
    G = fused[phase]
    norms = _quant_norms(G)
    keep = tuple(v for d in norms.values() for v in (d["outputs"][0], *row_names(d["outputs"][0], "fp8")))
    cache = [c.clone() for c in step.cache]
    if phase == "prefill":
        got = ir.run_graph(G, {"ids": step.prefill_ids}, weights, step.prefill_ctx(cache), keep=keep)
    else:
        ir.run_graph(fused["prefill"], {"ids": step.prefill_ids}, weights, step.prefill_ctx(cache))
        got = ir.run_graph(G, {"ids": step.decode_ids}, weights, step.decode_ctx(cache), keep=keep)
    for d in norms.values():
        h = d["outputs"][0]
        q, s = row_names(h, "fp8")
        want_q, want_s = quantize_act_fp8(got[h])
        T, K = got[h].shape
        assert got[q].dtype == torch.int32 and got[q].shape == (T, K // 4), h
        assert torch.equal(got[q].view(torch.uint8), want_q.view(torch.uint8)), h
        assert got[s].dtype == torch.float32 and torch.equal(got[s], want_s), h
        assert (got[s] > 0).all(), h


def test_it_marks_exactly_the_norms_read_by_fp8_weights():
    """Every layer's input norm (q_a + kv_a), q_a_layernorm (q_b) and its MoE / MLP input norm (the routed
    and shared experts, the dense MLP); not the final norm (the lm head stays 16-bit) and not kv_a_layernorm
    (inside the cache write; kv_b reads the context rows, not the step's tokens)."""
    spec, _, fused = _graphs()
    layers = spec.dims["layers"]
    for ph in ir.PHASES:
        G = fused[ph]
        norms = _quant_norms(G)
        assert all(d["op"] in NORMS for d in norms.values())
        outs = {d["outputs"][0] for d in norms.values()}
        assert len(outs) == 3 * layers, sorted(outs)
        assert not any(o.startswith("head.") for o in outs), sorted(outs)
        for d in norms.values():
            h = d["outputs"][0]
            assert d["outputs"][-2:] == list(row_names(h, "fp8")) == [f"{h}.qf8", f"{h}.sf8"]
            T, n = G.graph["values"][h].shape
            assert G.graph["values"][f"{h}.qf8"] == TType((T, n // 4), "i32")
            assert G.graph["values"][f"{h}.sf8"] == TType((T, -(-n // 128)), "f32")
            assert "fuse_norm_fp8_quant" in str(d.get("passes")), d.get("passes")


def test_a_width_the_fp8_gemms_do_not_take_is_refused_and_logged(caplog):
    """D = 136 and q_lora 40: no norm of the model gets rows; each refusal says why, in one line."""
    spec = _spec(hidden_size=136, q_lora_rank=40)
    with caplog.at_level("INFO", logger="dsgraph.passes"):
        G = run_pipeline(ir.build_graph(spec, "decode"), knobs=KNOB)
    assert not _quant_norms(G)
    why = [r for r in G.graph["refusals"] if "16-byte chunks" in r]
    assert why and all("\n" not in r for r in why), G.graph["refusals"]
    assert any("width 136" in r for r in why) and any("width 40" in r for r in why), why
    assert any("16-byte chunks" in r.getMessage() for r in caplog.records)


def test_a_16_bit_model_is_left_as_it_is():
    spec = _spec(quantization_config=None)
    for ph in ir.PHASES:
        G = run_pipeline(ir.build_graph(spec, ph))
        H = fuse_norm_fp8_quant(G)
        assert not _quant_norms(H)
        assert sorted(G.nodes) == sorted(H.nodes) and G.graph["values"] == H.graph["values"]


def test_the_pass_is_idempotent_and_leaves_its_input_alone():
    _, plain, fused = _graphs()
    G = plain["decode"]
    values = dict(G.graph["values"])
    once = fuse_norm_fp8_quant(G)
    assert G.graph["values"] == values and not _quant_norms(G)
    twice = fuse_norm_fp8_quant(once)
    assert twice.graph["values"] == once.graph["values"] == fused["decode"].graph["values"]


def test_an_all_zero_row_has_the_floor_scale_and_zero_bytes():
    from types import SimpleNamespace

    from ir.ops.core import norm_quant_ref
    h = torch.randn(3, 144, dtype=torch.bfloat16)
    h[1] = 0
    q, s = norm_quant_ref(SimpleNamespace(attrs={"quant": "fp8"}), h)
    assert q.shape == (3, 36) and s.shape == (3, 2)
    assert not q[1].any() and torch.equal(s[1], torch.full((2,), 1e-10 / 448, dtype=torch.float32))
