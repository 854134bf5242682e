"""`dsgraph diff` shows a change of weight storage format as one summary line per kind of change."""
from __future__ import annotations

import pytest

from runtime.cli import main
from tiny import write_tiny_spec

FP8_ATTENTION = ('\nweight_formats:\n  "model.layers.*.self_attn.o_proj.weight": fp8_e4m3_block128\n'
                 '  "model.layers.*.self_attn.kv_b_proj.weight": fp8_e4m3_block128\n')


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSGRAPH_CACHE_DIR", str(tmp_path / "cache"))


def test_a_format_change_is_one_line_per_kind(tmp_path, capsys):
    a = write_tiny_spec(tmp_path / "a.yaml")
    b = tmp_path / "b.yaml"
    b.write_text(a.read_text() + FP8_ATTENTION)
    assert main(["diff", "--stat", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "weight format" in line]
    assert line.split() == ["changed", "weight", "format", "act", "->", "fp8_e4m3_block128:", "4", "weight(s)",
                            "(model.layers.0.self_attn.kv_b_proj.weight,", "model.layers.0.self_attn.o_proj.weight,",
                            "model.layers.1.self_attn.kv_b_proj.weight", "...)"]
    assert "scale_inv" not in out
    assert main(["diff", "--stat", str(b), str(b)]) == 0
    assert "weight format" not in capsys.readouterr().out


def test_a_bundle_carries_its_formats_in_the_manifest(tmp_path, capsys, monkeypatch):
    import json

    import codegen.nvrtc as nvrtc
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda src, name, **kw: nvrtc.CompileResult(b"CUBIN", ""))
    a = write_tiny_spec(tmp_path / "a.yaml")
    b = tmp_path / "b.yaml"
    b.write_text(a.read_text() + FP8_ATTENTION)
    assert main(["compile", str(b), "-o", str(tmp_path / "bundle"), "--allow-unlowered"]) == 0
    weights = json.loads((tmp_path / "bundle" / "manifest.json").read_text())["weights"]
    assert weights["model.layers.1.self_attn.o_proj.weight"]["format"] == "fp8_e4m3_block128"
    assert weights["model.layers.1.self_attn.o_proj.weight_scale_inv"]["keep_fp32"] is True
    assert "format" not in weights["model.layers.1.self_attn.q_proj.weight"]
    capsys.readouterr()
    assert main(["diff", "--stat", str(b), str(tmp_path / "bundle")]) == 0
    assert main(["diff", "--stat", str(a), str(tmp_path / "bundle")]) == 1
    assert "weight format act -> fp8_e4m3_block128: 4 weight(s)" in capsys.readouterr().out
