"""Passes on a graph whose linears are stored in FP8: the same results before and after (the interpreter
dequantises exactly), formats and scale companions carried through stacking, fusing and rank slicing, and the
fusions that cannot carry them refused with the reason logged."""
from __future__ import annotations

import logging

import pytest
import torch

import ir
from ir.config_to_spec import spec_from_config
from ir.formats import FP8, scale_shape
from ir.parallel import ParallelError
from ir.passes import run_pipeline
from ir.passes.fuse_shared_experts import fuse_shared_experts
from ir.passes.fuse_sibling_linears import fuse_sibling_linears
from ir.passes.shard_for_rank import shard_for_rank
from runtime.model_loader import random_weights, weight_specs

FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
V3_CFG = {  # V3-style (noaux router, q_lora) with every linear FP8; widths past one block in places
    "model_type": "deepseek_v3", "hidden_size": 136, "num_attention_heads": 2, "q_lora_rank": 40, "kv_lora_rank": 130,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "intermediate_size": 140,
    "moe_intermediate_size": 20, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 4, "topk_group": 2, "vocab_size": 50, "num_hidden_layers": 2, "first_k_dense_replace": 1,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "quantization_config": FP8_QUANT,
}


def _spec(**overrides):
    return ir.load_spec(spec_from_config({**V3_CFG, **overrides}, name="t"), file="t.yaml")


def _before(name: str):
    from ir.passes import PIPELINE
    return PIPELINE[:[p.name for p in PIPELINE].index(name)]


@pytest.mark.parametrize("phase", ir.PHASES)
def test_the_pipeline_keeps_fp8_semantics(phase):
    from test_passes import Step, run_step   # the same packed prefill + paged decode harness
    spec = _spec()
    graphs = {ph: ir.build_graph(spec, ph) for ph in ir.PHASES}
    after = {ph: run_pipeline(G) for ph, G in graphs.items()}
    specs = {**weight_specs(graphs), **weight_specs(after)}
    weights = random_weights(specs, dtype=torch.float64, device="cpu", seed=3, std=0.2)
    assert any(t.dtype == torch.float8_e4m3fn for t in weights.values())
    step = Step(spec, [3, 5], 4, seed=3)
    before_logits, before_cache = run_step(graphs[phase], weights, step, graphs["prefill"])
    after_logits, after_cache = run_step(after[phase], weights, step, after["prefill"])
    torch.testing.assert_close(after_logits, before_logits, rtol=1e-9, atol=1e-9)
    for a, b in zip(after_cache, before_cache):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    # the fused expert stack (shared experts first) is FP8 with its stacked scales
    stack = next(n for n in after[phase].graph["weights"] if "+shared_experts" in n)
    info = after[phase].graph["weights"][stack]
    assert info.format == FP8.name
    assert after[phase].graph["weights"][stack + "_scale_inv"].shape == (info.shape[0], *scale_shape(info.shape[1:], FP8))


def test_the_fp8_graph_is_the_plain_graph_on_the_dequantised_weights():
    """The interpreter's FP8 semantics: exactly the unquantised graph run on q * s; and not the float weights
    the FP8 ones were quantised from (a guard that the test above runs FP8 at all)."""
    from ir.formats import dequantize
    from test_passes import Step, run_step
    spec = _spec()
    G = ir.build_graph(spec, "prefill")
    weights = random_weights(weight_specs({"prefill": G}), dtype=torch.float64, device="cpu", seed=3, std=0.2)
    logits, _ = run_step(G, weights, Step(spec, [4], 4, seed=3))
    spec_bf = ir.load_spec(spec_from_config({**V3_CFG, "quantization_config": None}, name="t"), file="t.yaml")
    G_bf = ir.build_graph(spec_bf, "prefill")
    drawn = random_weights(weight_specs({"prefill": G_bf}), dtype=torch.float64, device="cpu", seed=3, std=0.2)
    dequantised = {n: dequantize(weights[n], (weights[n + "_scale_inv"],), FP8).double()
                   if weights[n].dtype == torch.float8_e4m3fn else weights[n] for n in drawn}
    same, _ = run_step(G_bf, dequantised, Step(spec_bf, [4], 4, seed=3))
    torch.testing.assert_close(logits, same, rtol=1e-12, atol=1e-12)
    other, _ = run_step(G_bf, drawn, Step(spec_bf, [4], 4, seed=3))
    assert (logits - other).abs().max() > 1e-3


def test_mixed_formats_do_not_fuse_and_say_why(caplog):
    """q_a and kv_a read the same input; with only kv_a FP8 they are not one multi_linear."""
    text = spec_from_config({**V3_CFG, "quantization_config": None}, name="t") + (
        '\nweight_formats:\n  "model.layers.*.self_attn.kv_a_proj_with_mqa.weight": fp8_e4m3_block128\n')
    G = ir.build_graph(ir.load_spec(text, file="t.yaml"), "decode")
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        H = fuse_sibling_linears(G)
    assert "stored in different formats (activation dtype and fp8_e4m3_block128)" in caplog.text
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    (node,) = [d for _, d in H.nodes(data=True) if kv_a in d["weights"].values()]
    assert node["op"] == "linear"
    ir.verify(H)


def test_shared_experts_of_another_format_are_not_stacked(caplog):
    text = spec_from_config({**V3_CFG, "quantization_config": None}, name="t") + (
        '\nweight_formats:\n  "model.layers.*.mlp.experts.*": fp8_e4m3_block128\n')
    G = run_pipeline(ir.build_graph(ir.load_spec(text, file="t.yaml"), "decode"), _before("fuse_shared_experts"))
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        H = fuse_shared_experts(G)
    assert "one stack has one format" in caplog.text
    assert not any("+shared_experts" in n for n in H.graph["weights"])


def test_shared_expert_slices_off_the_blocks_are_not_stacked(caplog):
    """Two shared experts of 20 rows each: the second starts inside the shared tensor's first 128-row block."""
    G = run_pipeline(ir.build_graph(_spec(n_shared_experts=2), "decode"), _before("fuse_shared_experts"))
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        H = fuse_shared_experts(G)
    assert "cannot carry their scales" in caplog.text and "does not fall on the 128-wide blocks" in caplog.text
    assert not any("+shared_experts" in n for n in H.graph["weights"])
    ir.verify(H)


def test_a_rank_slices_the_scales_with_the_weight():
    """Two ranks, every split on 128-row / column blocks: each rank's slice carries its blocks' scales."""
    spec = _spec(num_attention_heads=8, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, intermediate_size=256,
                 moe_intermediate_size=256)
    G = ir.build_graph(spec, "decode")
    G.graph["parallel"] = {"world": 2, "rank": 1}
    H = shard_for_rank(G)
    ir.verify(H)
    q_b = "model.layers.0.self_attn.q_b_proj.weight"      # 8 heads x 64 = 512 rows: rank 1 has rows 256..511
    assert H.graph["weights"][q_b].shape == (256, 40) and H.graph["weights"][q_b].format == FP8.name
    assert H.graph["weights"][q_b + "_scale_inv"].shape == (2, 1)
    shard = H.graph["shards"][q_b + "_scale_inv"]
    assert (shard.kind, shard.start, shard.stop) == ("rows", 2, 4)
    o = "model.layers.0.self_attn.o_proj.weight"          # columns 128..255 of 256
    assert H.graph["weights"][o + "_scale_inv"].shape == (2, 1)
    assert (H.graph["shards"][o + "_scale_inv"].kind, H.graph["shards"][o + "_scale_inv"].start) == ("cols", 1)
    experts = "model.layers.1.mlp.experts.*.gate_proj.weight"
    assert H.graph["weights"][experts + "_scale_inv"].parts == tuple(
        f"model.layers.1.mlp.experts.{e}.gate_proj.weight_scale_inv" for e in range(4, 8))


def test_a_rank_slice_inside_a_block_is_one_parallel_error():
    G = ir.build_graph(_spec(), "decode")        # intermediate 140 over 2 ranks: rank 1 starts at row 70
    G.graph["parallel"] = {"world": 2, "rank": 0}
    with pytest.raises(ParallelError, match=r"^weight model\.layers\.0\.self_attn\.q_b_proj\.weight .*"
                                            r"does not fall on the 128-wide blocks"):
        shard_for_rank(G)
