"""shard_for_rank + insert_all_reduce: every rank's graph together computes what the whole graph does.

The rank graphs run in one process, one thread per rank, with a stand-in all_reduce that sums
the ranks' values (in rank order) at a barrier; the logits and KV cache of a prefill and of the
decode step after it must equal the unsharded graph's (float64; the router and the combine are
float32 in both, so the tolerance is float32's).  World 1 leaves the graph as it is.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_passes import FIXED_CFG, HYPO, Step, graphs_of, make_weights, spec_of

import ir
from ir.ops.collective import use_reducer
from ir.parallel import ParallelError, check_parallel
from ir.passes import run_pipeline, shard_for_rank

RTOL = 1e-6


class FakeGroup:
    """world threads' all_reduce: each puts its value in, all read the rank-ordered sum."""

    def __init__(self, world: int):
        self.slots = [None] * world
        self.barrier = threading.Barrier(world)
        self.calls = [0] * world

    def reducer(self, rank: int):
        def reduce(x):
            self.slots[rank] = x
            self.calls[rank] += 1
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()
            return total
        return reduce


def rank_graphs(spec, world: int, rank: int) -> dict:
    out = {}
    for phase in ir.PHASES:
        G = ir.build_graph(spec, phase)
        G.graph["parallel"] = {"world": world, "rank": rank}
        out[phase] = run_pipeline(G)
    return out


def slice_weights(G, full: dict) -> dict:
    """The rank's tensors, cut from the whole ones by the Shards the graph binds."""
    out = {}
    for name, info in G.graph["weights"].items():
        t, shard = full[name], G.graph.get("shards", {}).get(name)
        if shard is not None:
            t = t[:, shard.start:shard.stop] if shard.kind == "cols" else t[shard.start:shard.stop]
        assert tuple(t.shape) == tuple(info.shape), name
        out[name] = t
    return out


def run_prefill_then_decode(graphs, weights, step, reducer=None):
    cache = [c.clone() for c in step.cache]
    with use_reducer(reducer) if reducer else _nothing():
        pre = ir.run_graph(graphs["prefill"], {"ids": step.prefill_ids}, weights, step.prefill_ctx(cache))["logits"]
        dec = ir.run_graph(graphs["decode"], {"ids": step.decode_ids}, weights, step.decode_ctx(cache))["logits"]
    return pre, dec, cache


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_ranks(spec, world, full_weights, step):
    group = FakeGroup(world)
    results, errors = [None] * world, []

    def one(rank):
        try:
            graphs = rank_graphs(spec, world, rank)
            w = {**slice_weights(graphs["prefill"], full_weights), **slice_weights(graphs["decode"], full_weights)}
            results[rank] = run_prefill_then_decode(graphs, w, step, group.reducer(rank))
        except BaseException as exc:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, group


def assert_close(actual, expected, what):
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


@st.composite
def parallel_cases(draw):
    """(config, world, seed, prompt lengths, block size) with heads, FFN widths and experts dividing by world."""
    world = draw(st.sampled_from([2, 4]))
    v3 = draw(st.booleans())
    groups = draw(st.sampled_from([1, 2]))
    experts = math.lcm(groups, world) * draw(st.integers(1, 2))
    per_group = experts // groups
    if v3 and per_group < 2:
        experts, per_group = experts * 2, per_group * 2
    topk_groups = draw(st.integers(1, groups))
    method = "noaux_tc" if v3 else draw(st.sampled_from(["greedy", "group_limited_greedy"]))
    max_k = experts if method == "greedy" else topk_groups * per_group
    cfg = {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2", "hidden_size": draw(st.sampled_from([8, 12])),
        "num_attention_heads": world * draw(st.integers(1, 2)), "q_lora_rank": draw(st.sampled_from([None, 6])),
        "kv_lora_rank": draw(st.sampled_from([4, 6])), "qk_nope_head_dim": draw(st.sampled_from([2, 4])),
        "qk_rope_head_dim": 2, "v_head_dim": draw(st.sampled_from([2, 3])),
        "intermediate_size": world * draw(st.integers(1, 3)), "moe_intermediate_size": world,
        "n_routed_experts": experts, "n_shared_experts": draw(st.integers(1, 2)),
        "num_experts_per_tok": draw(st.integers(1, min(max_k, 3))), "n_group": groups, "topk_group": topk_groups,
        "topk_method": method, "scoring_func": "sigmoid" if v3 else "softmax", "norm_topk_prob": draw(st.booleans()),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])), "vocab_size": 50,
        "num_hidden_layers": draw(st.integers(1, 3)), "first_k_dense_replace": draw(st.integers(0, 2)),
        "moe_layer_freq": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    return (cfg, world, draw(st.integers(0, 2**31 - 1)), draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)),
            draw(st.integers(2, 4)))


@pytest.mark.slow
@HYPO
@given(case=parallel_cases())
def test_rank_graphs_together_equal_the_whole_graph(case):
    cfg, world, seed, lens, block_size = case
    spec = spec_of(cfg)
    check_parallel(spec, world)
    graphs = graphs_of(spec)
    weights = make_weights(graphs, seed)
    step = Step(spec, lens, block_size, seed)
    want = run_prefill_then_decode({p: run_pipeline(g) for p, g in graphs.items()}, weights, step)
    results, group = run_ranks(spec, world, weights, step)
    for rank, (pre, dec, cache) in enumerate(results):
        assert_close(pre, want[0], f"rank {rank} prefill logits")
        assert_close(dec, want[1], f"rank {rank} decode logits")
        for layer, (a, b) in enumerate(zip(cache, want[2])):   # the latent cache is replicated, whole
            assert_close(a, b, f"rank {rank} KV cache of layer {layer}")
    assert len(set(group.calls)) == 1 and group.calls[0] == 2 * 2 * spec.dims["layers"]   # 2 a layer, 2 phases


def four_head_cfg():
    return dict(FIXED_CFG, num_attention_heads=4, n_routed_experts=4, intermediate_size=12, n_shared_experts=2)


def test_one_all_reduce_after_attention_and_one_after_the_ffn(caplog):
    spec = spec_of(four_head_cfg())
    with caplog.at_level(logging.INFO, logger="dsgraph.passes"):
        graphs = rank_graphs(spec, 2, 1)
    for phase, G in graphs.items():
        ops = Counter(d["op"] for _, d in G.nodes(data=True))
        assert ops["all_reduce"] == 2 * spec.dims["layers"] and ops["moe_local_experts"] == 1
        reduced = sorted(d["inputs"][0] for _, d in G.nodes(data=True) if d["op"] == "all_reduce")
        assert reduced == ["L0.dense_ffn.y", "L0.mla.y", "L1.mla.y", "L1.moe_ffn.y"]   # routed + shared: one
        local = next(d for _, d in G.nodes(data=True) if d["op"] == "moe_local_experts")
        assert local["attrs"] == {"first": 2, "count": 2}
        assert G.graph["model"].dims["heads"] == 2 and "partial" not in G.graph
    assert "y = routed + shared must be read only by the residual add; read by ['L1.moe_ffn.y_sum']" in caplog.text
    assert "no moe_align reads the expert ids" in caplog.text
    w = graphs["decode"].graph["weights"]
    assert w["model.layers.1.mlp.experts.*.up_proj.weight"].parts == (
        "model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight")
    assert w["model.layers.0.self_attn.o_proj.weight"].shape == (8, 2 * 3)
    assert w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (6 + 2, 8)   # replicated
    # sibling linears fuse at the rank's shapes: its heads' q rows beside the whole kv_a, its shared columns
    for G in graphs.values():
        q, sg = G.nodes["L0.mla.q"], G.nodes["L1.moe_ffn.sg"]
        assert q["op"] == "multi_linear" and sg["op"] == "gate_up_silu"
        assert q["attrs"]["out_dims"] == [2 * (4 + 2), 6 + 2] and sg["attrs"]["out_dim"] == 6


def test_world_one_leaves_the_graph_alone():
    G = ir.build_graph(spec_of(FIXED_CFG), "decode")
    assert shard_for_rank(G) is G
    G.graph["parallel"] = {"world": 1, "rank": 0}
    assert shard_for_rank(G) is G


def test_rank_counts_that_do_not_divide_are_refused():
    spec = spec_of(FIXED_CFG)   # 2 heads, 4 experts, intermediate 10
    with pytest.raises(ParallelError, match="heads .* = 2 does not divide by 4 ranks"):
        check_parallel(spec, 4)
    G = ir.build_graph(spec, "prefill")
    G.graph["parallel"] = {"world": 4, "rank": 0}
    with pytest.raises(ParallelError, match="heads = 2 does not divide by 4 ranks"):
        shard_for_rank(G)
