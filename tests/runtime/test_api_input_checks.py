"""The Python API's checks on what a user passes: engine arguments refused before anything is compiled,
read or allocated; a request that can never fit the cache refused before anything runs, naming its
prompt index; NaN logits reported instead of sampled; every value the API takes checked."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime import CacheFullError, Engine, InputError, SamplingParams
from runtime import engine as engine_mod
from runtime.errors import NonFiniteError
from runtime.model_loader import checkpoint_tensors, weight_specs
from runtime.sampling import NOT_FINITE, make_generator, sample_next
from tiny_engine import CONFIG, VOCAB, compiled, make_engine, prompts

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "model_specs" / "deepseek_tiny.yaml")
BS = 4


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if the spec would be compiled or any weight drawn or read."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled, drawn or read before the arguments were checked")
    for name in ("compile_graphs", "random_weights", "load_model_weights", "load_config"):
        monkeypatch.setattr(engine_mod, name, refuse)


# -- engine arguments: one InputError line, before anything is built -------------------------------

BAD_ENGINE_ARGS = [
    (dict(max_num_seqs=0), r"max_num_seqs must be >= 1 \(a whole number of sequences run together\), got 0"),
    (dict(max_num_seqs=-1), r"max_num_seqs must be >= 1 .*got -1"),
    (dict(max_num_seqs=2.0), r"max_num_seqs must be >= 1 .*got 2\.0"),
    (dict(block_size=2.5), r"block_size must be >= 1 \(a whole number of tokens per cache block\), got 2\.5"),
    (dict(block_size="16"), r"block_size must be >= 1 .*got '16'"),
    (dict(block_size=True), r"block_size must be >= 1 .*got True"),
    (dict(num_blocks=-3), r"num_blocks must be >= 1 .*got -3"),
    (dict(num_blocks=1.5), r"num_blocks must be >= 1 .*got 1\.5"),
    (dict(max_seq_len=0), r"max_seq_len must be >= 1 \(a whole number of tokens; None: the smaller of 8192 and "
                          r"the model's max_positions\), got 0"),
    (dict(max_seq_len=1.5), r"max_seq_len must be >= 1 .*got 1\.5"),
    (dict(max_seq_len=-5), r"max_seq_len must be >= 1 .*got -5"),
    (dict(seed="a"), r"seed \(of the random weights\) must be an integer >= 0, got 'a'"),
    (dict(seed=-1), r"seed \(of the random weights\) must be an integer >= 0, got -1"),
    (dict(device="meta"), r"device='meta' is not one dsgraph runs on; use cpu, cuda or cuda:N"),
    (dict(device=""), r"device '' is not a torch device .*; use cpu, cuda or cuda:N"),
    (dict(dtype=torch.int32), r"backend='reference' computes in float32, bfloat16, float16, float64, got dtype=int32"),
    (dict(dtype="int8"), r"dtype must be a torch dtype or one of float32, fp32, .*got 'int8'"),
    (dict(dtype=["bf16"]), r"dtype must be a torch dtype or one of .*got \['bf16'\]"),
    (dict(eos_token_ids=[-1]), r"eos_token_ids must hold non-negative integers, got -1"),
]


@pytest.mark.parametrize("kwargs, message", BAD_ENGINE_ARGS, ids=[str(k) for k, _ in BAD_ENGINE_ARGS])
def test_bad_engine_arguments_are_one_line_before_anything_is_built(kwargs, message, nothing_built):
    with pytest.raises(InputError, match=message) as info:
        Engine.from_spec(TINY, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [(k, m) for k, m in BAD_ENGINE_ARGS if "seed" not in k])
def test_the_checkpoint_constructor_checks_the_same(kwargs, message, tmp_path, nothing_built):
    with pytest.raises(InputError, match=message):
        Engine.from_pretrained(tmp_path, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=0), dict(max_num_seqs=-1), dict(max_seq_len=0),
                                    dict(block_size=2.5), dict(dtype=torch.int32), dict(device="meta")])
def test_the_engine_itself_checks_the_same(kwargs):
    with pytest.raises(InputError):
        make_engine(**kwargs)


def test_an_unknown_keyword_fails_before_anything_is_built(tmp_path, nothing_built):
    with pytest.raises(TypeError, match=r"Engine.from_spec\(\) got an unexpected keyword argument 'foo'"):
        Engine.from_spec(TINY, foo=1)
    with pytest.raises(TypeError, match=r"Engine.from_pretrained\(\) got an unexpected keyword argument 'backend_impl'"):
        Engine.from_pretrained(tmp_path, backend_impl=object())


def test_tuning_is_checked_before_anything_is_built(tmp_path, nothing_built):
    """`tuning` (the kernels' Tuning where the engine compiles the spec): a bad knob is one line, and
    a bundle keeps the tuning it was compiled with."""
    from codegen.tuning import TuningError
    with pytest.raises(TuningError, match=r"unknown tuning knob 'moe.expert_ffn_uptoo' \(did you mean"):
        Engine.from_spec(TINY, tuning=["moe.expert_ffn_uptoo=128"])
    with pytest.raises(InputError, match="a bundle keeps the tuning it was compiled with"):
        Engine.from_spec(None, bundle=str(tmp_path), tuning=["moe.expert_ffn_upto=128"])


def test_bad_checkpoint_arguments(nothing_built, tmp_path):
    with pytest.raises(InputError, match=r"model_dir must be a checkpoint directory .*got None"):
        Engine.from_pretrained(None)
    with pytest.raises(InputError, match=r"progress must be None, True, False or a callable .*got 5"):
        Engine.from_pretrained(tmp_path, progress=5)


def test_none_means_the_default_and_numpy_integers_count():
    engine = make_engine(block_size=np.int64(8), max_seq_len=None, max_num_seqs=np.int32(2), num_blocks=np.int64(5))
    assert (engine.block_size, engine.max_num_seqs, engine.tables.allocator.num_blocks) == (8, 2, 5)
    assert engine.max_seq_len == 128          # the tiny model's max_positions, below the 8192 default
    assert type(engine.block_size) is int


def test_each_backend_names_the_dtypes_it_computes_in():
    assert engine_mod._as_dtype("fp64") is torch.float64          # the reference backend's ground truth
    with pytest.raises(InputError, match=r"backend='cuda' computes in bfloat16, float16, float32, got dtype=float64 "
                                         r"\(float64 runs on backend='reference'\)"):
        engine_mod._as_dtype(torch.float64, "cuda")


def test_a_float64_reference_engine_runs():
    engine = make_engine(dtype=torch.float64)
    (out,) = engine.generate(prompts([3], seed=1), SamplingParams(max_new_tokens=2))
    assert len(out.token_ids) == 2


def _write_checkpoint(model_dir: Path, poison: str | None = None) -> Path:
    """The tiny model as a Hugging Face checkpoint (config.json + safetensors); `poison`: a tensor
    given one NaN."""
    from safetensors.torch import save_file
    model, weights = compiled()
    tensors = {k: t.clone().contiguous() for k, t in checkpoint_tensors(weight_specs(model.graphs), weights).items()}
    if poison is not None:
        tensors[poison].view(-1)[3] = float("nan")
    model_dir.mkdir()
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    return model_dir


def test_progress_false_is_quiet(tmp_path):
    calls = []
    model_dir = _write_checkpoint(tmp_path / "ck")
    for progress in (False, lambda done, total: calls.append(done)):
        engine = Engine.from_pretrained(model_dir, progress=progress, block_size=BS)
        assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids
    assert calls and calls[0] == 0


# -- a request that can never fit the cache: refused up front, by prompt index ---------------------------

def test_a_request_that_can_never_fit_is_refused_before_anything_runs(monkeypatch):
    engine = make_engine(block_size=BS, num_blocks=3)                      # 12 token slots in all
    engine.logits([[1, 2]])                                                # internal ids move on
    steps = []
    original = engine._step
    monkeypatch.setattr(engine, "_step", lambda *a, **k: steps.append(a[0]) or original(*a, **k))
    with pytest.raises(CacheFullError, match=r"^prompt 1 needs 24 tokens of KV cache \(5 prompt \+ 20 new tokens, "
                                             r"less the last, never cached\) but the whole cache holds 12 "
                                             r"\(num_blocks=3 x block_size=4\); raise num_blocks or lower "
                                             r"max_new_tokens$") as info:
        engine.generate([[1, 2], [1] * 5], [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=20)])
    assert (info.value.needed, info.value.free) == (6, 3)
    assert steps == [] and engine.tables.free_blocks == 3
    with pytest.raises(CacheFullError, match=r"^prompt 0 needs 13 tokens of KV cache \(its length\) but the whole "
                                             r"cache holds 12"):
        engine.logits([[1] * 13])
    assert steps == [] and engine.tables.free_blocks == 3


def test_a_request_that_fills_the_whole_cache_exactly_runs():
    engine = make_engine(block_size=BS, num_blocks=3)
    (p,) = prompts([5], seed=3)
    (out,) = engine.generate([p], SamplingParams(max_new_tokens=8, ignore_eos=True))   # 5 + 8 - 1 = 12 rows
    assert len(out.token_ids) == 8
    assert out.token_ids == make_engine(block_size=BS).generate([p], SamplingParams(max_new_tokens=8))[0].token_ids


def test_max_seq_len_caps_what_a_request_needs():
    engine = make_engine(block_size=BS, num_blocks=3, max_seq_len=12)
    (out,) = engine.generate(prompts([10], seed=4), SamplingParams(max_new_tokens=50))   # 10 + 2 - 1 rows
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


@pytest.mark.parametrize("seed", range(3))
def test_requests_that_each_fit_alone_all_finish(seed):
    """The biggest request fills the whole cache: preemption must still finish every one, with no
    CacheFullError mid-run."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 6))
    ps = prompts([int(rng.integers(1, 9)) for _ in range(n)], seed=50 + seed)
    params = [SamplingParams(max_new_tokens=int(rng.integers(1, 10))) for _ in range(n)]
    blocks = max(-(-(len(p) + sp.max_new_tokens - 1) // BS) for p, sp in zip(ps, params))
    engine = make_engine(block_size=BS, num_blocks=blocks, max_num_seqs=int(rng.integers(1, 5)))
    outs = engine.generate(ps, params)
    assert all(1 <= len(o.token_ids) <= sp.max_new_tokens for o, sp in zip(outs, params))
    assert engine.tables.free_blocks == blocks


# -- NaN and inf in the logits: one error, not token 0 ----------------------------------------------------

def test_sample_next_flags_rows_that_are_not_finite():
    logits = torch.randn(5, 10)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3] = float("-inf")
    logits[4, :4] = float("-inf")                   # a few -inf: a masked vocabulary, still finite
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1)
    for p in (greedy, sampled):
        gens = [None if p.greedy else make_generator(1, "cpu") for _ in range(5)]
        out = sample_next(logits, [p] * 5, gens)
        assert out[1] == out[2] == out[3] == NOT_FINITE and out[0] >= 0 and out[4] >= 4


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=4),
                                    SamplingParams(max_new_tokens=4, temperature=0.8, seed=3)])
def test_a_nan_weight_is_one_error_not_token_zero(tmp_path, params):
    engine = Engine.from_pretrained(_write_checkpoint(tmp_path / "ck", poison="model.layers.0.self_attn.o_proj.weight"),
                                    block_size=BS)
    with pytest.raises(NonFiniteError, match=r"^prompt 0, step 1 \(step 1 is the prefill\): the logits to sample "
                                             r"from hold NaN or inf; the weights or the computation produced them"):
        engine.generate([[1, 2, 3]], params)
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_a_nan_mid_run_names_its_prompt_and_step(monkeypatch):
    engine = make_engine(block_size=BS)
    forward = engine.backend.forward
    decodes = []

    def poisoned(phase, ids, ctx):
        out = forward(phase, ids, ctx)
        if phase == "decode":
            decodes.append(1)
            if len(decodes) == 2:            # the second decode step: each prompt's third new token
                out = out.clone()
                out[1, 5] = float("nan")
        return out
    monkeypatch.setattr(engine.backend, "forward", poisoned)
    with pytest.raises(NonFiniteError, match=r"^prompt 1, step 3 "):
        engine.generate(prompts([3, 4], seed=5), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


# -- values the API takes -----------------------------------------------------------------------------

def test_return_logits_is_a_bool():
    with pytest.raises(InputError, match=r"return_logits must be True or False, got 'yes'"):
        SamplingParams(return_logits="yes")


def test_stop_tokens_outside_the_vocabulary_are_refused_at_generate():
    engine = make_engine()
    with pytest.raises(InputError, match=rf"prompt 1: stop_token_ids \[99999\] are outside the vocabulary "
                                         rf"\[0, {VOCAB}\)"):
        engine.generate([[1], [2]], [SamplingParams(), SamplingParams(stop_token_ids=(3, 99999))])


def test_numpy_integers_are_token_ids_and_params():
    engine = make_engine()
    (p,) = prompts([4], seed=6)
    want = engine.generate([p], SamplingParams(max_new_tokens=3))[0].token_ids
    as_numpy = [np.int64(t) for t in p]
    params = SamplingParams(max_new_tokens=np.int64(3), stop_token_ids=(np.int32(VOCAB - 1),))
    assert params.max_new_tokens == 3 and type(params.max_new_tokens) is int
    assert engine.generate([as_numpy], SamplingParams(max_new_tokens=np.int64(3)))[0].token_ids == want
    assert engine.generate([np.array(p)], SamplingParams(max_new_tokens=3))[0].token_ids == want
    torch.testing.assert_close(engine.logits([as_numpy])[0], engine.logits([p])[0], rtol=0, atol=0)
    with pytest.raises(InputError, match=r"prompt 0, position 0: token ids are integers, got np\.True_"):
        engine.logits([[np.True_]])
    with pytest.raises(InputError, match=r"prompt 0, position 1: token ids are integers, got tensor\(\[2\]\)"):
        engine.logits([[1, torch.tensor([2])]])
    assert engine.logits([torch.tensor([1, 2])])[0].shape == (2, VOCAB)     # a list of tensors is not a flat list


def test_decode_after_must_leave_a_token_to_decode():
    engine = make_engine()
    with pytest.raises(InputError, match=r"decode_after=100 leaves no token to decode: the longest prompt, prompt 0, "
                                         r"has 3; give decode_after < 3"):
        engine.logits([[1, 2, 3]], decode_after=100)
    with pytest.raises(InputError, match=r"prompt 1, has 4; give decode_after < 4"):
        engine.logits([[1, 2], [1, 2, 3, 4]], decode_after=4)
    # Shorter prompts beside a longer one are prefilled whole, as before.
    got = engine.logits([[1, 2], [1, 2, 3, 4]], decode_after=np.int64(3))
    want = engine.logits([[1, 2], [1, 2, 3, 4]])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_paired_with_its_own_spec_still_has_its_config_checked(tmp_path, monkeypatch):
    """spec_from_config refuses a gelu / biased / foreign-quantised config; a spec given alongside the
    checkpoint must not skip that: its weights would load and compute the wrong function."""
    from ir.errors import SpecError

    def refuse(*args, **kwargs):
        raise AssertionError("weights read before the config was checked")
    monkeypatch.setattr(engine_mod, "load_model_weights", refuse)
    hf = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "hidden_act": "gelu"}))
    with pytest.raises(SpecError, match=r"hidden_act 'gelu' is not supported") as err:
        Engine.from_pretrained(tmp_path, spec=TINY)
    assert err.value.path == "hidden_act" and str(tmp_path) in err.value.file
