"""What a reviewer diffs is everything that reaches NVRTC, paired by role, summary first.

Each case is one a reviewer met: a shared-header edit, an eps change (once a launch argument,
invisible in the sources), a rope-factor change (once three kernels "removed" and "added"),
and V2-Lite against V3.
"""
from __future__ import annotations

import re
import shutil

import pytest

from codegen import goldens, render
from codegen.review import Side, compare, pair_kernels
from runtime.cli import main
from tiny import ROOT

V2_LITE = ROOT / "model_specs" / "deepseek_v2_lite.yaml"


def _side(label: str, spec_path, templates=None) -> Side:
    name, sources, headers, _ = goldens.render_spec_sources(spec_path)
    return Side(label, {name: sources}, headers=headers)


@pytest.fixture
def edited_templates(tmp_path, monkeypatch):
    """A copy of templates/ with `+ eps` in the shared RMSNorm header made `+ 2.f * eps`, rendered
    from instead of the real one."""
    tdir = tmp_path / "templates"
    shutil.copytree(render.TEMPLATES_DIR, tdir)
    norm = tdir / "include" / "norm.cuh"
    text = norm.read_text()
    assert "+ eps)" in text
    norm.write_text(text.replace("+ eps)", "+ 2.f * eps)"))
    monkeypatch.setattr(render, "TEMPLATES_DIR", tdir)
    return tdir


@pytest.mark.slow
def test_a_shared_header_edit_makes_the_goldens_stale_and_shows_in_the_diff(edited_templates):
    expected = goldens.expected_files(("deepseek_v2_lite",))
    committed = {k: v for k, v in goldens.committed_files().items()   # V2-Lite's kernels and the headers they use
                 if k.startswith("deepseek_v2_lite/") or (k.startswith("include/") and k in expected)}
    expected.pop(goldens.INDEX)
    stale = goldens.stale(expected, committed)
    assert stale["changed"] == ["include/norm.cuh"], stale
    golden = Side("golden", {"deepseek_v2_lite": {k.split("/", 1)[1][:-3]: v for k, v in committed.items()
                                                  if k.endswith(".cu")}},
                  headers={k.split("/", 1)[1]: v for k, v in committed.items() if k.startswith("include/")})
    report = compare(golden, _side("worktree", V2_LITE))
    assert report.differs
    assert report.summary[0].endswith("32 identical kernels; 1 header(s) changed")   # decode attention 3, fused route 1, skinny linears
    assert any("include/norm.cuh (included by" in line and "rms_norm__bf16__d2048" in line
               for line in report.summary)
    assert "+  const float r = rsqrtf(ss / (float)N + 2.f * eps);\n" in report.diff


def _spec_copy(tmp_path, name, old, new):
    text = V2_LITE.read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.slow
def test_an_eps_change_shows_in_the_generated_source(tmp_path, capsys):
    b = _spec_copy(tmp_path, "eps.yaml", "rms_norm_eps: 1.0e-06", "rms_norm_eps: 1.0e-05")
    assert main(["diff", str(V2_LITE), str(b)]) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert re.search(r": [1-9]\d* changed, 0 added, 0 removed", first), first     # summary first
    assert re.search(r"^\+constexpr float EPS = 9\.99999974737875\de-06f;$", out, re.M), out[:2000]


@pytest.mark.slow
def test_a_rope_factor_change_reads_as_changed_kernels(tmp_path, capsys):
    """The three rope kernels (renamed: their table digest is in the name) pair by role, and the
    attention kernels change too (prefill, and decode's three: one per cluster size): YaRN's mscale,
    hence the softmax scale, follows the factor."""
    b = _spec_copy(tmp_path, "rope.yaml", "factor: 40.0", "factor: 32.0")
    assert main(["diff", str(V2_LITE), str(b)]) == 1
    out = capsys.readouterr().out
    assert re.search(r": 7 changed, 0 added, 0 removed, 25 identical", out), out[:3000]
    assert "rope_q__bf16__h16_r64__adj_il__rope" in out and " -> " in out   # renamed, paired by role
    assert re.search(r"^\+constexpr float SCALE = ", out, re.M)


@pytest.mark.slow
def test_v2_lite_against_v3_pairs_kernels_by_role(capsys):
    assert main(["diff", "--stat", str(V2_LITE), str(ROOT / "model_specs" / "deepseek_v3.yaml")]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    changed, added, removed = map(int, re.search(r"(\d+) changed, (\d+) added, (\d+) removed", first).groups())
    assert changed >= 15 and added <= 3 and removed <= 2, first


def test_pairing_prefers_same_name_then_role_and_ops():
    def src(role, *sites):
        lines = [f"// role:     {role}", "// implements (spec op, layers, passes that fused it):"]
        lines += [f"//   s.yaml:1 {path} {op}, layers 0-1 (as written)" for op, path in sites]
        return "\n".join(lines) + "\n\nbody\n"
    a = {"n__d8": src("rms_norm", ("rms_norm", "blocks.x.ops[0]")),
         "n__d4": src("rms_norm", ("rms_norm", "blocks.y.ops[2]")),
         "k": src("add", ("add", "blocks.x.ops[1]"))}
    b = {"n__d16": src("rms_norm", ("rms_norm", "blocks.x.ops[0]")),
         "n__d32": src("rms_norm", ("rms_norm", "blocks.y.ops[2]")),
         "k": src("add", ("add", "blocks.x.ops[1]")), "new": src("embedding", ("embedding", "blocks.e.ops[0]"))}
    assert sorted(pair_kernels(a, b), key=str) == sorted(
        [("k", "k"), ("n__d8", "n__d16"), ("n__d4", "n__d32"), (None, "new")], key=str)
