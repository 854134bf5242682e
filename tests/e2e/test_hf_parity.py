"""Parity with transformers: tiny random DeepSeek-V2-Lite / V2 / V3 models saved with
``save_pretrained``, loaded back through ``Engine.from_pretrained`` with the spec that
``--from-config`` writes, run on the reference backend in fp32.

Covered per model: packed prefill at every position (lengths 1 and around a block
boundary), paged decode across block boundaries against transformers' own KV cache
(free-running greedy and teacher-forced), greedy generation token for token, and YaRN
at positions far from 0 where the mscale² softmax factor and the cos/sin attention
factor are visible.  Two guards show the comparisons are not vacuous: the same
checkpoint under a spec with one YaRN or routing detail wrong misses by far.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/e2e is on sys.path: pytest's rootdir-relative import)
from ir import load_spec  # noqa: E402
from ir.config_to_spec import spec_from_config  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from runtime.weights import load_config  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
BS = hf_tiny.BLOCK_SIZE
MODELS = list(hf_tiny.CONFIGS)


# v2_lite in the quick tier (`-m "not slow"`), the other models in the full suite
@pytest.fixture(scope="module", params=[m if m == "v2_lite" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS])
def tiny(request, tmp_path_factory):
    """(name, model dir, transformers model, our engine) for one tiny model; built once per module."""
    name = request.param
    path = hf_tiny.build(name, tmp_path_factory.mktemp(name))
    hf = hf_tiny.load_reference(path)
    engine = Engine.from_pretrained(path, backend="reference", device="cpu", dtype=torch.float32, block_size=BS)
    return name, path, hf, engine


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_loader_writes_the_spec_from_config(tiny):
    name, path, hf, engine = tiny
    assert engine.spec.text == spec_from_config(load_config(path))
    assert engine.spec.model.model_type == hf.config.model_type
    layers = hf.config.num_hidden_layers
    moe = [engine.spec.plan.kind(i)[0] == "moe" for i in range(layers)]
    assert moe == [i >= hf.config.first_k_dense_replace for i in range(layers)]


def test_softmax_scale_matches_transformers(tiny):
    _, _, hf, engine = tiny
    assert engine.spec.model.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)


def test_prefill_packed_batch_matches_every_position(tiny):
    _, _, hf, engine = tiny
    prompts = _prompts([1, BS - 1, BS, BS + 1, 2, 3 * BS + 1], seed=1)
    ours = engine.logits(prompts)
    assert [o.shape for o in ours] == [(len(p), hf_tiny.VOCAB) for p in prompts]
    for p, o in zip(prompts, ours):
        torch.testing.assert_close(o, hf_tiny.hf_logits(hf, p), **TOL)


def test_paged_decode_matches_transformers_cache(tiny):
    """Batched decode of prompts just under, on and over a block boundary (and a 1-token one):
    10 steps each, so every sequence crosses at least two more boundaries; logits of every
    step match transformers' cached decode and the greedy tokens are the same."""
    _, _, hf, engine = tiny
    prompts = _prompts([BS - 1, BS, BS + 1, 1], seed=2)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, return_logits=True))
    for p, out in zip(prompts, outs):
        tokens, logits = hf_tiny.hf_generate(hf, p, 10)
        assert out.logits.shape == (10, hf_tiny.VOCAB)
        torch.testing.assert_close(out.logits, logits, **TOL)
        assert out.token_ids == tokens
        assert out.finish_reason == "length"


def test_teacher_forced_paged_decode_matches_every_position(tiny):
    """Prefill 3 tokens, then feed the rest one decode step at a time: the paged decode
    path (absorbed projections over compressed rows) gives transformers' logits at
    every position, in a batch whose sequences leave at different steps."""
    _, _, hf, engine = tiny
    prompts = _prompts([4 * BS + 2, 9, BS + 1, 1], seed=5)
    ours = engine.logits(prompts, decode_after=BS - 1)
    for p, o in zip(prompts, ours):
        torch.testing.assert_close(o, hf_tiny.hf_logits(hf, p), **TOL)


def test_greedy_generate_matches_transformers_generate(tiny):
    """Different max_new_tokens per prompt in one call: each gets exactly transformers' tokens."""
    _, _, hf, engine = tiny
    prompts = _prompts([2, 7, BS * 2, 11], seed=3)
    lengths = [9, 12, 8, 10]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    for p, n, out in zip(prompts, lengths, outs):
        tokens, _ = hf_tiny.hf_generate(hf, p, n)
        assert out.token_ids == tokens
        assert out.logits is None


def test_yarn_far_from_position_zero(tiny):
    """At position 0 every key is the query's own, so the softmax scale cannot show; at
    positions ~100 it does. Prefill the last positions of a 100-token prompt, then decode
    8 more steps (position 100 opens a fresh block)."""
    _, _, hf, engine = tiny
    (prompt,) = _prompts([100], seed=4)
    (ours,) = engine.logits([prompt])
    torch.testing.assert_close(ours[-12:], hf_tiny.hf_logits(hf, prompt)[-12:], **TOL)
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=8, return_logits=True))
    tokens, logits = hf_tiny.hf_generate(hf, prompt, 8)
    torch.testing.assert_close(out.logits, logits, **TOL)
    assert out.token_ids == tokens


# Each tweak is a spec line that a plausible bug would get wrong; the YaRN test above must notice it.
YARN_TWEAKS = {
    "v2_lite": ("mscale_all_dim: 0.707", "mscale_all_dim: 0.0"),   # drops the mscale² softmax factor
    "v2": ("mscale: 1.0", "mscale: 0.707"),                       # drops the cos/sin attention factor
    "v3": ("factor: 4.0", "factor: 1.0"),                         # no YaRN interpolation at all
    "v3_odd": ("mscale_all_dim: 0.707", "mscale_all_dim: 1.0"),   # the mscale² softmax factor off by 41%
}


def test_yarn_parity_is_sensitive_to_the_scaling(tiny):
    """Guard against a vacuous YaRN test: the same checkpoint under a spec with one YaRN
    value wrong must miss transformers by far more than the tolerance at late positions."""
    name, path, hf, _ = tiny
    old, new = YARN_TWEAKS[name]
    text = spec_from_config(load_config(path))
    assert text.count(f"    {old}\n") == 1
    spec = load_spec(text.replace(f"    {old}\n", f"    {new}\n"), file="tweaked.yaml")
    engine = Engine.from_pretrained(path, spec=spec, backend="reference", device="cpu", dtype=torch.float32,
                                    block_size=BS)
    (prompt,) = _prompts([100], seed=4)
    (ours,) = engine.logits([prompt])
    ref = hf_tiny.hf_logits(hf, prompt)
    assert (ours[0] - ref[0]).abs().max() < 1e-4  # one key at position 0: no score scaling can show
    assert (ours[-12:] - ref[-12:]).abs().max() > 1e-2


# A routing detail each tiny model exercises; getting it wrong must show in the logits.
ROUTING_TWEAKS = {
    "v2_lite": ("scoring: softmax", "scoring: sigmoid"),
    "v2": ("method: group_limited_greedy", "method: greedy"),   # the group limit must bite
    "v3": None,                                                   # the correction bias must bite (zeroed below)
    "v3_odd": ("norm_topk_prob: true", "norm_topk_prob: false"),  # the top-k weights' normalisation
}


def test_routing_parity_is_sensitive(tiny):
    """Guard against routing that is trivially right: with the router variant or the
    e_score_correction_bias wrong, logits miss transformers by far more than the tolerance."""
    name, path, hf, _ = tiny
    text = spec_from_config(load_config(path))
    tweak = ROUTING_TWEAKS[name]
    if tweak is not None:
        assert text.count(tweak[0]) == 1
        text = text.replace(*tweak)
    engine = Engine.from_pretrained(path, spec=load_spec(text, file="tweaked.yaml"), backend="reference",
                                    device="cpu", dtype=torch.float32, block_size=BS)
    if tweak is None:
        biases = [w for n, w in engine.backend.weights.items() if n.endswith("e_score_correction_bias")]
        assert len(biases) == 2 and all((b != 0).all() and (b < 0).any() for b in biases)
        for b in biases:
            b.zero_()
    (prompt,) = _prompts([40], seed=9)
    assert (engine.logits([prompt])[0] - hf_tiny.hf_logits(hf, prompt)).abs().max() > 0.1
