"""The per-phase graph and its verifier: one spec gives both phase graphs, and every kind of
breakage the verifier promises to catch is caught with a message naming the node."""
from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

from ir import GraphError, PHASES, build_graph, load_spec, topo_order, verify
from ir.ops import TType, WeightInfo

SPEC = Path(__file__).resolve().parents[2] / "model_specs" / "deepseek_v2_lite.yaml"


@pytest.fixture(scope="module")
def spec():
    return load_spec(str(SPEC))


@pytest.fixture
def G(spec):
    """A fresh prefill graph (a test may break it)."""
    return build_graph(spec, "prefill")


def test_both_phases_come_from_the_same_spec(spec):
    prefill, decode = (build_graph(spec, phase) for phase in PHASES)
    for G in (prefill, decode):
        verify(G)
        assert nx.is_directed_acyclic_graph(G)
        assert G.graph["inputs"] == ["ids"] and G.graph["outputs"] == ["logits"]
    assert (prefill.graph["phase"], decode.graph["phase"]) == PHASES
    # Before the passes the two phases are the same computation; they differ only once lowered.
    assert set(prefill.nodes) == set(decode.nodes)
    assert all(prefill.nodes[n]["op"] == decode.nodes[n]["op"] for n in prefill.nodes)
    assert set(prefill.edges) == set(decode.edges)
    assert prefill.graph["weights"] == decode.graph["weights"]
    assert prefill.graph["values"] == decode.graph["values"]


def test_graph_binds_concrete_checkpoint_names(G, spec):
    layers = spec.dims["layers"]
    assert sum(1 for _, d in G.nodes(data=True) if d["op"] == "mla_attention") == layers
    assert sum(1 for _, d in G.nodes(data=True) if d["op"] == "moe_gate_up") == layers - spec.plan.first_k_dense_replace
    info = G.graph["weights"]["model.layers.3.mlp.experts.*.gate_proj.weight"]
    assert info == WeightInfo((64, 1408, 2048), False,
                              tuple(f"model.layers.3.mlp.experts.{e}.gate_proj.weight" for e in range(64)))
    assert G.graph["weights"]["model.layers.3.mlp.gate.weight"].keep_fp32
    # Each node remembers the YAML entry it came from.
    assert G.nodes["L3.mla.o"]["path"] == "blocks.mla.ops[7]"
    assert G.nodes["L3.mla.o"]["weights"] == {"kv_b": "model.layers.3.self_attn.kv_b_proj.weight"}


def test_topo_order_is_deterministic_and_follows_the_spec(spec, G):
    order = topo_order(G)
    assert order == topo_order(build_graph(spec, "prefill"))
    assert order[:3] == ["embed.x", "L0.h_attn", "L0.mla.q"]
    assert order[-2:] == ["head.h", "head.logits"]


def _expect(G, pattern):
    with pytest.raises(GraphError, match=pattern):
        verify(G)


def test_removed_edge(G):
    G.remove_edge("L2.mla.q", "L2.mla.q_nope")
    _expect(G, r"node L2\.mla\.q_nope reads 'L2\.mla\.q' from L2\.mla\.q but no edge carries it")


def test_recorded_shape_changed(G):
    G.graph["values"]["L1.mla.c_n"] = TType(("T", 511), "act")
    _expect(G, r"node L1\.mla\.c_n: value 'L1\.mla\.c_n' is recorded as act\[T, 511\] but infers to act\[T, 512\]")


def test_recorded_dtype_changed(G):
    G.graph["values"]["L1.moe_ffn.router_logits"] = TType(("T", 64), "act")
    _expect(G, r"node L1\.moe_ffn\.router_logits: value .* recorded as act\[T, 64\] but infers to f32\[T, 64\]")


def test_input_type_changed_breaks_the_reader(G):
    G.graph["values"]["L1.mla.q"] = TType(("T", 3000), "act")
    _expect(G, r"node L1\.mla\.(q|q_nope)")


def test_cycle(G):
    G.add_edge("L4.x_out", "L4.h_attn", values=["L4.x_out"])
    _expect(G, "cycle")


def test_unknown_op(G):
    G.nodes["L0.mla.c_n"]["op"] = "layer_norm"
    _expect(G, r"node L0\.mla\.c_n: unknown op 'layer_norm'")


def test_input_that_nothing_makes(G):
    G.nodes["L0.dense_ffn.a"]["inputs"] = ["L0.dense_ffn.g", "L0.dense_ffn.v"]
    _expect(G, r"node L0\.dense_ffn\.a \(silu_and_mul\) reads 'L0\.dense_ffn\.v', which nothing makes")


def test_value_made_twice(G):
    G.nodes["L0.dense_ffn.u"]["outputs"] = ["L0.dense_ffn.g"]
    _expect(G, r"value 'L0\.dense_ffn\.g' is made by both")


def test_weight_not_recorded(G):
    del G.graph["weights"]["model.layers.2.self_attn.o_proj.weight"]
    _expect(G, r"node L2\.mla\.y: weight model\.layers\.2\.self_attn\.o_proj\.weight is not recorded")


def test_weight_recorded_with_the_wrong_shape(G):
    G.graph["weights"]["model.norm.weight"] = WeightInfo((2047,))
    _expect(G, r"node head\.h: weight model\.norm\.weight recorded as \(2047,\), op expects \(2048,\)")


def test_required_weight_unbound(G):
    G.nodes["L0.mla.o"]["weights"] = {}
    _expect(G, r"node L0\.mla\.o \(mla_attention\) has no weight bound for 'kv_b'")


def test_output_never_made(G):
    G.nodes["head.logits"]["outputs"] = ["head.logits2"]
    G.graph["values"]["head.logits2"] = G.graph["values"].pop("logits")
    _expect(G, r"graph output 'logits' is never made")


def test_unknown_phase(spec):
    with pytest.raises(ValueError, match="phase must be one of"):
        build_graph(spec, "training")
