"""fuse_norm_into_route: a MoE layer's residual add + RMSNorm inside its moe_route.

test_passes.py runs every pass before / after on random tiny configs (float64); here: where it
fires (every MoE layer, decode and prefill; never the dense layer's norms), that the fused graph
computes bit for bit what the unfused one did (float32), the switch, and the op itself against
the two ops it stands for."""
from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
from test_passes import FIXED_CFG, PASSES, PIPELINE, Step, graphs_of, make_weights, op_counts, run_step, snapshot, \
    spec_of, v2_lite_graph

import ir
from ir.ops import OPS
from ir.passes import run_pipeline
from ir.passes.rewrite import readers_of

FUSE = PASSES["fuse_norm_into_route"]
# the module (ir.passes binds the name to the pass function): its ENABLED switch
module = importlib.import_module("ir.passes.fuse_norm_into_route")
V3_CFG = {**FIXED_CFG, "model_type": "deepseek_v3", "n_routed_experts": 6, "n_group": 2, "topk_group": 1,
          "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_experts_per_tok": 2, "n_shared_experts": 2,
          "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_hidden_layers": 3, "first_k_dense_replace": 1}
WITHOUT = [p for p in PIPELINE if p.name != "fuse_norm_into_route"]


def before_fuse(G):
    index = [p.name for p in PIPELINE].index("fuse_norm_into_route")
    return run_pipeline(G, PIPELINE[:index])


def _spec(name):
    if name == "deepseek_tiny":
        return ir.load_spec("model_specs/deepseek_tiny.yaml")
    return spec_of({"FIXED_CFG": FIXED_CFG, "V3_CFG": V3_CFG}[name])


# ---- where it fires ------------------------------------------------------------------------------

@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_every_moe_layer_routes_on_its_own_norm(phase):
    before = before_fuse(v2_lite_graph(phase))
    G = FUSE.run(before)
    routes = {d["layer"]: d for _, d in G.nodes(data=True) if d["op"] == "moe_route"}
    assert sorted(routes) == list(range(1, 27))
    norms = [d["layer"] for _, d in G.nodes(data=True) if d["op"] == "fused_add_rms_norm"]
    assert sorted(norms) == [0, 0]                       # the dense layer's two stay
    assert Counter(d["op"] for _, d in before.nodes(data=True))["fused_add_rms_norm"] == 28
    r = routes[3]
    n0 = next(d for _, d in before.nodes(data=True) if d["op"] == "fused_add_rms_norm" and d["layer"] == 3)
    r0 = next(d for _, d in before.nodes(data=True) if d["op"] == "moe_route" and d["layer"] == 3)
    assert r["inputs"] == n0["inputs"] and r["outputs"] == r0["outputs"] + n0["outputs"]
    assert r["attrs"] == {**r0["attrs"], "norm_eps": n0["attrs"]["eps"]}
    assert r["weights"] == {**r0["weights"], "norm": n0["weights"]["weight"]}
    assert set(r["sources"]) == set(n0["sources"]) | set(r0["sources"])
    # h and s keep their readers: the experts read h, the combine s
    rid = next(n for n, d in G.nodes(data=True) if d is r)
    h, s = n0["outputs"]
    assert {G.nodes[x]["op"] for x in readers_of(G, rid, h)} == {"moe_expert_ffn" if phase == "decode"
                                                                  else "moe_gate_up_silu"}
    assert {G.nodes[x]["op"] for x in readers_of(G, rid, s)} == {"moe_combine_residual_rms_norm"}
    # provenance, as the pipeline records it
    fused = run_pipeline(v2_lite_graph(phase)).nodes[rid]
    assert fused["passes"][n0["sources"][0]][-1] == "fuse_norm_into_route"
    assert G.graph["weights"] == before.graph["weights"]


def test_idempotent_and_the_switch():
    G = run_pipeline(v2_lite_graph("decode"))
    assert snapshot(FUSE.run(G)) == snapshot(G)
    before = before_fuse(v2_lite_graph("decode"))
    module.ENABLED = False
    try:
        assert snapshot(FUSE.run(before)) == snapshot(before)
    finally:
        module.ENABLED = True


# ---- the same result, bit for bit ----------------------------------------------------------------

def _fp32(weights: dict, step: Step) -> dict:
    step.cache = [c.float() for c in step.cache]
    return {k: v.float() for k, v in weights.items()}


@pytest.mark.parametrize("name", ["FIXED_CFG", "V3_CFG", "deepseek_tiny"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_the_pipeline_gives_the_same_result_with_and_without_the_pass(name, phase):
    graphs = graphs_of(_spec(name))
    step = Step(_spec(name), [3, 1, 5], 2, 5)
    weights = _fp32(make_weights(graphs, 5), step)
    prefill = run_pipeline(graphs["prefill"])
    after = run_pipeline(graphs[phase])
    assert any(d["op"] == "moe_route" and d["attrs"].get("norm_eps") is not None for _, d in after.nodes(data=True))
    before = run_pipeline(graphs[phase], WITHOUT)
    logits_b, cache_b = run_step(before, weights, step, prefill)
    logits_a, cache_a = run_step(after, weights, step, prefill)
    assert logits_a.dtype == torch.float32 and torch.equal(logits_a, logits_b)
    for a, b in zip(cache_a, cache_b):
        assert torch.equal(a, b)


# ---- the op against the two it stands for ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_is_the_norm_then_the_route(dtype):
    G = FUSE.run(before_fuse(v2_lite_graph("decode")))
    nid = next(n for n, d in G.nodes(data=True) if d["op"] == "moe_route")
    node = ir.ops.Node("moe_route", dict(G.nodes[nid]["attrs"]), dict(G.nodes[nid]["weights"]))
    gen = torch.Generator().manual_seed(3)
    T, D, E = 5, 2048, 64
    a, b = (torch.randn(T, D, generator=gen).to(dtype) for _ in range(2))
    w = {"norm": (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype), "gate": torch.randn(E, D, generator=gen) / 20}
    ids, weights, routing, h, s = OPS["moe_route"].run(node, [a, b], w, None)
    norm = ir.ops.Node("fused_add_rms_norm", {"eps": node.attrs["norm_eps"]}, {"weight": "w"})
    h_ref, s_ref = OPS["fused_add_rms_norm"].run(norm, [a, b], {"weight": w["norm"]}, None)
    plain = ir.ops.Node("moe_route", {k: v for k, v in node.attrs.items() if k != "norm_eps"}, {"gate": "g"})
    ids_ref, weights_ref, routing_ref = OPS["moe_route"].run(plain, [h_ref], {"gate": w["gate"]}, None)
    assert torch.equal(h, h_ref) and torch.equal(s, s_ref) and h.dtype == dtype
    assert torch.equal(ids, ids_ref) and torch.equal(weights, weights_ref)
    assert routing.keys() == routing_ref.keys() and all(torch.equal(torch.as_tensor(routing[k]), torch.as_tensor(routing_ref[k])) for k in routing)
