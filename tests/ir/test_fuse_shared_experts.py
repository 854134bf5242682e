"""fuse_shared_experts: the shared MLP as S always-selected experts of the grouped ops.

test_passes.py runs every pass before / after on random tiny configs (n_shared_experts 1 or 2);
here: what the pass binds (the stacked weights, their slices), the ops' attributes, a fixed
S = 2 model, the refusals, and a rank's graph left alone."""
from __future__ import annotations

import logging

from test_passes import FIXED_CFG, PASSES, PIPELINE, Step, assert_same_step, graphs_of, make_weights, op_counts, \
    spec_of, v2_lite_graph

import ir
from ir.ops import WeightSlice
from ir.passes import run_pipeline

FUSE = PASSES["fuse_shared_experts"]


def before_fuse(G):
    index = [p.name for p in PIPELINE].index("fuse_shared_experts")
    return run_pipeline(G, PIPELINE[:index])


def test_v2_lite_stacks_the_shared_slices_behind_the_routed_experts():
    for phase in ir.PHASES:
        G = FUSE.run(before_fuse(v2_lite_graph(phase)))
        route = G.nodes["L3.moe_ffn.topk_ids"]
        assert route["op"] == "moe_route" and route["attrs"]["shared_experts"] == 2
        ids, w, routing = route["outputs"]
        assert G.graph["values"][ids].shape == ("T", 8) and G.graph["values"][routing].shape == ("T*8", 66)
        gu = next(d for _, d in G.nodes(data=True) if d["op"] == "moe_gate_up_silu" and d["layer"] == 3)
        assert gu["attrs"]["num_experts"] == 66 and gu["inputs"][1] == routing
        gate = G.graph["weights"][gu["weights"]["gate"]]
        assert gu["weights"]["gate"] == "model.layers.3.mlp.experts.*+shared_experts.gate_proj.weight"
        assert gate.shape == (66, 1408, 2048) and gate.parts[2] == "model.layers.3.mlp.experts.0.gate_proj.weight"
        assert gate.parts[:2] == tuple(
            WeightSlice("model.layers.3.mlp.shared_experts.gate_proj.weight", 0, s * 1408, (s + 1) * 1408, (2816, 2048))
            for s in range(2))
        down = next(d for _, d in G.nodes(data=True) if d["op"] == "moe_down" and d["layer"] == 3)
        wd = G.graph["weights"][down["weights"]["weight"]]
        assert wd.shape == (66, 2048, 1408) and wd.parts[1] == WeightSlice(
            "model.layers.3.mlp.shared_experts.down_proj.weight", 1, 1408, 2816, (2048, 2816))
        combine = G.nodes["L3.x_out"]
        assert combine["op"] == "moe_combine_residual" and combine["attrs"]["shared_experts"] == 2
        assert len(combine["inputs"]) == 3 and combine["inputs"][1] == w
        # the shared MLP's ops are gone, and so are their own bindings and the routed-only stacks
        assert not any(n.startswith("L3.moe_ffn.s") for n in G)
        assert "model.layers.3.mlp.shared_experts.gate_proj.weight" not in G.graph["weights"]
        assert "model.layers.3.mlp.experts.*.gate_proj.weight" not in G.graph["weights"]
        # provenance: the experts' gate_up_silu stands for the shared gate, up and SwiGLU too
        assert set(gu["sources"]) >= {"L3.moe_ffn.sg", "L3.moe_ffn.su", "L3.moe_ffn.sa"}
        assert route["sources"] == ["L3.moe_ffn.router_logits", "L3.moe_ffn.topk_ids", "L3.moe_ffn.routing"]
        assert op_counts(G)["silu_and_mul"] == 1          # the dense layer's


def test_two_shared_experts_compute_the_unfused_layer():
    cfg = {**FIXED_CFG, "n_shared_experts": 2, "num_experts_per_tok": 3, "n_group": 1, "topk_group": 1,
           "topk_method": "greedy", "norm_topk_prob": True, "routed_scaling_factor": 2.5}
    spec = spec_of(cfg)
    graphs = graphs_of(spec)
    weights = make_weights(graphs, 5)
    for phase in ir.PHASES:
        before = before_fuse(graphs[phase])
        after = FUSE.run(before)
        assert op_counts(after)["moe_combine_residual"] == 1 and op_counts(after)["silu_and_mul"] == 1
        assert_same_step(before, after, weights, Step(spec, [3, 1, 5], 2, 5), graphs["prefill"])


def _shared_read_twice(text: str) -> str:
    anchor = "      - {op: add, in: [routed, shared], out: y}\n"
    assert anchor in text
    return text.replace(anchor, anchor + "      - {op: add, in: [shared, shared], out: shared_twice}\n")


def test_refused_when_the_shared_output_has_another_reader(caplog):
    spec = spec_of(FIXED_CFG, edit=_shared_read_twice)
    graphs = graphs_of(spec)
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        G = run_pipeline(graphs["decode"])
    # the shared output has a second reader when fuse_shared_experts runs (eliminate_dead drops it
    # only afterwards): the shared MLP stays a separate MLP, and the graph means what it did
    assert op_counts(G)["moe_route"] == 1
    assert {d["attrs"].get("shared_experts", 0) for _, d in G.nodes(data=True) if d["op"] == "moe_route"} == {0}
    weights = make_weights(graphs, 3)
    assert_same_step(graphs["decode"], G, weights, Step(spec, [2, 4], 2, 3), graphs["prefill"])


def test_refusal_names_the_reason():
    G = before_fuse(ir.build_graph(spec_of(FIXED_CFG, edit=_shared_read_twice), "decode"))
    after = FUSE.run(G)
    assert op_counts(after) == op_counts(G)
    assert any("the shared output" in r and "has readers besides" in r for r in after.graph["refusals"])


def test_a_ranks_graph_keeps_its_shared_mlp():
    G = ir.build_graph(spec_of(FIXED_CFG), "decode")
    G.graph["parallel"] = {"world": 2, "rank": 1}
    G = run_pipeline(G)
    assert not any(d["attrs"].get("shared_experts") for _, d in G.nodes(data=True))
    assert any(name.endswith("shared_experts.down_proj.weight") for _, d in G.nodes(data=True) if d["op"] == "linear"
               for name in d["weights"].values())


def test_idempotent():
    G = run_pipeline(v2_lite_graph("decode"))
    again = FUSE.run(G)
    assert op_counts(again) == op_counts(G) and again.graph["weights"] == G.graph["weights"]


def test_more_shared_experts_than_the_route_serves_stay_linears():
    """Nine shared experts (MAX_SHARED is 8): refused with its reason, the graph unchanged, and the
    unfused layer still computes the same step."""
    from ir.passes.fuse_shared_experts import MAX_SHARED
    cfg = {**FIXED_CFG, "n_shared_experts": MAX_SHARED + 1}
    spec = spec_of(cfg)
    G = before_fuse(ir.build_graph(spec, "decode"))
    after = FUSE.run(G)
    assert op_counts(after) == op_counts(G)
    assert any(f"{MAX_SHARED + 1} shared experts" in r for r in after.graph["refusals"])


def test_an_absurd_shared_expert_count_is_a_one_line_spec_error():
    """Each shared expert becomes a slice of every layer's stacks: the spec bounds layers x (routed +
    shared) as it bounds layers x routed, so 2**31 shared experts (a fuzzed config) is an error at
    load time, not minutes of slices (the CPU suite's config fuzz once ran out of memory there)."""
    import pytest
    from ir.errors import SpecError
    with pytest.raises(SpecError, match=r"shared experts\) = .* per-expert weight sets"):
        spec_of({**FIXED_CFG, "n_shared_experts": 2 ** 31})
