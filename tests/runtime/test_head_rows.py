"""Generation runs the head (lm_head) only on each sequence's last token (StepContext.logit_rows):
the same tokens and logits as computing every row and picking the last ones, on the reference
backend (the CUDA backend's step code: tests/runtime/test_cuda_backend_plumbing.py)."""
from __future__ import annotations

import torch

import ir.interpret
from runtime import SamplingParams
from runtime.engine import Engine
from tiny_engine import make_engine, prompts


def _generate(engine, ps, *, last_only: bool, monkeypatch):
    """generate() as it runs, or with every row's logits computed and the last ones picked."""
    step = Engine._step

    def every_row(self, phase, seqs, last_only=False):
        logits = step(self, phase, seqs)
        if not last_only:
            return logits
        ends = torch.tensor([len(s.tokens) for s in seqs]).cumsum(0) - 1   # one prefill from 0 each
        return logits[ends]
    if not last_only:
        monkeypatch.setattr(Engine, "_step", every_row)
    try:
        return engine.generate(ps, SamplingParams(max_new_tokens=5, return_logits=True, ignore_eos=True))
    finally:
        monkeypatch.setattr(Engine, "_step", step)


def test_the_head_sees_one_row_per_sequence_and_the_tokens_do_not_change(monkeypatch):
    engine = make_engine(block_size=4)
    ps = prompts([7, 1, 12, 5])
    rows_seen = []
    original = ir.interpret.logit_rows_only

    def spy(op, node, ins, w, ctx, rows):
        ins, outs = original(op, node, ins, w, ctx, rows)
        rows_seen.append((op, ins[0].shape[0], outs[0].shape[0]))
        return ins, outs
    monkeypatch.setattr(ir.interpret, "logit_rows_only", spy)
    fast = _generate(engine, ps, last_only=True, monkeypatch=monkeypatch)
    assert rows_seen and all(op == "linear" and n_in == n_out for op, n_in, n_out in rows_seen)
    assert rows_seen[0][1] == len(ps)                     # the first prefill: one head row per prompt
    rows_seen.clear()
    full = _generate(engine, ps, last_only=False, monkeypatch=monkeypatch)
    assert not rows_seen
    for a, b in zip(fast, full):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-6, atol=1e-6)
