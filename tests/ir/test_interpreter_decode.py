"""The reference interpreter on the full decode path agrees with prefill: prefill prompt[:n],
then feed the remaining tokens one decode step at a time through a paged cache, and the
logits equal those of one prefill of the whole prompt, for several sequences at once.

Run on the graphs as built (generic ``mla_attention`` over the cache) and after the pass
pipeline (decode attends over the compressed cache rows with absorbed projections).
The cache starts poisoned with NaN and blocks are handed out out of order, so a read
of an unwritten row or a wrong block table shows up as NaN or as a wrong number.
"""
from __future__ import annotations

import pytest
import torch

from ir import build_graph, load_spec, run_graph, verify
from ir.config_to_spec import spec_from_config
from ir.context import StepContext

BS = 3
CONFIG = {   # V3 style: q_lora, noaux_tc routing with a correction bias, interleaved rope, YaRN
    "model_type": "deepseek_v3", "vocab_size": 53, "hidden_size": 30, "intermediate_size": 34,
    "moe_intermediate_size": 9, "num_hidden_layers": 3, "num_attention_heads": 3, "kv_lora_rank": 11,
    "q_lora_rank": 13, "qk_rope_head_dim": 4, "qk_nope_head_dim": 5, "v_head_dim": 7, "n_routed_experts": 6,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 3, "topk_group": 2,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 128,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
}


@pytest.fixture(scope="module")
def spec():
    return load_spec(spec_from_config(CONFIG, name="tiny_v3"), file="tiny_v3.yaml")


def _weights(G, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, info in sorted(G.graph["weights"].items()):
        w = torch.randn(info.shape, generator=g)
        out[name] = 1 + 0.1 * w if name.endswith("norm.weight") else 0.3 * w
    return out


def _graphs(spec, lowered: bool):
    graphs = {phase: build_graph(spec, phase) for phase in ("prefill", "decode")}
    if lowered:
        from ir.passes import run_pipeline
        graphs = {phase: run_pipeline(G) for phase, G in graphs.items()}
    for G in graphs.values():
        verify(G)
    return graphs


class PagedRun:
    """Drives the graphs the way the engine does, with hand-made block tables."""

    def __init__(self, spec, graphs, weights, tables):
        self.spec, self.graphs, self.weights, self.tables = spec, graphs, weights, tables
        num_blocks = 1 + max(b for t in tables for b in t)
        width = spec.model.cache_width
        self.cache = [torch.full((num_blocks, BS, width), float("nan")) for _ in range(spec.dims["layers"])]

    def step(self, phase, seqs, tokens, starts, ends):
        """Run tokens[s][start:end] of each sequence s; returns logits [sum(end-start), vocab]."""
        ids, positions, slots = [], [], []
        for s, a, b in zip(seqs, starts, ends):
            ids += tokens[s][a:b]
            positions += range(a, b)
            slots += [self.tables[s][p // BS] * BS + p % BS for p in range(a, b)]
        width = max(len(self.tables[s]) for s in seqs)
        ctx = StepContext(
            positions=torch.tensor(positions), query_lens=[b - a for a, b in zip(starts, ends)],
            context_lens=list(ends),
            block_tables=torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in seqs],
                                      dtype=torch.int32),
            slot_mapping=torch.tensor(slots), kv_cache=self.cache, block_size=BS)
        return run_graph(self.graphs[phase], {"ids": torch.tensor(ids)}, self.weights, ctx)["logits"].float()


@pytest.mark.parametrize("lowered", [False, True], ids=["as_built", "after_passes"])
def test_prefill_then_decode_equals_whole_prefill(spec, lowered):
    graphs = _graphs(spec, lowered)
    weights = _weights(graphs["prefill"])
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in (11, 7, 4)]
    tables = [[7, 2, 9, 0], [4, 8, 1], [6, 3]]          # out of order, interleaved between sequences
    heads = [4, 1, BS]                                  # prefill lengths: inside a block, one token, a full block

    whole = PagedRun(spec, graphs, weights, tables)
    full = whole.step("prefill", [0, 1, 2], tokens, [0, 0, 0], [len(t) for t in tokens])
    assert torch.isfinite(full).all()
    offsets = [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    want = [full[o:o + len(t)] for o, t in zip(offsets, tokens)]

    run = PagedRun(spec, graphs, weights, tables)
    got = [[] for _ in tokens]
    out = run.step("prefill", [0, 1, 2], tokens, [0, 0, 0], heads)
    start = 0
    for s, n in enumerate(heads):
        got[s].append(out[start:start + n])
        start += n
    pos = list(heads)
    steps = 0
    while True:
        active = [s for s in range(3) if pos[s] < len(tokens[s])]
        if not active:
            break
        out = run.step("decode", active, tokens, [pos[s] for s in active], [pos[s] + 1 for s in active])
        for j, s in enumerate(active):
            got[s].append(out[j:j + 1])
            pos[s] += 1
        steps += 1
    assert steps == 7
    for g_rows, w in zip(got, want):
        torch.testing.assert_close(torch.cat(g_rows), w, rtol=2e-5, atol=2e-5)
    # Both runs wrote the same rows to the same slots; nothing else was touched.
    for a, b in zip(run.cache, whole.cache):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, equal_nan=True)


def test_decode_never_reads_another_sequences_rows(spec):
    """Poison every block a sequence does not own: its decode logits do not change."""
    graphs = _graphs(spec, lowered=False)
    weights = _weights(graphs["prefill"])
    tokens = [[5, 9, 1, 7, 3], [2, 2, 8, 4, 6]]
    tables = [[0, 2], [1, 3]]
    run = PagedRun(spec, graphs, weights, tables)
    run.step("prefill", [0, 1], tokens, [0, 0], [4, 4])
    clean = run.step("decode", [0], tokens, [4], [5])
    for layer in run.cache:
        layer[[1, 3]] = 1e4                               # sequence 1's blocks
        assert torch.isnan(layer[2, 2:]).all()            # the row past its context is still poisoned
    torch.testing.assert_close(run.step("decode", [0], tokens, [4], [5]), clean, rtol=0, atol=0)
