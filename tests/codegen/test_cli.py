"""The dsgraph command line: spec from a config, compile, diff, and user errors
(exit 2, one message, no traceback)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import codegen.nvrtc as nvrtc
from runtime.cli import COMMANDS, main
from tiny import ROOT, tiny_config, write_tiny_spec


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_commands_are_a_table():
    assert {"spec", "compile", "diff", "goldens"} <= set(COMMANDS)
    for add_arguments, run in COMMANDS.values():
        assert callable(add_arguments) and callable(run)


def test_spec_from_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config()))
    assert main(["spec", "--from-config", str(cfg), "--name", "mini"]) == 0
    text = capsys.readouterr().out
    assert "name: mini" in text and "kv_lora_rank: 32" in text
    out = tmp_path / "mini.yaml"
    assert main(["spec", "--from-config", str(cfg), "-o", str(out)]) == 0
    assert "name: mini" not in out.read_text() and "name: tiny" in out.read_text()
    import ir
    ir.load_spec(str(out))


def test_spec_from_shipped_config_matches_shipped_spec(capsys):
    assert main(["spec", "--from-config", str(ROOT / "model_specs/hf_configs/deepseek_v2_lite.json"),
                 "--name", "deepseek_v2_lite"]) == 0
    generated = capsys.readouterr().out
    import ir
    a = ir.load_spec(generated, file="gen.yaml", check=False)
    b = ir.load_spec(str(ROOT / "model_specs/deepseek_v2_lite.yaml"), check=False)
    assert a.dims == b.dims


def test_compile_then_cached(tmp_path, capsys, cache_dir, monkeypatch):
    monkeypatch.setattr(nvrtc, "compile_cubin",
                        lambda src, name, **kw: nvrtc.CompileResult(b"CUBIN" + name.encode(), ""))
    spec = write_tiny_spec(tmp_path / "t.yaml")
    out = tmp_path / "b"
    args = ["compile", str(spec), "-o", str(out), "--allow-unlowered", "--jobs", "2"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "miss" in first and f"bundle   {out}" in first and "library calls" in first
    assert "memory   " in first and "prefill activations: 1 tok " in first and "2048 tok " in first, first
    assert (out / "manifest.json").is_file()
    assert list(cache_dir.glob("*/*/manifest.json"))
    assert main(args) == 0
    assert "cache    hit" in capsys.readouterr().out


def test_compile_no_pdl_is_another_bundle_without_pdl_launches(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(nvrtc, "compile_cubin",
                        lambda src, name, **kw: nvrtc.CompileResult(b"CUBIN" + name.encode(), ""))
    spec = write_tiny_spec(tmp_path / "t.yaml")
    assert main(["compile", str(spec), "-o", str(tmp_path / "on"), "--allow-unlowered"]) == 0
    on = capsys.readouterr().out
    assert main(["compile", str(spec), "-o", str(tmp_path / "off"), "--allow-unlowered", "--no-pdl"]) == 0
    off = capsys.readouterr().out
    assert "miss" in off and ", no PDL" in off and "(0 PDL)" in off and "no PDL" not in on
    assert re.search(r"decode\s+\d+ launches \([1-9]\d* PDL\)", on), on
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("on", "off")]
    assert [m["options"]["pdl"] for m in manifests] == [True, False]


def test_diff_between_specs(tmp_path, capsys):
    a = write_tiny_spec(tmp_path / "a.yaml")
    b = write_tiny_spec(tmp_path / "b.yaml", num_hidden_layers=3)   # same kernels, more nodes
    assert main(["diff", str(a), str(a)]) == 0
    out = capsys.readouterr().out
    assert "0 changed, 0 added, 0 removed" in out
    rc = main(["diff", str(a), str(b)])
    out = capsys.readouterr().out
    if "identical" in out and " 0 changed" in out and "0 identical" in out:
        pytest.skip("no kernel families yet")
    assert rc == 1
    assert "changed" in out and "--- a/" in out and "+++ b/" in out
    assert re.search(r"L\d-2\.", out)   # the third layer's nodes join the kernels' headers (layers folded)
    c = write_tiny_spec(tmp_path / "c.yaml", hidden_size=128)       # new dims: new kernel names
    assert main(["diff", "--stat", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "added" in out and "removed" in out and "--- " not in out


def test_diff_against_a_bundle(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(nvrtc, "compile_cubin",
                        lambda src, name, **kw: nvrtc.CompileResult(b"CUBIN", ""))
    spec = write_tiny_spec(tmp_path / "t.yaml")
    assert main(["compile", str(spec), "-o", str(tmp_path / "b"), "--allow-unlowered"]) == 0
    capsys.readouterr()
    assert main(["diff", str(spec), str(tmp_path / "b")]) == 0


@pytest.mark.parametrize("argv,message", [
    (["compile", "no/such/spec.yaml"], "spec file not found"),
    (["compile", "{bad}"], "not found"),
    (["spec", "--from-config", "missing.json"], "config file not found"),
    (["diff", "nope1", "nope2"], "not a spec file"),
    (["compile", "--arch", "compute_90", "SPEC"], "architecture"),
])
def test_user_errors_exit_2_without_traceback(tmp_path, capsys, argv, message):
    spec = write_tiny_spec(tmp_path / "t.yaml")
    argv = [str(spec) if a == "SPEC" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") <= 3


def test_bad_spec_is_one_located_message(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(write_tiny_spec(tmp_path / "t.yaml").read_text().replace("op: rms_norm", "op: rms_nrom", 1))
    assert main(["compile", str(bad), "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml:" in err and "rms_nrom" in err and "Traceback" not in err


def test_unlowered_node_is_a_user_error_in_strict_mode(tmp_path, capsys, monkeypatch):
    import codegen.families as fam
    monkeypatch.setattr(fam, "family_for_op", lambda op: None)
    spec = write_tiny_spec(tmp_path / "t.yaml")
    assert main(["compile", str(spec), "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "has no kernel family" in err and "Traceback" not in err


def test_real_process_error_has_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "compile", str(tmp_path / "x.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("dsgraph: error: spec file not found") and "Traceback" not in r.stderr
