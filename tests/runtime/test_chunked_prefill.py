"""Chunked prefill (the reference backend here; the cuda backend's plumbing in
test_cuda_backend_plumbing.py, its kernels in tests/gpu): with max_num_batched_tokens a long prompt runs in
chunks that attend to the rows earlier chunks cached (the lowered prefill attention reading the
paged prefix), and running sequences decode in the same steps.  The logits equal one unchunked
prefill (fp32, 1e-5) and greedy generation picks the same tokens, at chunk sizes 1,
block_size - 1, block_size, block_size + 1 and ragged ones."""
from __future__ import annotations

import pytest
import torch

from runtime import SamplingParams
from runtime.errors import InputError
from runtime.scheduler import chunk_tokens
from tiny_engine import make_engine, prompts

BLOCK = 4
CAPS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 7, 11]


def test_chunks_take_in_order_until_the_budget_is_spent():
    assert chunk_tokens([5, 3, 2], 6) == [5, 1, 0]
    assert chunk_tokens([5, 3, 2], 100) == [5, 3, 2]
    assert chunk_tokens([5, 3], 0) == [0, 0]
    assert chunk_tokens([], 4) == []


@pytest.mark.parametrize("cap", CAPS)
def test_chunked_logits_equal_one_prefill(cap):
    ps = prompts([13, 1, 9, 4], seed=cap)
    ref = make_engine().logits(ps)
    engine = make_engine(max_num_batched_tokens=cap)
    steps = []
    forward = engine.backend.forward
    engine.backend.forward = lambda phase, ids, ctx: steps.append(int(ids.shape[0])) or forward(phase, ids, ctx)
    got = engine.logits(ps)
    assert max(steps) <= cap and len(steps) >= -(-27 // cap)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", [1, BLOCK + 1, 7])
def test_chunked_prefill_then_decode_equals_the_unchunked_run(cap):
    ps = prompts([11, 6], seed=3)
    for a, b in zip(make_engine(max_num_batched_tokens=cap).logits(ps, decode_after=8),
                    make_engine().logits(ps, decode_after=8)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", CAPS)
def test_greedy_generation_with_decode_mixed_into_prefill_chunks_picks_the_same_tokens(cap):
    """Prompts of different lengths: the short ones finish prefilling and decode in the steps that
    still carry the long one's chunks (one step, phase prefill, decode tokens and a chunk)."""
    ps = prompts([3, 17, 2, 9], seed=11)
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True, return_logits=True)
    ref = make_engine().generate(ps, sp)
    engine = make_engine(max_num_batched_tokens=cap)
    mixed = []
    forward = engine.backend.forward

    def spy(phase, ids, ctx):
        mixed.append(phase == "prefill" and 1 in ctx.query_lens and max(ctx.query_lens) > 1)
        return forward(phase, ids, ctx)
    engine.backend.forward = spy
    got = engine.generate(ps, sp)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    if cap > 2:
        assert any(mixed), "no step mixed decode tokens with a prefill chunk"
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_a_bad_cap_is_one_line_and_the_cuda_backend_chunks_too():
    with pytest.raises(InputError, match="max_num_batched_tokens must be >= 1"):
        make_engine(max_num_batched_tokens=0)
    from runtime.engine import check_chunking
    for bad in (0, -3, 2.5, "many"):
        with pytest.raises(InputError, match="max_num_batched_tokens") as info:
            check_chunking(bad)
        assert "\n" not in str(info.value)
    assert check_chunking(None) is None and check_chunking(8) == 8


def test_a_step_over_a_cached_prefix_gathers_each_sequences_context():
    """The lowered prefill attends to every sequence's whole context: mla_gather_context's rows
    are packed at key_starts (TK of them: the context lengths' sum, T for whole prompts), and the
    step context says how many of each sequence's rows were cached before it."""
    from ir.context import StepContext
    ctx = StepContext(positions=torch.tensor([4, 5, 6, 9]), query_lens=[3, 1], context_lens=[7, 10],
                      block_tables=torch.zeros(2, 3, dtype=torch.int32), slot_mapping=torch.arange(4),
                      kv_cache=[], block_size=BLOCK)
    assert ctx.prefix_lens() == [4, 9] and ctx.key_starts() == [0, 7, 17]


def test_the_constructors_pass_the_cap_on():
    from codegen.paths import MODEL_SPECS_DIR
    from runtime import Engine
    engine = Engine.from_spec(str(MODEL_SPECS_DIR / "deepseek_tiny.yaml"), max_num_batched_tokens=5, num_blocks=16)
    assert engine.max_num_batched_tokens == 5
    ps = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    for a, b in zip(engine.logits(ps), Engine.from_spec(str(MODEL_SPECS_DIR / "deepseek_tiny.yaml"),
                                                        num_blocks=16).logits(ps)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_reference_attention_over_a_prefix_equals_the_whole_prompts_rows():
    """mla_prefill_attention with keys=context (a chunk's queries over the sequence's context rows,
    positions from the prefix on) gives the chunk's rows of keys=step over the whole prompt, float64;
    a causal bound shifted by one key is caught (the kernels' reference must be strict)."""
    from ir.graph import Node
    from ir.ops import OPS
    from ir.context import StepContext
    from tiny_engine import compiled
    m = compiled()[0].spec.model
    d = m.dims
    H, N, R, V = d["heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    g = torch.Generator().manual_seed(3)
    lens, prefix = [9, 14], [0, 6]        # sequence 1: a chunk of 8 behind 6 cached rows
    q_nope, q_rot = torch.randn(23, H, N, generator=g).double(), torch.randn(23, H, R, generator=g).double()
    kv, k_rot = torch.randn(23, H * (N + V), generator=g).double(), torch.randn(23, R, generator=g).double()
    op = OPS["mla_prefill_attention"]

    def run(keys, rows, query_lens, context_lens, positions, ins):
        ctx = StepContext(positions=torch.tensor(positions), query_lens=query_lens, context_lens=context_lens,
                          block_tables=torch.zeros(len(query_lens), 1, dtype=torch.int32),
                          slot_mapping=torch.zeros(rows, dtype=torch.int64), kv_cache=[], block_size=BLOCK)
        node = Node(op="mla_prefill_attention", attrs={"keys": keys}, weights={}, layer=0, model=m)
        return op.run(node, ins, {}, ctx)[0]
    whole = run("step", 23, lens, lens, [*range(9), *range(14)], [q_nope, q_rot, kv, k_rot])
    q = slice(9 + prefix[1], 23)            # the chunk's queries: sequence 0 whole, sequence 1 from row 6
    rows = torch.cat([torch.arange(9), torch.arange(9, 23)])
    chunk = run("context", 17, [9, 8], [9, 14], [*range(9), *range(6, 14)],
                [torch.cat([q_nope[:9], q_nope[q]]), torch.cat([q_rot[:9], q_rot[q]]), kv[rows], k_rot[rows]])
    torch.testing.assert_close(chunk, torch.cat([whole[:9], whole[q]]), rtol=1e-12, atol=1e-12)
    shifted = run("context", 17, [9, 8], [9, 14], [*range(9), *range(7, 15)],
                  [torch.cat([q_nope[:9], q_nope[q]]), torch.cat([q_rot[:9], q_rot[q]]), kv[rows], k_rot[rows]])
    assert not torch.allclose(shifted[9:], whole[q], rtol=1e-2, atol=1e-2)
