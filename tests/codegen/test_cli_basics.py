"""What a new user meets first: `dsgraph --version`, help that shows every default, and a
compile path that imports no torch (so `pip install dsgraph` without torch compiles)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

import runtime
from runtime.cli import COMMANDS, VersionAction, build_parser, main
from tiny import ROOT, write_tiny_spec

# Importing a module whose sys.modules entry is None raises ImportError: the child
# process proves torch (or networkx) is never imported, not merely not yet imported.
_BLOCK = "import sys; sys.modules['torch'] = None; sys.modules['safetensors'] = None; sys.modules['numpy'] = None; "


def _run(code: str, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_version(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "20")           # a long path stays on one line
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out == f"dsgraph {runtime.__version__} from {ROOT} (python {sys.version.split()[0]})\n"


def test_version_is_the_distributions():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'version = {attr = "runtime.__version__"}' in text


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif not isinstance(action, (argparse._HelpAction, VersionAction)):
            yield parser, action


# Options whose default is computed at run time (None in argparse): their help says how.
COMPUTED = {("compile", "spec"), ("compile", "--cache-dir"), ("compile", "--jobs"), ("spec", "--output"),
            ("spec", "--name"), ("generate", "--spec"), ("generate", "--seed"), ("generate", "--backend"),
            ("generate", "--device"), ("generate", "--dtype"), ("generate", "--max-seq-len"), ("bench", "--spec"),
            ("explain", "spec"), *((c, "--tune") for c in ("compile", "generate", "bench", "explain"))}


def test_every_option_has_help_that_says_its_default():
    checked = set()
    for sub, action in _options(build_parser()):
        name = (sub.prog.split()[-1], action.option_strings[-1] if action.option_strings else action.dest)
        assert action.help, f"{name}: no help"
        text = sub._get_formatter()._expand_help(action)
        if action.default is None or action.default is False:
            if name in COMPUTED:
                assert "default" in text, f"{name}: {text!r}"
                checked.add(name)
        else:
            assert f"default: {action.default}" in text, f"{name}: {text!r}"
    assert checked == COMPUTED


def test_help_shows_literal_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 32)", "0 = greedy (default: 0.0)", "(default: the bundle's, else 64)",
                  "default: bf16 on cuda, fp32 on cpu", "keep going past the model's eos token"):
        assert shown in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_commands_have_one_line_help():
    for name, (_, run) in COMMANDS.items():
        assert (run.__doc__ or "").strip(), name


# -- the compile path needs no torch ---------------------------------------------------------

@pytest.mark.slow
def test_compile_spec_diff_and_help_import_no_torch(tmp_path):
    spec = write_tiny_spec(tmp_path / "tiny.yaml")
    config = ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json"
    code = _BLOCK + f"""
from runtime.cli import main
assert main(["compile", {str(spec)!r}, "-o", {str(tmp_path / "bundle")!r}]) == 0
assert main(["spec", "--from-config", {str(config)!r}, "-o", {str(tmp_path / "t.yaml")!r}]) == 0
assert main(["diff", {str(spec)!r}, {str(tmp_path / "bundle")!r}, "--stat"]) == 0
for mod in ("torch", "numpy", "safetensors"):
    assert sys.modules[mod] is None, mod
print("ok")
"""
    r = _run(code, env={"DSGRAPH_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert (tmp_path / "bundle" / "manifest.json").is_file()


@pytest.mark.parametrize("command", [["generate", "--random-weights", "--ids", "1"], ["bench", "--quick"]])
def test_runtime_commands_without_torch_say_what_to_install(command):
    r = _run(_BLOCK + f"from runtime.cli import main; sys.exit(main({command!r}))")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "torch is not installed" in r.stderr and "dsgraph[runtime]" in r.stderr


def test_loading_a_spec_imports_neither_torch_nor_networkx():
    code = ("import sys; import ir; from ir import load_spec, parse_spec; import ir.config_to_spec; "
            "s = load_spec('model_specs/deepseek_tiny.yaml', check=False); "
            "print(s.name, sorted(m for m in ('torch', 'networkx') if m in sys.modules))")
    r = _run(code)
    assert r.returncode == 0 and r.stdout.strip() == "deepseek_tiny []", r.stderr


@pytest.mark.slow
def test_compile_for_several_ranks_and_the_rank_counts_it_refuses(tmp_path, capsys):
    """`dsgraph compile --tp N`: one bundle, a plan per rank over shared kernels (codegen/bundle.py);
    diff reads rank 0's plan; a rank count the model cannot split is one line."""
    from codegen.paths import MODEL_SPECS_DIR
    tiny = str(MODEL_SPECS_DIR / "deepseek_tiny.yaml")
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["compile", tiny, "--tp", "2", "-o", str(tmp_path / "tp2"), *cache]) == 0
    out = capsys.readouterr().out
    assert "2 ranks" in out and "launches" in out
    assert sorted(p.name for p in (tmp_path / "tp2" / "ranks").iterdir()) == ["rank0.json", "rank1.json"]
    assert main(["diff", tiny, str(tmp_path / "tp2"), "--stat"]) in (0, 1)
    assert "h4__page64 -> mla_decode_attention__bf16__c32_r16__h2__page64" in capsys.readouterr().out
    assert main(["compile", tiny, "--tp", "3", "-o", str(tmp_path / "tp3"), *cache]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsgraph: error: deepseek_tiny cannot run on 3 ranks: heads")
