"""The manifest is what runs: every launch of every shipped spec matches its kernel's rendered
signature, and a phase written to the manifest reads back as the same plan."""
from __future__ import annotations

import dataclasses
import functools
import json
import re

import pytest

from codegen.bundle import plan_spec, unique_kernels
from codegen.kernel import DEFAULTS, Arg, KernelLaunch, SizeRef, StrideRef, ValueRef, WeightRef, ref_from_json, ref_to_json
from codegen.manifest import phase_from_json, phase_to_json
from tiny import ROOT

SPECS = ("deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
_SIGNATURE = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(\s*(.*?)\) \{", re.S)


@functools.lru_cache(maxsize=None)
def _planned(spec: str):
    return plan_spec(str(ROOT / "model_specs" / f"{spec}.yaml"), DEFAULTS, strict=False)


def _declared(source: str) -> dict[str, list[str]]:
    """kernel name -> its parameter declarations, as NVRTC will read them."""
    return {m.group(1): [p.strip() for p in m.group(2).split(",")] for m in _SIGNATURE.finditer(source)}


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_every_launch_matches_its_kernels_signature(spec):
    sp = _planned(spec)
    sources = {k.name: k.source for k in unique_kernels(sp.plans)}
    for plan in sp.plans.values():
        for launch in plan.launches:
            declared = _declared(sources[launch.name])
            assert list(declared) == [launch.name], f"{launch.name}: one kernel per source"
            assert declared[launch.name] == [a.declaration() for a in launch.args], launch.name


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_a_phase_reads_back_from_the_manifest_as_lowered(spec):
    for plan in _planned(spec).plans.values():
        text = json.dumps(phase_to_json(plan), sort_keys=True)
        back = phase_from_json(plan.phase, json.loads(text))
        # Provenance stays in the sources; everything that runs comes back equal.
        assert [dataclasses.replace(s, origins=()) if isinstance(s, KernelLaunch) else s
                for s in plan.steps] == back.steps
        assert back.buffers == plan.buffers and back.nodes == plan.nodes
        assert (back.inputs, back.outputs) == (plan.inputs, plan.outputs)
        assert back.arena == plan.arena and plan.arena


def test_argument_references_round_trip():
    for ref in (ValueRef("L0.x"), WeightRef("model.layers.0.w"), StrideRef("L0.x", 1), SizeRef("cdiv(T, 4)")):
        assert ref_from_json(json.loads(json.dumps(ref_to_json(ref)))) == ref
    a = Arg("x_stride", "i64", StrideRef("L0.x", 0))
    assert Arg.from_json(a.to_json()) == a and a.kind == "i64" and a.declaration() == "i64 x_stride"
    with pytest.raises(ValueError, match="unknown argument reference"):
        ref_from_json({"bogus": 1})
