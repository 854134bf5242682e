"""cuda_graphs.PrefillGraphs' policy on the CPU (the capture itself is tested on the GPU,
tests/gpu/test_e2e_cuda.py): a key's first step runs eagerly, its second captures, later ones
replay with the step's data refilled (lengths included: the same sizes split otherwise share a
graph); too many tokens never capture; a full set drops its least recently used graph only once idle."""
from __future__ import annotations

import torch

import runtime.cuda_graphs as cg
from ir.context import StepContext


class _Backend:
    top_k = 2

    def _sizes(self, ctx):
        T = ctx.num_tokens
        return {"T": T, "B": ctx.num_seqs, "NP": T * self.top_k, "MAXQ": max(ctx.query_lens),
                "MAXCTX": max(ctx.context_lens), "TK": sum(ctx.context_lens), "W": int(ctx.block_tables.shape[1])}


class _Graph:
    def __init__(self, out, inputs):
        self.out, self.inputs, self.replays = out, inputs, 0

    def replay(self):   # "the step": logits are the ids, so a replay shows what was refilled
        self.replays += 1
        self.out.copy_(self.inputs["ids"].float()[:, None])


def _ctx(lens, cache, rows=None):
    T = sum(lens)
    return StepContext(positions=torch.arange(T), query_lens=list(lens), context_lens=list(lens),
                       block_tables=torch.zeros(len(lens), 4, dtype=torch.int32),
                       slot_mapping=torch.arange(T), kv_cache=cache, block_size=16, logit_rows=rows)


def _graphs(monkeypatch):
    pg = cg.PrefillGraphs(_Backend())
    captured = []

    def capture(phase, ids, ctx):
        inputs = {"ids": ids.clone(), "positions": ctx.positions.clone(), "slot_mapping": ctx.slot_mapping.clone(),
                  "block_tables": ctx.block_tables.clone(),
                  "context_lens": torch.tensor(ctx.context_lens, dtype=torch.int32),
                  "query_start": torch.tensor(cg._starts(ctx), dtype=torch.int32),
                  "key_start": torch.tensor(ctx.key_starts(), dtype=torch.int32)}
        out = torch.zeros(len(ids), 1)
        cap = cg._Captured(_Graph(out, inputs), inputs, out)
        captured.append(cap)
        return cap
    monkeypatch.setattr(pg, "_capture", capture)
    return pg, captured


def test_first_sighting_eager_second_captures_then_replays_with_the_new_data(monkeypatch):
    pg, captured = _graphs(monkeypatch)
    cache = [torch.zeros(1)]
    ids = torch.tensor([5, 6, 7, 8, 9])
    assert pg.run("prefill", ids, _ctx([2, 3], cache)) is None and not captured
    out = pg.run("prefill", ids, _ctx([2, 3], cache))
    assert len(captured) == 1 and torch.equal(out[:, 0], ids.float())
    other = torch.tensor([1, 2, 3, 4, 0])
    out2 = pg.run("prefill", other, _ctx([2, 3], cache))
    assert len(captured) == 1 and captured[0].graph.replays == 2
    assert torch.equal(out2[:, 0], other.float()), "the replay read the step's own ids"
    assert torch.equal(out[:, 0], ids.float()), "a returned tensor is the caller's (a clone)"
    # the same sizes (T, B, the longest prompt, ...) split otherwise replay too: the lengths are data
    ctx = _ctx([3, 2], cache)
    assert pg.run("prefill", ids, ctx) is not None and captured[0].graph.replays == 3
    assert captured[0].inputs["query_start"].tolist() == [0, 3, 5]
    # other sizes, other logit rows and another cache are other keys
    assert pg.run("prefill", ids, _ctx([1, 4], cache)) is None
    assert pg.run("prefill", ids, _ctx([2, 3], cache, rows=torch.tensor([1, 4]))) is None
    assert pg.run("prefill", ids, _ctx([2, 3], [torch.zeros(1)])) is None
    assert len(captured) == 1


def test_too_many_tokens_never_capture_and_few_graphs_are_kept(monkeypatch):
    pg, captured = _graphs(monkeypatch)
    cache = [torch.zeros(1)]
    big = torch.zeros(cg.PREFILL_GRAPH_MAX_TOKENS + 1, dtype=torch.int64)
    for _ in range(3):
        assert pg.run("prefill", big, _ctx([len(big)], cache)) is None
    assert not captured and not pg.seen
    for n in range(1, cg.PREFILL_GRAPHS_KEPT + 2):
        ids = torch.arange(n)
        pg.run("prefill", ids, _ctx([n], cache))
        pg.run("prefill", ids, _ctx([n], cache))
    # full, and every kept graph ran within PREFILL_GRAPH_IDLE_STEPS: the new shape stays eager
    assert len(captured) == cg.PREFILL_GRAPHS_KEPT and len(pg.graphs) == cg.PREFILL_GRAPHS_KEPT
    for _ in range(cg.PREFILL_GRAPH_IDLE_STEPS):
        pg.run("prefill", torch.arange(2), _ctx([2], cache))          # only shape 2 keeps running
    n = cg.PREFILL_GRAPHS_KEPT + 1
    assert pg.run("prefill", torch.arange(n), _ctx([n], cache)) is not None
    assert len(captured) == cg.PREFILL_GRAPHS_KEPT + 1 and len(pg.graphs) == cg.PREFILL_GRAPHS_KEPT
    assert pg.key("prefill", torch.arange(1), _ctx([1], cache)) not in pg.graphs, "the idle oldest went"
    assert pg.key("prefill", torch.arange(2), _ctx([2], cache)) in pg.graphs


def test_a_capture_that_runs_out_of_memory_leaves_its_key_to_eager_steps(monkeypatch):
    pg = cg.PrefillGraphs(_Backend())
    calls = []

    def capture(phase, ids, ctx):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(pg, "_capture", capture)
    cache = [torch.zeros(1)]
    ids = torch.arange(4)
    for _ in range(4):
        assert pg.run("prefill", ids, _ctx([4], cache)) is None
    assert len(calls) == 1 and not pg.graphs, "one attempt, then eager steps"
