"""What a new user meets first: shipped specs by name from any folder (compile, plan, generate, the
API) with one wording when a spec is not found; a Hub id or a config.json where a folder or a spec
belongs gets a one-line pointer; engine messages in CLI terms on the command line; the GPU and
driver requirements refused in one line; the extra to install named; the license."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import codegen.nvrtc as nvrtc
from codegen.paths import MODEL_SPECS_DIR, shipped_specs
from runtime.cli import main

ROOT = Path(__file__).resolve().parents[2]
CPU = ["--backend", "reference", "--device", "cpu"]
HUB_ID = "deepseek-ai/DeepSeek-V2-Lite"


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """Every test runs from a folder that is not the checkout, with its own bundle cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def one_line_error(capsys, *words) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def test_shipped_specs_by_name_from_any_folder(capsys, monkeypatch, tmp_path):
    assert {"deepseek_tiny", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3"} <= set(shipped_specs())
    assert main(["plan", "deepseek_tiny", "--gpus", "1"]) == 0
    assert "deepseek_tiny" in capsys.readouterr().out
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda src, name, **kw: nvrtc.CompileResult(b"CUBIN", ""))
    assert main(["compile", "deepseek_tiny", "-o", str(tmp_path / "b")]) == 0
    assert "spec     deepseek_tiny (deepseek_tiny)" in capsys.readouterr().out
    for name in ("deepseek_tiny", "deepseek_tiny.yaml", "model_specs/deepseek_tiny.yaml"):
        assert main(["generate", "--random-weights", "--spec", name, "--ids", "1,2", "--max-new-tokens", "2",
                     *CPU]) == 0
        assert capsys.readouterr().out.startswith("ids: ")
    from runtime import Engine
    engine = Engine.from_spec("deepseek_tiny", backend="reference", device="cpu", max_seq_len=64)
    assert engine.spec.name == "deepseek_tiny"


def test_an_unknown_spec_is_worded_the_same_everywhere(capsys):
    lines = []
    for argv in (["compile", "deepseek_tny"], ["plan", "deepseek_tny"],
                 ["generate", "--random-weights", "--spec", "deepseek_tny", "--ids", "1", *CPU]):
        assert main(argv) == 2
        lines.append(one_line_error(capsys, "spec file not found: deepseek_tny", "did you mean 'deepseek_tiny'?",
                                    ", ".join(shipped_specs())))
    assert len(set(lines)) == 1
    from ir.errors import SpecError
    from runtime import Engine
    with pytest.raises(SpecError, match="spec file not found: deepseek_tny"):
        Engine.from_spec("deepseek_tny", backend="reference", device="cpu")


def test_a_hub_id_gets_a_pointer_to_download_it(capsys):
    pointer = f"huggingface-cli download {HUB_ID} --local-dir DIR"
    for argv in (["generate", "--model", HUB_ID, "--ids", "1", *CPU], ["generate", "--model", HUB_ID, "--prompt", "hi",
                 *CPU], ["serve", HUB_ID, "--device", "cpu"], ["compile", HUB_ID]):
        assert main(argv) == 2
        one_line_error(capsys, f"{HUB_ID} looks like a Hugging Face Hub id", "dsgraph reads local folders", pointer)
    from runtime import Engine, WeightError
    with pytest.raises(WeightError, match=f"model folder {HUB_ID} does not exist; .*{pointer}"):
        Engine.from_pretrained(HUB_ID)


def test_a_config_json_where_a_spec_or_a_folder_belongs(capsys):
    config = str(MODEL_SPECS_DIR / "hf_configs" / "deepseek_tiny.json")
    assert main(["generate", "--random-weights", "--spec", config, "--ids", "1", *CPU]) == 2
    one_line_error(capsys, "this is a Hugging Face config.json, not a dsgraph spec", "dsgraph spec --from-config")
    assert main(["compile", config]) == 2
    one_line_error(capsys, "not a dsgraph spec", "dsgraph spec --from-config")
    assert main(["generate", "--model", config, "--ids", "1", *CPU]) == 2
    one_line_error(capsys, "is a file; give the checkpoint folder", f"dsgraph spec --from-config {config}")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_engine_hints_are_in_cli_terms_on_the_command_line(capsys):
    assert main(["generate", "--random-weights", "--spec", "deepseek_tiny", "--ids", "1", "--device", "cuda"]) == 2
    err = one_line_error(capsys, "use --device cpu with --backend reference")
    assert "device='cpu'" not in err
    assert main(["generate", "--random-weights", "--spec", "deepseek_tiny", "--ids", "1,2", "--max-new-tokens", "8",
                 "--block-size", "4", "--num-blocks", "1", *CPU]) == 2
    one_line_error(capsys, "(--num-blocks 1 x --block-size 4); raise --num-blocks or lower --max-new-tokens")


def test_in_cli_terms():
    from runtime.cli_args import in_cli_terms
    assert in_cli_terms("use device='cpu' with backend='reference', or try dtype=torch.float32") == \
        "use --device cpu with --backend reference, or try --dtype fp32"
    assert in_cli_terms("the engine holds at most 32 (max_seq_len; the model allows 64)") == \
        "the engine holds at most 32 (--max-seq-len; the model allows 64)"
    assert in_cli_terms("model.layers.0.mlp.gate.weight: max_positions=128") == \
        "model.layers.0.mlp.gate.weight: max_positions=128"          # other names stay as they are


def test_a_gpu_older_than_hopper_or_an_old_driver_is_one_line(monkeypatch):
    import torch

    from runtime import InputError, requirements
    from runtime.engine import check_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(requirements, "driver_version", lambda: 13000)
    with pytest.raises(InputError, match=r"written for Hopper GPUs \(compute capability 9.0: H100, H200\) and newer; "
                                         r"cuda is a NVIDIA A100-SXM4-80GB \(sm_80\); use backend='reference'"):
        check_device("cuda", "cuda")
    check_device("reference", "cuda")                  # the reference backend runs anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    check_device("cuda", "cuda")
    monkeypatch.setattr(requirements, "driver_version", lambda: 12040)
    with pytest.raises(InputError, match=r"supports CUDA 12.4; .* need an NVIDIA driver for CUDA 13 or newer "
                                         r"\(R580\+\)"):
        check_device("cuda", "cuda")


def test_prompt_without_transformers_names_the_extra(monkeypatch, capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["generate", "--model", str(model), "--prompt", "hi", *CPU]) == 2
    one_line_error(capsys, "needs transformers, which is not installed: pip install 'dsgraph[serve]'")


def test_the_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 11000           # the full text
    assert '\nlicense = "Apache-2.0"\n' in (ROOT / "pyproject.toml").read_text()
