"""Mistakes a user can make through the Engine API: each one is a clear InputError naming the
problem, raised before any cache block is taken, and no later request sees a difference."""
from __future__ import annotations

import pytest
import torch

from runtime import DsgraphError, InputError, SamplingParams
from tiny_engine import VOCAB, make_engine, prompts

GOOD = prompts([5, 3, 8], seed=21)
PARAMS = [SamplingParams(max_new_tokens=n) for n in (6, 9, 4)]


@pytest.fixture(scope="module")
def engine():
    return make_engine(block_size=4, num_blocks=24)


@pytest.fixture(scope="module")
def before(engine):
    """What the engine answers before any bad request."""
    return [o.token_ids for o in engine.generate(GOOD, PARAMS)], engine.logits(GOOD)


def _unchanged(engine, before):
    tokens, logits = before
    assert engine.tables.free_blocks == 24
    assert [o.token_ids for o in engine.generate(GOOD, PARAMS)] == tokens
    for got, want in zip(engine.logits(GOOD), logits):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


BAD_PROMPTS = {
    "negative id": ([[1, 2], [3, -1, 4]], r"prompt 1, position 1: token id -1 is out of range \[0, 61\)"),
    "id == vocab": ([[1, VOCAB]], r"prompt 0, position 1: token id 61 is out of range \[0, 61\)"),
    "huge id": ([[10**12]], r"token id 1000000000000 is out of range"),
    "float id": ([[1, 2.0]], r"prompt 0, position 1: token ids are integers, got 2\.0"),
    "bool id": ([[True]], r"token ids are integers, got True"),
    "empty prompt": ([[1, 2], []], r"prompt 1 is empty"),
    "no prompts": ([], r"non-empty list"),
    "flat list": ([1, 2, 3], r"flat list.*\[\[\.\.\.\]\]"),
    "string": ("hello", r"list of token-id lists"),
    "prompt not a list": ([[1, 2], 7], r"prompt 1 must be a list of token ids, got int"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
@pytest.mark.parametrize("api", ["generate", "logits"])
def test_bad_prompt(engine, before, case, api):
    bad, message = BAD_PROMPTS[case]
    with pytest.raises(InputError, match=message):
        getattr(engine, api)(bad)
    _unchanged(engine, before)


def test_input_error_is_a_value_error_and_a_dsgraph_error():
    assert issubclass(InputError, ValueError) and issubclass(InputError, DsgraphError)


def test_prompt_longer_than_max_seq_len():
    engine = make_engine(block_size=4, max_seq_len=12)
    (long_prompt,) = prompts([13], seed=22)
    for api in (engine.logits, engine.generate):
        with pytest.raises(InputError, match=r"prompt 1 has 13 tokens; the engine holds at most 12"):
            api([GOOD[0], long_prompt])
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_generation_stops_at_max_seq_len():
    engine = make_engine(block_size=4, max_seq_len=12)
    (p,) = prompts([10], seed=23)
    (out,) = engine.generate([p], SamplingParams(max_new_tokens=50))
    assert len(out.token_ids) == 2 and out.finish_reason == "length"
    full = make_engine(block_size=4).generate([p], SamplingParams(max_new_tokens=2))[0].token_ids
    assert out.token_ids == full


def test_max_seq_len_beyond_the_model():
    with pytest.raises(InputError, match=r"max_seq_len=129 exceeds the model's max_positions=128"):
        make_engine(max_seq_len=129)


@pytest.mark.parametrize("kwargs, message", [
    (dict(backend="tpu"), r"backend must be one of reference, cuda, got 'tpu'"),
    (dict(block_size=0), r"block_size must be >= 1"),
    (dict(num_blocks=0), r"num_blocks must be >= 1"),
])
def test_bad_engine_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        make_engine(**kwargs)


BAD_PARAMS = [
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer >= 1, got 2\.5"),
    (dict(temperature=-0.5), r"temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0"),
    (dict(top_k=-1), r"top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(seed=-3), r"seed must be None or an integer"),
    (dict(stop_token_ids=["eos"]), r"stop_token_ids must hold non-negative integers, got 'eos'"),
    (dict(stop_token_ids=[-2]), r"stop_token_ids must hold non-negative integers, got -2"),
]


@pytest.mark.parametrize("kwargs, message", BAD_PARAMS)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InputError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3", True])
def test_bad_decode_after(engine, before, bad):
    with pytest.raises(InputError, match=r"decode_after must be None or an integer >= 1"):
        engine.logits(GOOD, decode_after=bad)
    _unchanged(engine, before)


def test_decode_after_agrees_with_prefill(engine, before):
    for got, want in zip(engine.logits(GOOD, decode_after=2), before[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_params_that_do_not_fit_the_prompts(engine, before):
    with pytest.raises(InputError, match=r"got 2 SamplingParams for 3 prompts"):
        engine.generate(GOOD, PARAMS[:2])
    with pytest.raises(InputError, match=r"params must be SamplingParams, got dict"):
        engine.generate(GOOD, [PARAMS[0], {"max_new_tokens": 3}, PARAMS[2]])
    _unchanged(engine, before)


def test_tensor_prompts_are_accepted(engine, before):
    padded = torch.tensor([GOOD[0][:3], GOOD[1][:3]])
    got = engine.logits(padded)
    want = engine.logits([GOOD[0][:3], GOOD[1][:3]])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    _unchanged(engine, before)


def test_sampled_generation_is_reproducible_and_private(engine, before):
    """Seeded sampling repeats exactly, whatever else is in the batch, and leaves greedy alone."""
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    (a,) = engine.generate([GOOD[0]], sampled)
    mixed = engine.generate([GOOD[1], GOOD[0], GOOD[2]], [PARAMS[1], sampled, PARAMS[2]])
    assert mixed[1].token_ids == a.token_ids
    assert all(0 <= t < VOCAB for t in a.token_ids)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [before[0][1], before[0][2]]
    _unchanged(engine, before)
