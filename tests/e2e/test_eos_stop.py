"""Generation stops at the model's eos token, as transformers' own ``generate`` does, unless
``SamplingParams(ignore_eos=True)`` (vLLM's switch); the eos ids come from where transformers
reads them (generation_config.json over config.json, an int or a list)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from runtime.cli import main  # noqa: E402

PROMPT = [5, 17, 3, 44]
STEPS = 12


def _hf(model_dir):
    """transformers' model as a user loads it: eos from the checkpoint, nothing overridden."""
    from transformers import AutoConfig
    cls = hf_tiny._model_class(AutoConfig.from_pretrained(model_dir))
    try:
        model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                    experts_implementation="eager")
    except TypeError:  # transformers releases before the experts_implementation switch
        model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _set_eos(model_dir, eos) -> None:
    """Give a saved checkpoint an eos token, in both files transformers writes."""
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = eos
        path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def trajectory(tmp_path_factory):
    """A tiny V2-Lite-style checkpoint (no eos yet) and transformers' greedy tokens for PROMPT."""
    path = hf_tiny.build("v2_lite", tmp_path_factory.mktemp("eos"))
    tokens, _ = hf_tiny.hf_generate(hf_tiny.load_reference(path), PROMPT, STEPS)
    return path, tokens


def _first_new(tokens) -> int:
    """An index whose token did not appear earlier in the run (so it is where an eos on it stops)."""
    for i in range(2, len(tokens)):
        if tokens[i] not in tokens[:i] and tokens[i] not in PROMPT:
            return i
    pytest.skip("the greedy run repeats every token; no clean eos candidate")


@pytest.mark.slow
@torch.no_grad()
def test_generate_stops_at_eos_like_transformers(trajectory):
    path, tokens = trajectory
    stop = _first_new(tokens)
    eos = tokens[stop]
    _set_eos(path, eos)
    hf = _hf(path)
    assert hf.generation_config.eos_token_id == eos
    ids = torch.tensor([PROMPT])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                      pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ref == tokens[:stop + 1]               # transformers stops on eos and keeps it

    engine = Engine.from_pretrained(path, backend="reference", device="cpu", dtype=torch.float32,
                                    block_size=hf_tiny.BLOCK_SIZE)
    assert engine.eos_token_ids == (eos,)
    out = engine.generate([PROMPT], SamplingParams(max_new_tokens=STEPS))[0]
    assert out.token_ids == ref and out.finish_reason == "stop"

    # ignore_eos runs the full length, as transformers does with eos_token_id=None
    full = engine.generate([PROMPT], SamplingParams(max_new_tokens=STEPS, ignore_eos=True))[0]
    assert full.token_ids == tokens and full.finish_reason == "length"


@pytest.mark.slow
def test_cli_stops_at_eos_unless_ignore_eos(trajectory, capsys):
    path, tokens = trajectory
    stop = _first_new(tokens)
    _set_eos(path, tokens[stop])
    args = ["generate", "--model", str(path), "--ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(STEPS),
            "--backend", "reference", "--device", "cpu", "--dtype", "fp32", "--block-size", str(hf_tiny.BLOCK_SIZE)]
    assert main(args) == 0
    out = capsys.readouterr()
    assert out.out.strip().endswith(",".join(map(str, tokens[:stop + 1]))) and "(stop)" in out.err
    assert main(args + ["--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert out.out.strip().endswith(",".join(map(str, tokens))) and "(length)" in out.err


@pytest.mark.parametrize("generation_config, config_eos", [
    (None, 7),                                   # no generation_config.json: config.json's eos
    ({"eos_token_id": [9, 11]}, 7),              # generation_config.json wins, and may list several
    ({"bos_token_id": 0}, 7),                    # a generation_config.json without eos: none
])
def test_eos_ids_are_where_transformers_finds_them(trajectory, tmp_path, generation_config, config_eos):
    src, _ = trajectory
    path = tmp_path / "model"
    path.mkdir()
    (path / "model.safetensors").symlink_to(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["eos_token_id"] = config_eos
    (path / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    want = _hf(path).generation_config.eos_token_id
    want = () if want is None else tuple(want) if isinstance(want, list) else (want,)
    engine = Engine.from_pretrained(path, backend="reference", device="cpu", dtype=torch.float32, block_size=4)
    assert engine.eos_token_ids == want


def test_ignore_eos_is_a_bool():
    from runtime import InputError
    with pytest.raises(InputError, match="ignore_eos"):
        SamplingParams(ignore_eos="yes")
    assert SamplingParams().ignore_eos is False
