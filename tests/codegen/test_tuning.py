"""Tuning as typed options (codegen/tuning.py): parsed from the CLI's --tune, validated with one
line that names the setting, part of Options, the bundle cache key (each knob) and the manifest."""
from __future__ import annotations

import dataclasses

import pytest

import codegen.nvrtc as nvrtc
from codegen.bundle import bundle_key, check_compatible, compile_bundle, load_manifest, recompile_command
from codegen.kernel import Options
from codegen.tuning import DEFAULT_TUNING, SECTIONS, Tuning, TuningError, as_tuning, knobs, parse_tune
from tiny import write_tiny_spec


def test_parse_tune_sets_knobs_and_the_last_setting_wins():
    t = parse_tune(["moe.expert_ffn_upto=128", "moe.prefill_wgmma_above=none", "moe.decode_wgmma=false",
                    "attention.prefill_tile=v2_m128n32w32s", "moe.expert_ffn_upto=64"])
    assert t.changed() == {"moe.decode_wgmma": False, "moe.prefill_wgmma_above": None, "moe.expert_ffn_upto": 64,
                           "attention.prefill_tile": "v2_m128n32w32s"}
    assert parse_tune([]) == Tuning() == DEFAULT_TUNING and Tuning().changed() == {}
    assert Tuning.from_changed(t.changed()) == t and Tuning.from_json(t.to_json()) == t
    assert as_tuning(["route.fused_upto=8"]) == as_tuning({"route": {"fused_upto": 8}})
    assert Options(tuning=["route.fused_upto=8"]).tuning.route.fused_upto == 8
    assert t.flags()[0] == "--tune moe.decode_wgmma=false"


@pytest.mark.parametrize("setting,message", [
    ("moe.expert_ffn_uptoo=1", "unknown tuning knob 'moe.expert_ffn_uptoo' (did you mean moe.expert_ffn_upto?)"),
    ("moo.gemm_bk=32", "unknown tuning section 'moo' in --tune 'moo.gemm_bk=32' (did you mean moe?)"),
    ("moe.gemm_bk=48", "tuning moe.gemm_bk must be one of 16, 32, 64, 128, got 48"),
    ("moe.gemm_threshold=-1", "tuning moe.gemm_threshold must be from 0 to"),
    ("moe.gemm_threshold=two", "tuning moe.gemm_threshold must be a whole number, got 'two'"),
    ("moe.gemm_threshold=none", "tuning moe.gemm_threshold must be a whole number, got 'none'"),
    ("moe.decode_wgmma=maybe", "tuning moe.decode_wgmma must be true or false"),
    ("attention.prefill_tile=v1", "tuning attention.prefill_tile 'v1' does not match"),
    ("linear.skinny_upto=17", "tuning linear.skinny_upto must be from 0 to 16, got 17"),
    ("moe", "expected SECTION.KNOB=VALUE"),
    ("moe.gemm_bk", "expected SECTION.KNOB=VALUE"),
])
def test_a_bad_setting_is_one_line_that_names_it(setting, message):
    with pytest.raises(TuningError) as info:
        parse_tune([setting])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_sections_validate_when_made_and_tuning_is_frozen():
    with pytest.raises(TuningError, match="moe.gemm_bk must be one of"):
        SECTIONS["moe"](gemm_bk=7)
    with pytest.raises(TuningError, match="section 'moe' must be a MoeTuning"):
        Tuning(moe=SECTIONS["route"]())
    with pytest.raises(dataclasses.FrozenInstanceError):
        Tuning().moe.gemm_bk = 64
    with pytest.raises(TuningError, match="unknown tuning knob moe.nope"):
        Tuning.from_json({"moe": {"nope": 1}})
    hash(Options(tuning=Tuning()))


def _other(name: str, default):
    """A valid value other than the default for knob `name`."""
    sec, knob = name.split(".")
    f = next(f for f in dataclasses.fields(SECTIONS[sec]) if f.name == knob)
    m = f.metadata
    if isinstance(default, bool):
        return not default
    if isinstance(default, str) and not m.get("choices"):
        return "v2_m128n32w32s"   # the one free-form string knob: the prefill tile
    if m.get("choices"):
        return next(c for c in m["choices"] if c != default)
    return default - 1 if default and default - 1 >= (m["lo"] or 0) else (default or 0) + 1


def test_each_knob_changes_the_cache_key():
    base = bundle_key("spec", arch="sm_90", dtype="bf16", block_size=64)
    assert bundle_key("spec", arch="sm_90", dtype="bf16", block_size=64, tuning=Tuning()) == base
    seen = {base}
    for name, (default, doc) in knobs().items():
        assert doc, name
        t = parse_tune([f"{name}={_other(name, default)}"])
        assert t.changed() and list(t.changed()) == [name]
        key = bundle_key("spec", arch="sm_90", dtype="bf16", block_size=64, tuning=t)
        assert key not in seen, name
        seen.add(key)


def test_a_tuned_bundle_records_its_tuning_and_checks_against_it(tmp_path, monkeypatch):
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda src, name, **kw: nvrtc.CompileResult(b"CUBIN", ""))
    spec = write_tiny_spec(tmp_path / "t.yaml")
    t = parse_tune(["moe.expert_ffn_upto=128", "route.fused_upto=8"])
    res = compile_bundle(spec, tmp_path / "b", cache_dir=tmp_path / "c", strict=False, progress=False, tuning=t)
    plain = compile_bundle(spec, tmp_path / "p", cache_dir=tmp_path / "c", strict=False, progress=False)
    assert res.key != plain.key and not plain.cached
    m = load_manifest(res.path)
    assert m["options"]["tuning"] == {"moe.expert_ffn_upto": 128, "route.fused_upto": 8}
    assert m["tuning"] == t.to_json() and "tuning" not in load_manifest(plain.path)["options"]
    check_compatible(m, res.path, arch="sm_90")
    assert "--tune moe.expert_ffn_upto=128 --tune route.fused_upto=8" in recompile_command(m, res.path)
