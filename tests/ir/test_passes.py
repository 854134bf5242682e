"""The pass pipeline: every pass preserves semantics, fires where it should, refuses with a reason.

Semantics are checked with the reference interpreter on random tiny DeepSeek-V2/V3
configs (Hypothesis), in float64: the logits and the KV cache after one step are the
same before and after each pass.  Structure is checked on the shipped V2-Lite spec.
"""
from __future__ import annotations

import logging
from collections import Counter
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ir
from ir.config_to_spec import spec_from_config
from ir.context import StepContext
from ir.errors import GraphError
from ir.passes import PIPELINE, Pass, run_pipeline
from ir.passes.rewrite import NewOp, RewriteError, copy_graph, replace
from runtime.model_loader import random_weights, weight_specs

V2_LITE = "model_specs/deepseek_v2_lite.yaml"
PASSES = {p.name: p for p in PIPELINE}
RTOL = 1e-9

# The op each pass consumes: where it is present before the pass, there is less of it after.
ANCHOR = {
    "split_rope": "rope",
    "fuse_kv_norm_rope_cache": "cache_write",
    "lower_mla_prefill": "mla_attention",
    "lower_mla_decode": "mla_attention",
    "fuse_q_rope_into_query": "mla_q_absorb",
    "fuse_router": "moe_topk",
    "fuse_moe_silu": "moe_gate_up",
    "fuse_combine_shared_residual": "moe_combine",
    "fuse_shared_experts": "silu_and_mul",
    "fuse_expert_ffn": "moe_down",
    "fuse_add_rms_norm": "rms_norm",
    "fuse_sibling_linears": "linear",
    "fuse_gate_up_silu": "silu_and_mul",
}
# Where the anchor op also lives elsewhere, the op whose presence means the pass has work to do
# (fuse_shared_experts takes a MoE layer's shared SwiGLU; a dense layer's stays).
WORK = {"fuse_shared_experts": "moe_combine_residual"}


# ---- tiny random models ------------------------------------------------------------------------

@st.composite
def hf_configs(draw):
    """An HF-like DeepSeek config.json with tiny dims and every variant the spec writer knows."""
    v3 = draw(st.booleans())
    groups = draw(st.sampled_from([1, 2]))
    per_group = draw(st.integers(2 if v3 else 1, 3))
    experts = groups * per_group
    topk_groups = draw(st.integers(1, groups))
    method = "noaux_tc" if v3 else draw(st.sampled_from(["greedy", "group_limited_greedy"]))
    max_k = experts if method == "greedy" else topk_groups * per_group
    layers = draw(st.integers(1, 3))
    cfg = {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "hidden_size": draw(st.sampled_from([8, 12])),
        "num_attention_heads": draw(st.integers(1, 3)),
        "q_lora_rank": draw(st.sampled_from([None, 6])),
        "kv_lora_rank": draw(st.sampled_from([4, 6, 8])),
        "qk_nope_head_dim": draw(st.sampled_from([2, 4])),
        "qk_rope_head_dim": draw(st.sampled_from([2, 4])),
        "v_head_dim": draw(st.sampled_from([2, 3, 4])),
        "intermediate_size": 10,
        "moe_intermediate_size": 6,
        "n_routed_experts": experts,
        "n_shared_experts": draw(st.integers(1, 2)),
        "num_experts_per_tok": draw(st.integers(1, max_k)),
        "n_group": groups,
        "topk_group": topk_groups,
        "topk_method": method,
        "scoring_func": "softmax",
        "norm_topk_prob": draw(st.booleans()),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
        "vocab_size": 50,
        "num_hidden_layers": layers,
        "first_k_dense_replace": draw(st.integers(0, 2)),
        "moe_layer_freq": 1,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": draw(st.booleans()),
    }
    if v3:
        cfg["rope_interleave"] = draw(st.booleans())
    if draw(st.booleans()):
        cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                               "beta_fast": 32, "beta_slow": 1, "mscale": draw(st.sampled_from([1.0, 0.707])),
                               "mscale_all_dim": draw(st.sampled_from([0.0, 0.707]))}
    return cfg


@st.composite
def cases(draw):
    """(config, seed, prompt lengths, block size)."""
    return (draw(hf_configs()), draw(st.integers(0, 2**31 - 1)),
            draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)), draw(st.integers(2, 4)))


FIXED_CFG = {  # one deterministic tiny V2 for the structural tests
    "model_type": "deepseek_v2", "hidden_size": 8, "num_attention_heads": 2, "q_lora_rank": None, "kv_lora_rank": 6,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3, "intermediate_size": 10,
    "moe_intermediate_size": 6, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy", "vocab_size": 50, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
}


def spec_of(cfg: dict, edit=None) -> ir.Spec:
    text = spec_from_config(cfg, name="tiny")
    if edit is not None:
        text = edit(text)
    return ir.load_spec(text, file="t.yaml")


def graphs_of(spec) -> dict:
    return {phase: ir.build_graph(spec, phase) for phase in ir.PHASES}


def make_weights(graphs, seed: int) -> dict:
    """Random weights under every name the graphs or their optimised forms bind: a stack that
    fuse_shared_experts binds is drawn from the same checkpoint tensors as the unfused weights."""
    specs = {**weight_specs(graphs), **weight_specs({ph: run_pipeline(G) for ph, G in graphs.items()})}
    w = random_weights(specs, dtype=torch.float64, device="cpu", seed=seed, std=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, t in w.items():  # norms away from 1, so a mis-bound norm weight shows
        if t.dim() == 1 and "norm" in name:
            w[name] = 1 + 0.2 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    return w


class Step:
    """Random inputs for one packed prefill of ``lens`` and the decode step after it."""

    def __init__(self, spec, lens, block_size, seed):
        gen = torch.Generator().manual_seed(seed)
        d = spec.dims
        self.lens, self.bs = lens, block_size
        need = [-(-(n + 1) // block_size) for n in lens]          # room for the decode token too
        num_blocks = sum(need) + 2
        perm = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous, shuffled blocks
        self.tables, start = [], 0
        for n in need:
            self.tables.append(perm[start:start + n])
            start += n
        width = max(need)
        self.table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        # Random, never zero: a slot read before it is written would change the result.
        self.cache = [torch.randn(num_blocks, block_size, spec.model.cache_width, generator=gen, dtype=torch.float64)
                      for _ in range(d["layers"])]
        self.prefill_ids = torch.randint(0, d["vocab"], (sum(lens),), generator=gen)
        self.decode_ids = torch.randint(0, d["vocab"], (len(lens),), generator=gen)

    def slot(self, seq, pos):
        return self.tables[seq][pos // self.bs] * self.bs + pos % self.bs

    def prefill_ctx(self, cache):
        positions = [p for n in self.lens for p in range(n)]
        slots = [self.slot(b, p) for b, n in enumerate(self.lens) for p in range(n)]
        return StepContext(
            positions=torch.tensor(positions), query_lens=list(self.lens), context_lens=list(self.lens),
            block_tables=self.table_tensor, slot_mapping=torch.tensor(slots), kv_cache=cache, block_size=self.bs)

    def decode_ctx(self, cache):
        return StepContext(
            positions=torch.tensor(self.lens), query_lens=[1] * len(self.lens), context_lens=[n + 1 for n in self.lens],
            block_tables=self.table_tensor, kv_cache=cache, block_size=self.bs,
            slot_mapping=torch.tensor([self.slot(b, n) for b, n in enumerate(self.lens)]))


def run_step(G, weights, step: Step, prefill_graph=None):
    """Run G (prefill, or decode after ``prefill_graph`` filled the cache) on a fresh cache: (logits, cache)."""
    cache = [c.clone() for c in step.cache]
    if G.graph["phase"] == "prefill":
        out = ir.run_graph(G, {"ids": step.prefill_ids}, weights, step.prefill_ctx(cache))
    else:
        ir.run_graph(prefill_graph, {"ids": step.prefill_ids}, weights, step.prefill_ctx(cache))
        out = ir.run_graph(G, {"ids": step.decode_ids}, weights, step.decode_ctx(cache))
    return out["logits"], cache


def assert_same(actual, expected, what):
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


def assert_same_step(before, after, weights, step, prefill_graph):
    logits_b, cache_b = run_step(before, weights, step, prefill_graph)
    logits_a, cache_a = run_step(after, weights, step, prefill_graph)
    assert_same(logits_a, logits_b, "logits")
    for layer, (a, b) in enumerate(zip(cache_a, cache_b)):
        assert_same(a, b, f"KV cache of layer {layer}")


def op_counts(G) -> Counter:
    return Counter(d["op"] for _, d in G.nodes(data=True))


def snapshot(G):
    """Everything a pass could change, in comparable form."""
    nodes = {n: {k: v for k, v in sorted(d.items())} for n, d in G.nodes(data=True)}
    edges = {(u, v): sorted(d["values"]) for u, v, d in G.edges(data=True)}
    graph = {k: v for k, v in G.graph.items() if k != "model"}
    return repr(sorted(nodes.items())), repr(sorted(edges.items())), repr(sorted(graph.items(), key=lambda kv: kv[0]))


@lru_cache(maxsize=None)
def v2_lite_graph(phase: str):
    return ir.build_graph(ir.load_spec(V2_LITE), phase)


# ---- semantics: the interpreter agrees before and after each pass --------------------------------

PASS_PHASES = [(p.name, phase) for p in PIPELINE for phase in p.phases]
HYPO = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@pytest.mark.parametrize("name, phase", PASS_PHASES, ids=[f"{n}-{ph}" for n, ph in PASS_PHASES])
@HYPO
@given(case=cases())
def test_pass_preserves_semantics(name, phase, case):
    cfg, seed, lens, block_size = case
    spec = spec_of(cfg)
    graphs = graphs_of(spec)
    weights = make_weights(graphs, seed)
    index = [p.name for p in PIPELINE].index(name)
    before = run_pipeline(graphs[phase], PIPELINE[:index])
    after = PASSES[name].run(before)
    ir.verify(after)
    anchor = ANCHOR.get(name)
    skip = name == "fuse_q_rope_into_query" and phase == "prefill"
    if anchor and op_counts(before)[WORK.get(name, anchor)] and not skip:
        assert op_counts(after)[anchor] < op_counts(before)[anchor], f"{name} did not fire"
    assert_same_step(before, after, weights, Step(spec, lens, block_size, seed), graphs["prefill"])


@pytest.mark.parametrize("phase", ir.PHASES)
@HYPO
@given(case=cases())
def test_pipeline_preserves_semantics(phase, case):
    cfg, seed, lens, block_size = case
    spec = spec_of(cfg)
    graphs = graphs_of(spec)
    weights = make_weights(graphs, seed)
    after = run_pipeline(graphs[phase])
    # The optimised decode graph also runs after the optimised prefill graph.
    prefill = run_pipeline(graphs["prefill"]) if phase == "decode" else None
    step = Step(spec, lens, block_size, seed)
    logits_b, cache_b = run_step(graphs[phase], weights, step, graphs["prefill"])
    logits_a, cache_a = run_step(after, weights, step, prefill)
    assert_same(logits_a, logits_b, "logits")
    for a, b in zip(cache_a, cache_b):
        assert_same(a, b, "KV cache")


# ---- structure on the shipped V2-Lite spec -------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, phase", [(n, ph) for n, ph in PASS_PHASES if n in ANCHOR and
                                         not (n == "fuse_q_rope_into_query" and ph == "prefill")])
def test_pass_fires_on_v2_lite(name, phase):
    index = [p.name for p in PIPELINE].index(name)
    before = run_pipeline(v2_lite_graph(phase), PIPELINE[:index])
    after = PASSES[name].run(before)
    ir.verify(after)
    assert op_counts(before)[ANCHOR[name]] > 0
    assert op_counts(after)[ANCHOR[name]] < op_counts(before)[ANCHOR[name]]


def test_pipeline_on_v2_lite_decode():
    G = run_pipeline(v2_lite_graph("decode"))
    ops = op_counts(G)
    layers, moe = 27, 26
    for gone in ("mla_attention", "rope", "rope_q", "rope_k", "cache_write", "mla_q_absorb", "moe_topk", "moe_align",
                 "moe_gate_up", "moe_combine", "add", "mla_prefill_attention"):
        assert ops[gone] == 0, gone
    # the query and the cache write of each layer share one op (and, at T <= 16, one launch)
    assert ops["mla_decode_prologue"] == ops["mla_decode_attention"] == layers
    assert ops["mla_kv_cache_write"] == ops["mla_decode_query"] == 0
    assert ops["mla_v_up"] == layers
    assert ops["moe_route"] == ops["moe_expert_ffn"] == ops["moe_combine_residual_rms_norm"] == moe
    # decode runs each layer's expert FFN (gate/up, SwiGLU, down) as one op (fuse_expert_ffn)
    assert ops["moe_gate_up_silu"] == ops["moe_down"] == 0
    # the shared experts are two more experts of every token (fuse_shared_experts): no separate MLP
    for op in ("moe_route", "moe_combine_residual_rms_norm"):
        assert {d["attrs"]["shared_experts"] for _, d in G.nodes(data=True) if d["op"] == op} == {2}
    assert {d["attrs"]["num_experts"] for _, d in G.nodes(data=True) if d["op"] == "moe_expert_ffn"} == {66}
    assert not any("shared" in name for _, d in G.nodes(data=True) if d["op"] in ("linear", "gate_up_silu")
                   for name in d["weights"].values())
    assert ops["fused_add_rms_norm"] == 28   # attention residual of 27 layers + the dense layer's FFN residual
    # every MoE layer's output meets a norm (the next layer's input norm, the last the final norm): the
    # only plain rms_norm left is layer 0's, after the embedding
    assert ops["moe_combine_residual"] == 0 and ops["rms_norm"] == 1
    # Decode reads the compressed 576-wide rows: its query is C+R wide per head.
    q = next(d for _, d in G.nodes(data=True) if d["op"] == "mla_decode_prologue")["outputs"][0]
    assert G.graph["values"][q].shape[1:] == (16, 512 + 64)


def test_pipeline_on_v2_lite_prefill():
    G = run_pipeline(v2_lite_graph("prefill"))
    ops = op_counts(G)
    for gone in ("mla_attention", "rope", "cache_write", "moe_topk", "mla_decode_attention", "mla_q_absorb"):
        assert ops[gone] == 0, gone
    assert ops["mla_prefill_attention"] == ops["mla_kv_cache_write"] == ops["rope_q"] == 27
    # The cache write stays; its state is read by the layer's context gather alone (each sequence's
    # rows: the prefix earlier steps cached, chunked prefill, and this step's), and by decode later.
    # The gathered rows' latent part is decompressed by kv_b and attended with keys=context.
    assert ops["mla_gather_context"] == 27
    for nid, d in G.nodes(data=True):
        if d["op"] == "mla_kv_cache_write":
            readers = [s for s in G.successors(nid) if d["outputs"][2] in G.edges[nid, s]["values"]]
            assert [G.nodes[r]["op"] for r in readers] == ["mla_gather_context"]
            (rows,) = G.nodes[readers[0]]["outputs"]
            assert G.graph["values"][rows].shape == ("TK", 512 + 64)
            (split,) = G.successors(readers[0])
            c_ctx, k_ctx = G.nodes[split]["outputs"]
            (linear,) = [n for n in G.successors(split) if G.nodes[n]["op"] == "linear"]
            (attn,) = G.successors(linear)
            assert G.nodes[attn]["op"] == "mla_prefill_attention" and G.nodes[attn]["attrs"]["keys"] == "context"
            assert G.nodes[attn]["inputs"][2:] == [G.nodes[linear]["outputs"][0], k_ctx]
            assert G.nodes[linear]["inputs"] == [c_ctx]


def checkpoint_reads(G) -> dict:
    """checkpoint tensor -> (its shape, fp32) as the graph's bound weights read it (a stack's parts,
    a WeightSlice's whole tensor)."""
    out = {}
    for name, info in G.graph["weights"].items():
        for part in info.parts if info.parts is not None else (name,):
            if isinstance(part, ir.ops.WeightSlice):
                out[part.name] = (tuple(part.stored), info.keep_fp32)
            else:
                out[part] = (tuple(info.shape[1:]) if info.parts is not None else tuple(info.shape), info.keep_fp32)
    return out


def test_pipeline_keeps_every_weight_and_its_precision():
    for phase in ir.PHASES:
        G0 = v2_lite_graph(phase)
        G = run_pipeline(G0)
        assert checkpoint_reads(G) == checkpoint_reads(G0)
        route = next(d for _, d in G.nodes(data=True) if d["op"] == "moe_route")
        assert G.graph["weights"][route["weights"]["gate"]].keep_fp32


def test_rope_q_refusal_in_prefill_is_logged_and_recorded(caplog):
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        G = run_pipeline(v2_lite_graph("prefill"))
    expected = "cannot fuse L0.mla.q_rot (rope_q) with L0.mla.o (mla_prefill_attention): the prefill kernel"
    assert expected in caplog.text
    assert any(r.startswith(expected) for r in G.graph["refusals"])
    assert not any("mla_prefill" in r for r in run_pipeline(v2_lite_graph("decode")).graph.get("refusals", []))


@pytest.mark.slow
def test_pipeline_is_idempotent():
    for phase in ir.PHASES:
        once = run_pipeline(v2_lite_graph(phase))
        assert snapshot(run_pipeline(once)) == snapshot(once)


@pytest.mark.slow
def test_passes_do_not_mutate_their_input():
    for phase in ir.PHASES:
        G = v2_lite_graph(phase)
        for p in PIPELINE:
            if phase not in p.phases:
                continue
            before = snapshot(G)
            H = p.run(G)
            assert snapshot(G) == before, p.name
            G = H


def test_phase_specific_lowerings_reject_the_other_phase():
    with pytest.raises(ValueError, match="prefill"):
        PASSES["lower_mla_prefill"].run(v2_lite_graph("decode"))
    with pytest.raises(ValueError, match="decode"):
        PASSES["lower_mla_decode"].run(v2_lite_graph("prefill"))


def test_kv_cache_fusion_refuses_the_joint_rope(caplog):
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        G = PASSES["fuse_kv_norm_rope_cache"].run(v2_lite_graph("decode"))
    assert op_counts(G)["cache_write"] == 27
    assert "k_rot is made by rope, not rope_k (run split_rope first)" in caplog.text
    assert len(G.graph["refusals"]) == 27


def _extra_readers(text: str) -> str:
    """Give router logits, an expert gate and the MoE output one more (unused) reader each."""
    anchor = "      - {op: add, in: [routed, shared], out: y}\n"
    assert anchor in text
    extra = ("      - {op: add, in: [router_logits, router_logits], out: logits_twice}\n"
             "      - {op: add, in: [eg, eg], out: eg_twice}\n"
             "      - {op: add, in: [y, y], out: y_twice}\n")
    return text.replace(anchor, anchor + extra)


def test_fusions_refused_when_intermediates_have_other_readers(caplog):
    spec = spec_of(FIXED_CFG, edit=_extra_readers)
    graphs = graphs_of(spec)
    for phase in ir.PHASES:
        with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
            G = run_pipeline(graphs[phase])
        ops = op_counts(G)
        assert ops["moe_topk"] == ops["moe_gate_up"] == ops["moe_combine"] == 1   # the one MoE layer, unfused
        assert ops["moe_route"] == ops["moe_gate_up_silu"] == ops["moe_combine_residual"] == 0
        refusals = "\n".join(G.graph["refusals"])
        assert "the router logits are also read by L1.moe_ffn.logits_twice" in refusals
        assert "gate and up must be read only by one silu_and_mul" in refusals
        assert "y = routed + shared must be read only by the residual add" in refusals
        assert "cannot fuse L1.moe_ffn.router_logits (linear) with L1.moe_ffn.topk_ids (moe_topk)" in caplog.text
        # eliminate_dead dropped the extra readers afterwards; nothing else changed meaning.
        assert not any(n.endswith("_twice") for n in G)
    weights = make_weights(graphs, 7)
    step = Step(spec, [3, 5], 2, 7)
    assert_same_step(graphs["decode"], run_pipeline(graphs["decode"]), weights, step, graphs["prefill"])


def test_sibling_linears_fuse_into_one_multi_linear_on_v2_lite():
    """q + kv_a off the attention norm (27 layers) become a multi_linear, in execution order; the
    dense FFN's gate + up (layer 0) off the FFN norm become one too, and then, with their
    silu_and_mul, a gate_up_silu; the other linears stay.  (The shared experts' gate + up joined
    the routed experts first: fuse_shared_experts.)"""
    for phase in ir.PHASES:
        G = run_pipeline(v2_lite_graph(phase))
        multi = {n: d for n, d in G.nodes(data=True) if d["op"] == "multi_linear"}
        swiglu = {n: d for n, d in G.nodes(data=True) if d["op"] == "gate_up_silu"}
        assert len(multi) == 27 and len(swiglu) == 1
        assert not any(d["op"] == "silu_and_mul" for _, d in G.nodes(data=True))
        q = multi["L3.mla.q"]
        assert q["inputs"] == ["L3.h_attn"] and q["outputs"] == ["L3.mla.q", "L3.mla.ckv"]
        assert q["attrs"]["out_dims"] == [3072, 576]
        assert q["weights"] == {"weight0": "model.layers.3.self_attn.q_proj.weight",
                                "weight1": "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"}
        assert swiglu["L0.dense_ffn.g"]["outputs"] == ["L0.dense_ffn.a"]
        assert swiglu["L0.dense_ffn.g"]["passes"]["L0.dense_ffn.u"] == ["fuse_sibling_linears", "fuse_gate_up_silu"]
        # o_proj, the dense down projection, the head (and prefill's kv_b) read values of their own
        left = sorted({n.split(".", 1)[-1] for n, d in G.nodes(data=True) if d["op"] == "linear"})
        assert left == (["dense_ffn.y", "logits", "mla.kv", "mla.y"] if phase == "prefill"
                        else ["dense_ffn.y", "logits", "mla.y"])
        assert any("fuse_sibling_linears" in p for p in q["passes"]["L3.mla.q"])


def _more_siblings(text: str) -> str:
    """Give the MoE's FFN input an fp32 linear and five more act linears (the shared experts' gate
    and up join the routed experts first: fuse_shared_experts), each read by an add (until
    eliminate_dead drops them all)."""
    anchor = "      - {op: add, in: [routed, shared], out: y}\n"
    assert anchor in text
    extra = '      - {op: linear, in: x, weight: "model.layers.{layer}.extra_f32.weight", out_dim: 3, precision: fp32, out: e32}\n'
    extra += "".join(f'      - {{op: linear, in: x, weight: "model.layers.{{layer}}.extra{i}.weight", out_dim: {i + 2}, '
                     f'out: e{i}}}\n' for i in range(5))
    extra += "".join(f"      - {{op: add, in: [{e}, {e}], out: {e}_twice}}\n" for e in ("e32", "e0", "e1", "e2", "e3", "e4"))
    return text.replace(anchor, anchor + extra)


def test_sibling_linear_refusals_are_logged_with_their_reason(caplog):
    spec = spec_of(FIXED_CFG, edit=_more_siblings)
    graphs = graphs_of(spec)
    index = [p.name for p in PIPELINE].index("fuse_sibling_linears")
    before = run_pipeline(graphs["decode"], PIPELINE[:index])
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        G = PASSES["fuse_sibling_linears"].run(before)
    ir.verify(G)
    refusals = "\n".join(G.graph["refusals"])
    assert "L1.moe_ffn.e32 is an fp32 linear" in refusals
    assert ("cannot fuse L1.moe_ffn.e0 (linear) with L1.moe_ffn.e4 (linear): a multi_linear takes at most 4 "
            "weights; L1.moe_ffn.e4 start another") in refusals
    assert "cannot fuse L1.moe_ffn.e32 (linear) with L1.moe_ffn.e0 (linear)" in caplog.text
    m = G.nodes["L1.moe_ffn.e0"]
    assert m["op"] == "multi_linear"
    assert m["outputs"] == ["L1.moe_ffn.e0", "L1.moe_ffn.e1", "L1.moe_ffn.e2", "L1.moe_ffn.e3"]
    assert G.nodes["L1.moe_ffn.e4"]["op"] == G.nodes["L1.moe_ffn.e32"]["op"] == "linear"
    weights = make_weights(graphs, 3)
    assert_same_step(graphs["decode"], run_pipeline(graphs["decode"]), weights, Step(spec, [2, 4], 2, 3),
                     graphs["prefill"])


def _dead_linear(text: str) -> str:
    anchor = "      - {op: add, in: [routed, shared], out: y}\n"
    return text.replace(anchor, anchor + '      - {op: linear, in: x, weight: "model.layers.{layer}.unused.weight", '
                                         'out_dim: 3, out: unused}\n')


def test_eliminate_dead_drops_unread_ops_and_their_weights():
    spec = spec_of(FIXED_CFG, edit=_dead_linear)
    G = run_pipeline(ir.build_graph(spec, "prefill"), PIPELINE[:-1])
    assert "L1.moe_ffn.unused" in G and "model.layers.1.unused.weight" in G.graph["weights"]
    H = PASSES["eliminate_dead"].run(G)
    ir.verify(H)
    assert "L1.moe_ffn.unused" not in H
    assert "model.layers.1.unused.weight" not in H.graph["weights"]
    assert "L1.moe_ffn.unused" not in H.graph["values"]
    # Only the unread linear went: the cache writes, whose state prefill no longer reads, stay.
    assert len(H) == len(G) - 1
    assert op_counts(H)["mla_kv_cache_write"] == 2


def test_run_pipeline_verifies_after_every_pass():
    def break_graph(G):
        G = copy_graph(G)
        G.nodes["L0.mla.o"]["inputs"][0] = "nowhere"
        return G

    with pytest.raises(GraphError, match="after pass break_graph"):
        run_pipeline(ir.build_graph(spec_of(FIXED_CFG), "decode"), [Pass(break_graph, ir.PHASES)])


def test_replace_leaves_the_graph_untouched_when_it_refuses():
    G = copy_graph(ir.build_graph(spec_of(FIXED_CFG), "decode"))
    before = snapshot(G)
    with pytest.raises(RewriteError, match="also read by"):
        # L0.mla.q_nope makes q_nope and q_pe; dropping it while mla_attention reads q_nope must fail.
        replace(G, ["L0.mla.q_nope"], [NewOp("rope_q", ["L0.mla.q_rot"], ["L0.mla.q_pe"])])
    with pytest.raises(RewriteError, match="nothing would make"):
        replace(G, ["L0.mla.o"], [NewOp("mla_v_up", ["missing"], ["L0.mla.o"])])
    assert snapshot(G) == before
