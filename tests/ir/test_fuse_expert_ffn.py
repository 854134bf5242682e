"""fuse_expert_ffn: a decode MoE layer's moe_gate_up_silu + moe_down as one moe_expert_ffn.

test_passes.py runs the pass before / after on random tiny configs (float64); here: where it fires
(every decode MoE layer, never prefill), that the fused graph computes bit for bit what the unfused
one did (float32), the refusals, and the op itself against the two ops it stands for, with the
shared experts as always-selected experts (fuse_shared_experts) or without."""
from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from test_passes import FIXED_CFG, PASSES, PIPELINE, Step, graphs_of, make_weights, op_counts, run_step, snapshot, \
    spec_of, v2_lite_graph

import ir
from ir.ops import OPS, Node, TType
from ir.ops.moe import align_ref, with_shared_pairs
from ir.passes import run_pipeline
from ir.passes.rewrite import copy_graph

FUSE = PASSES["fuse_expert_ffn"]
V3_CFG = {**FIXED_CFG, "model_type": "deepseek_v3", "n_routed_experts": 6, "n_group": 2, "topk_group": 1,
          "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_experts_per_tok": 2, "n_shared_experts": 2,
          "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_hidden_layers": 3, "first_k_dense_replace": 1}
WITHOUT = [p for p in PIPELINE if p.name != "fuse_expert_ffn"]


def before_fuse(G):
    index = [p.name for p in PIPELINE].index("fuse_expert_ffn")
    return run_pipeline(G, PIPELINE[:index])


def _spec(name):
    if name == "deepseek_tiny":
        return ir.load_spec("model_specs/deepseek_tiny.yaml")
    return spec_of({"FIXED_CFG": FIXED_CFG, "V3_CFG": V3_CFG}[name])


def tiny_graphs(name):
    return graphs_of(_spec(name))


def _step(name, seed):
    return Step(_spec(name), [3, 1, 5], 2, seed)


def per_layer(G, ops) -> Counter:
    return Counter((d["layer"], d["op"]) for _, d in G.nodes(data=True) if d["op"] in ops)


EXPERT_OPS = ("moe_route", "moe_gate_up_silu", "moe_down", "moe_expert_ffn")


# ---- where it fires ------------------------------------------------------------------------------

def _check_layers(decode, prefill):
    moe_layers = sorted(d["layer"] for _, d in decode.nodes(data=True) if d["op"] == "moe_route")
    assert moe_layers
    assert per_layer(decode, EXPERT_OPS) == Counter(
        {(layer, op): 1 for layer in moe_layers for op in ("moe_route", "moe_expert_ffn")})
    assert per_layer(prefill, EXPERT_OPS) == Counter(
        {(layer, op): 1 for layer in moe_layers for op in ("moe_route", "moe_gate_up_silu", "moe_down")})


@pytest.mark.parametrize("name", ["FIXED_CFG", "V3_CFG", "deepseek_tiny"])
def test_every_decode_moe_layer_runs_one_expert_ffn_and_prefill_keeps_two_ops(name):
    graphs = tiny_graphs(name)
    decode, prefill = run_pipeline(graphs["decode"]), run_pipeline(graphs["prefill"])
    _check_layers(decode, prefill)
    # the shared experts ran inside the grouped ops first (fuse_shared_experts): the fused op serves them too
    S = _spec(name).dims["shared_experts"]
    assert S and {d["attrs"]["shared_experts"] for _, d in decode.nodes(data=True) if d["op"] == "moe_route"} == {S}
    assert {d["attrs"]["num_experts"] for _, d in decode.nodes(data=True) if d["op"] == "moe_expert_ffn"} \
        == {_spec(name).dims["experts"] + S}
    # prefill is exactly what it was without the pass (it does not run there)
    assert snapshot(prefill) == snapshot(run_pipeline(graphs["prefill"], WITHOUT))


@pytest.mark.slow
def test_v2_lite_decode_binds_the_stacks_the_two_ops_bound():
    G0 = before_fuse(v2_lite_graph("decode"))
    G = FUSE.run(G0)
    _check_layers(G, run_pipeline(v2_lite_graph("prefill")))
    gu = G0.nodes["L3.moe_ffn.ea"]
    down_id = "L3.moe_ffn.eo"
    down = G0.nodes[down_id]
    assert (gu["op"], down["op"]) == ("moe_gate_up_silu", "moe_down")
    ffn = G.nodes[down_id]     # the fused node keeps moe_down's id and makes its output
    assert ffn["op"] == "moe_expert_ffn"
    assert ffn["inputs"] == gu["inputs"] and ffn["outputs"] == down["outputs"]
    assert ffn["attrs"] == {"num_experts": 66, "inner_dim": 1408, "out_dim": 2048}
    assert ffn["weights"] == {"gate": gu["weights"]["gate"], "up": gu["weights"]["up"],
                              "down": down["weights"]["weight"]}
    assert G.graph["values"][ffn["outputs"][0]] == TType(("T*8", 2048), "act")
    assert "L3.moe_ffn.ea" not in G and G.graph["weights"] == G0.graph["weights"]
    assert set(ffn["sources"]) == set(gu["sources"]) | set(down["sources"])
    assert ffn["order"] == gu["order"] and ffn["layer"] == 3


def test_provenance_names_the_pass():
    G = run_pipeline(v2_lite_graph("decode"))
    ffn = G.nodes["L3.moe_ffn.eo"]
    assert all(p[-1] == "fuse_expert_ffn" for p in ffn["passes"].values())
    assert ffn["passes"]["L3.moe_ffn.eg"] == ["fuse_moe_silu", "fuse_shared_experts", "fuse_expert_ffn"]


def test_idempotent():
    G = run_pipeline(v2_lite_graph("decode"))
    assert snapshot(FUSE.run(G)) == snapshot(G)


# ---- the same result, bit for bit ----------------------------------------------------------------

def _fp32(weights: dict, step: Step) -> dict:
    step.cache = [c.float() for c in step.cache]
    return {k: v.float() for k, v in weights.items()}


def _assert_equal(before, after, weights, step, prefill_graph, exact=True):
    """The step's logits and KV cache (float32) are the same: bit for bit, or (``exact=False``, where
    other passes round elsewhere) to float32's tolerance."""
    logits_b, cache_b = run_step(before, weights, step, prefill_graph)
    logits_a, cache_a = run_step(after, weights, step, prefill_graph)
    assert logits_a.dtype == torch.float32
    same = torch.equal if exact else lambda a, b: torch.testing.assert_close(a, b) is None
    assert same(logits_a, logits_b)
    for a, b in zip(cache_a, cache_b):
        assert same(a, b)


@pytest.mark.parametrize("name", ["FIXED_CFG", "V3_CFG", "deepseek_tiny"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_pass_alone_gives_the_same_result(name, seed):
    graphs = tiny_graphs(name)
    step = _step(name, seed)
    weights = _fp32(make_weights(graphs, seed), step)
    before = before_fuse(graphs["decode"])
    after = FUSE.run(before)
    assert op_counts(after)["moe_expert_ffn"] > 0 and op_counts(after)["moe_down"] == 0
    _assert_equal(before, after, weights, step, graphs["prefill"])


@pytest.mark.parametrize("name", ["FIXED_CFG", "V3_CFG", "deepseek_tiny"])
def test_the_decode_pipeline_gives_the_same_result_with_and_without_the_pass(name):
    graphs = tiny_graphs(name)
    step = _step(name, 3)
    weights = _fp32(make_weights(graphs, 3), step)
    prefill = run_pipeline(graphs["prefill"])
    after = run_pipeline(graphs["decode"])
    assert op_counts(after)["moe_expert_ffn"] > 0
    _assert_equal(run_pipeline(graphs["decode"], WITHOUT), after, weights, step, prefill)


# ---- refusals ------------------------------------------------------------------------------------

def _swiglu_read_twice(text: str) -> str:
    anchor = "      - {op: add, in: [routed, shared], out: y}\n"
    assert anchor in text
    return text.replace(anchor, anchor + "      - {op: add, in: [ea, ea], out: ea_twice}\n")


def _down_on_another_routing(text: str) -> str:
    align = "      - {op: moe_align, in: topk_ids, num_experts: experts, out: routing}\n"
    down = "      - {op: moe_down, in: [ea, routing],"
    assert align in text and text.count(down) == 1
    text = text.replace(align, align + align.replace("out: routing}", "out: routing2}"))
    return text.replace(down, "      - {op: moe_down, in: [ea, routing2],")


@pytest.mark.parametrize("edit, reason", [
    (_swiglu_read_twice, "the SwiGLU (L1.moe_ffn.ea) must be read only by one moe_down; read by "
                           "['L1.moe_ffn.eo', 'L1.moe_ffn.ea_twice']"),
    (_down_on_another_routing, "moe_down reads another routing (L1.moe_ffn.routing2) than moe_gate_up_silu "
                               "(L1.moe_ffn.routing)"),
], ids=["second-reader", "other-routing"])
def test_refused_with_its_reason_and_the_graph_means_what_it_did(edit, reason, caplog):
    spec = spec_of(FIXED_CFG, edit=edit)
    graphs = graphs_of(spec)
    before = before_fuse(graphs["decode"])
    assert op_counts(before)["moe_gate_up_silu"] == op_counts(before)["moe_down"] == 1
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        after = FUSE.run(before)
    assert snapshot(after)[:2] == snapshot(before)[:2]     # nodes and edges untouched
    expected = f"cannot fuse L1.moe_ffn.ea (moe_gate_up_silu) with L1.moe_ffn.eo (moe_down): {reason}"
    assert expected in after.graph["refusals"]
    assert expected in caplog.text
    # the whole pipeline leaves the layer's two ops, and computes what the unfused graph did (the
    # other passes round elsewhere: float32's tolerance)
    G = run_pipeline(graphs["decode"])
    assert op_counts(G)["moe_expert_ffn"] == 0 and op_counts(G)["moe_down"] == 1
    assert expected in G.graph["refusals"]
    step = Step(spec, [2, 4], 2, 3)
    weights = _fp32(make_weights(graphs, 3), step)
    _assert_equal(graphs["decode"], G, weights, step, graphs["prefill"], exact=False)


def test_refused_when_the_two_ops_disagree_on_the_expert_count():
    G = copy_graph(before_fuse(graphs_of(spec_of(FIXED_CFG))["decode"]))
    down = next(n for n, d in G.nodes(data=True) if d["op"] == "moe_down")
    E = G.nodes[down]["attrs"]["num_experts"]
    assert E == 5                                    # 4 routed + 1 shared
    G.nodes[down]["attrs"]["num_experts"] = E + 1
    after = FUSE.run(G)
    assert op_counts(after)["moe_expert_ffn"] == 0
    assert any(r.endswith(f"moe_gate_up_silu serves {E} experts, moe_down {E + 1}") for r in after.graph["refusals"])


# ---- the op --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_op_is_gate_up_silu_then_down(shared, dtype):
    """moe_expert_ffn's reference is moe_gate_up_silu's then moe_down's, bit for bit, also with S
    shared experts as always-selected experts 0..S-1 of the stack (fuse_shared_experts' routing)."""
    T, D, M, E, K = 5, 12, 6, 4, 2
    gen = torch.Generator().manual_seed(shared)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    ids, weights = with_shared_pairs(ids, weights, E, shared)
    routing = align_ref(ids, E + shared)
    x = torch.randn(T, D, generator=gen).to(dtype)
    w = {"gate": torch.randn(E + shared, M, D, generator=gen).to(dtype),
         "up": torch.randn(E + shared, M, D, generator=gen).to(dtype),
         "down": torch.randn(E + shared, D, M, generator=gen).to(dtype)}
    n = E + shared
    ffn = Node("moe_expert_ffn", {"num_experts": n, "inner_dim": M, "out_dim": D}, {r: r for r in w})
    (a,) = OPS["moe_gate_up_silu"].run(Node("moe_gate_up_silu", {"num_experts": n, "out_dim": M}), [x, routing],
                                       {"gate": w["gate"], "up": w["up"]}, None)
    (expected,) = OPS["moe_down"].run(Node("moe_down", {"num_experts": n, "out_dim": D}), [a, routing],
                                      {"weight": w["down"]}, None)
    (out,) = OPS["moe_expert_ffn"].run(ffn, [x, routing], w, None)
    assert out.shape == (T * (K + shared), D) and out.dtype == dtype
    assert torch.equal(out, expected)
    if shared:   # every token's last S rows are its shared experts' (weight 1 in the route)
        assert (ids[:, -shared:] == torch.arange(shared)).all()

    # infer: the per-pair output and the three stacks
    outs, shapes = OPS["moe_expert_ffn"].infer(
        ffn, [TType(("T", D), "act"), TType((f"T*{K + shared}", n), "routing")], None)
    assert outs == [TType((f"T*{K + shared}", D), "act")]
    assert shapes == {"gate": (n, M, D), "up": (n, M, D), "down": (n, D, M)}


def test_infer_rejects_what_moe_gate_up_rejects():
    ffn = Node("moe_expert_ffn", {"num_experts": 4, "inner_dim": 6, "out_dim": 12})
    infer = OPS["moe_expert_ffn"].infer
    with pytest.raises(ir.ops.ShapeError, match="second input must be routing"):
        infer(ffn, [TType(("T", 12), "act"), TType(("T*2", 4), "act")], None)
    with pytest.raises(ir.ops.ShapeError, match="expects an activation"):
        infer(ffn, [TType(("T", 12), "f32"), TType(("T*2", 4), "routing")], None)
    with pytest.raises(ir.ops.ShapeError, match="number of experts"):
        infer(ffn, [TType(("T", 12), "act"), TType(("T*2", 5), "routing")], None)
