"""A checkpoint that does not fit the model fails at load with one WeightError naming the
tensor (and both shapes when they differ), before any tensor data is read."""
from __future__ import annotations

import re
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import hf_tiny  # noqa: E402
from ir import SpecError, load_spec  # noqa: E402
from ir.config_to_spec import spec_from_config  # noqa: E402
from runtime import Engine, WeightError  # noqa: E402
from runtime.weights import load_config  # noqa: E402

CKPT = "model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return hf_tiny.build("v2_lite", tmp_path_factory.mktemp("v2_lite"))


@pytest.fixture
def model_dir(saved, tmp_path):
    """A private copy of the saved model that a test may damage."""
    return shutil.copytree(saved, tmp_path / "model")


def _load(path, **kw):
    return Engine.from_pretrained(path, backend="reference", device="cpu", dtype=torch.float32, block_size=4, **kw)


def _rewrite(model_dir, edit):
    tensors = load_file(str(model_dir / CKPT))
    edit(tensors)
    save_file(tensors, str(model_dir / CKPT), metadata={"format": "pt"})


def test_the_intact_copy_loads(model_dir):
    engine = _load(model_dir)
    assert engine.logits([[1, 2, 3]])[0].shape == (3, hf_tiny.VOCAB)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.kv_b_proj.weight",
                                  "model.layers.2.mlp.experts.5.up_proj.weight",   # one part of a stacked expert weight
                                  "lm_head.weight"])
def test_missing_tensor(model_dir, name):
    _rewrite(model_dir, lambda t: t.pop(name))
    with pytest.raises(WeightError) as err:
        _load(model_dir)
    msg = str(err.value)
    assert "missing" in msg and name in msg
    assert str(model_dir) in msg


def test_mis_shaped_tensor(model_dir):
    name = "model.layers.1.self_attn.kv_b_proj.weight"          # [H*(N+V), C] = [66, 20]
    _rewrite(model_dir, lambda t: t.__setitem__(name, torch.randn(66, 19)))
    with pytest.raises(WeightError) as err:
        _load(model_dir)
    msg = str(err.value)
    assert re.search(rf"{re.escape(name)}: checkpoint has shape \(66, 19\), the spec expects \(66, 20\)", msg), msg


def test_mis_shaped_expert(model_dir):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"      # [D, M] = [42, 14]
    _rewrite(model_dir, lambda t: t.__setitem__(name, torch.randn(42, 15)))
    expected = f"{name}: checkpoint has shape (42, 15), the spec expects (42, 14)"
    with pytest.raises(WeightError, match=re.escape(expected)):
        _load(model_dir)


def test_unexpected_extra_tensor(model_dir):
    name = "model.layers.0.self_attn.q_a_proj.weight"           # V2-Lite has no q_lora: nothing reads it
    _rewrite(model_dir, lambda t: t.__setitem__(name, torch.randn(18, 42)))
    with pytest.raises(WeightError) as err:
        _load(model_dir)
    msg = str(err.value)
    assert "unexpected" in msg and name in msg


def test_every_problem_is_named_at_once(model_dir):
    missing, wrong, extra = "model.norm.weight", "model.embed_tokens.weight", "model.layers.1.mlp.bogus.weight"

    def edit(t):
        t.pop(missing)
        t[wrong] = torch.randn(hf_tiny.VOCAB, 41)
        t[extra] = torch.zeros(3)
    _rewrite(model_dir, edit)
    with pytest.raises(WeightError) as err:
        _load(model_dir)
    msg = str(err.value)
    assert missing in msg and wrong in msg and extra in msg


def test_known_unused_tensors_are_ignored(model_dir):
    """Rotary buffers and layers past num_hidden_layers (DeepSeek-V3's MTP layer) are not errors."""
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        t["model.layers.3.self_attn.kv_b_proj.weight"] = torch.ones(66, 20)
    _rewrite(model_dir, edit)
    _load(model_dir)


def test_model_dir_that_does_not_exist(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(WeightError, match=re.escape(str(missing))):
        _load(missing)


def test_model_dir_without_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(WeightError, match=r"config\.json"):
        _load(model_dir)


def test_model_dir_without_weights(model_dir):
    (model_dir / CKPT).unlink()
    with pytest.raises(WeightError, match="no safetensors checkpoint"):
        _load(model_dir)


def _v2_lite_spec_with_hidden(model_dir, hidden: int) -> str:
    cfg = load_config(model_dir)
    cfg["hidden_size"] = hidden
    return spec_from_config(cfg)


def test_explicit_spec_that_does_not_match_the_checkpoint(model_dir):
    spec = load_spec(_v2_lite_spec_with_hidden(model_dir, 48), file="wrong_hidden.yaml")
    with pytest.raises(WeightError) as err:
        _load(model_dir, spec=spec)
    msg = str(err.value)
    assert "model.embed_tokens.weight: checkpoint has shape (97, 42), the spec expects (97, 48)" in msg, msg
    assert ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight: checkpoint has shape (28, 42), "
            "the spec expects (28, 48)") in msg


def test_explicit_spec_path_that_does_not_match(model_dir, tmp_path):
    path = tmp_path / "wrong_hidden.yaml"
    path.write_text(_v2_lite_spec_with_hidden(model_dir, 45))
    with pytest.raises(WeightError, match=re.escape("the spec expects (97, 45)")):
        _load(model_dir, spec=str(path))


def test_explicit_spec_path_that_does_not_exist(model_dir, tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        _load(model_dir, spec=str(tmp_path / "nope.yaml"))


def test_explicit_matching_spec_loads_and_agrees(model_dir, tmp_path):
    path = tmp_path / "right.yaml"
    path.write_text(_v2_lite_spec_with_hidden(model_dir, 42))
    prompt = [[5, 6, 7, 8, 9]]
    torch.testing.assert_close(_load(model_dir, spec=str(path)).logits(prompt)[0], _load(model_dir).logits(prompt)[0],
                               rtol=0, atol=0)
