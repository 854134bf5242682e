"""Tuning.persistent.ctas_per_sm: two CTAs of a persistent segment an SM (issue 53's hypothesis (a): one
CTA an SM keeps half the bytes in flight a skinny linear's own launch keeps).

With 2 the segment kernel is `__launch_bounds__(THREADS, 2)` (ptxas fits 128 registers a thread, two
256-thread CTAs an SM) and its grid is at most 2 * SMS CTAs; every CTA must be resident at once (its
first task is its blockIdx), so a segment whose static shared memory does not fit twice an SM keeps 1,
and explain says why.  With 1 (the default) the kernels are those v43 measured, byte for byte."""
from __future__ import annotations

import functools
import re

import pytest

from codegen.bundle import bundle_key, plan_spec
from codegen import segments
from codegen.families import segment as family
from codegen.kernel import Options
from codegen.nvrtc import compile_cubin
from codegen.render import render_launch
from codegen.tuning import DEFAULT_TUNING, parse_tune

LITE = "model_specs/deepseek_v2_lite.yaml"
ON = ["persistent.segments=true"]


@functools.lru_cache(maxsize=None)
def _segments(ctas: int | None) -> dict:
    tune = ON + ([f"persistent.ctas_per_sm={ctas}"] if ctas else [])
    plan = plan_spec(LITE, Options(tuning=parse_tune(tune)), strict=False).plans["decode"]
    return {s.name: s for s in plan.launches if s.family == "segment"}


def _bounds(src: str) -> str:
    return re.search(r"__launch_bounds__\(THREADS, (\d+)\)", src).group(1)


def test_the_knob_is_off_by_default_and_in_the_cache_key():
    assert DEFAULT_TUNING.persistent.ctas_per_sm == 1
    two = parse_tune(ON + ["persistent.ctas_per_sm=2"])
    assert two.to_json()["persistent"]["ctas_per_sm"] == 2
    key = functools.partial(bundle_key, "spec", arch="sm_90", dtype="bf16", block_size=64)
    assert key(tuning=two) != key(tuning=parse_tune(ON))
    with pytest.raises(ValueError, match="ctas_per_sm"):
        parse_tune(["persistent.ctas_per_sm=3"])


def test_one_cta_an_sm_is_the_kernels_of_today():
    """1 spelled out gives the default's launches: the same names, grids and sources."""
    one, default = _segments(1), _segments(None)
    assert one.keys() == default.keys()
    for name, launch in default.items():
        assert "ctas" not in launch.params and launch.grid[0].startswith("min(SMS, ")
        assert render_launch(one[name]) == render_launch(launch)
        assert _bounds(render_launch(launch)) == "1"


def test_two_ctas_an_sm_bound_the_kernel_and_double_the_grid():
    one, two = _segments(None), _segments(2)
    assert len(two) == len(one) == 5 and not two.keys() & one.keys()     # the knob is in the names
    for launch in two.values():
        assert launch.params["ctas"] == 2 and "ctas_refused" not in launch.params
        assert launch.grid[0].startswith("min(2 * SMS, ")
        assert _bounds(render_launch(launch)) == "2"
    assert sorted(g.grid[0].replace("2 * SMS", "SMS") for g in two.values()) == sorted(g.grid[0] for g in one.values())


def test_a_segment_whose_shared_memory_does_not_fit_twice_keeps_one_cta(monkeypatch):
    assert family.ctas_refusal(8212 // 4, 2) is None and family.ctas_refusal(34836 // 4, 2) is None
    assert family.ctas_refusal(120 * 1024 // 4, 1) is None
    plain = plan_spec(LITE, Options(), strict=False).plans["decode"]
    seg = segments.find(plain)[0]
    members = [plain.steps[i] for i in seg.steps]
    monkeypatch.setattr(family, "smem_floats", lambda body: 120 * 1024 // 4)
    launch = family.launch(members, [segments.body(m) for m in members], seg.waits, lead=seg.lead, gate=None,
                           pdl=True, ctas=2)
    assert "shared memory" in launch.params["ctas_refused"] and "ctas" not in launch.params
    assert launch.grid[0].startswith("min(SMS, ") and _bounds(render_launch(launch)) == "1"


def test_explain_says_how_many_segments_run_two_ctas_an_sm():
    from runtime.cli_explain import explain_lines
    lines = explain_lines(LITE, tokens=[1], phases=("decode",), tuning=parse_tune(ON + ["persistent.ctas_per_sm=2"]))
    assert "ctas   2 an SM: 54 of 54" in [line.strip() for line in lines]
    assert not any(line.strip().startswith("ctas") for line in explain_lines(LITE, tokens=[1], phases=("decode",),
                                                                             tuning=parse_tune(ON)))


@pytest.mark.slow
@pytest.mark.parametrize("k", range(5))
def test_v2_lite_b1_segments_compile_for_two_ctas_an_sm_without_spills(k):
    """ptxas keeps every V2-Lite segment at <= 128 registers a thread (two 256-thread CTAs in an SM's
    64K registers) without spilling; their static shared memory fits twice."""
    name = sorted(_segments(2))[k]
    launch = _segments(2)[name]
    log = compile_cubin(render_launch(launch), name, arch="sm_90", options=("--ptxas-options=-v",)).log
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 128, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log and "0 bytes stack frame" in log, log
    smem = [int(b) for b in re.findall(r"(\d+) bytes smem", log)]
    assert smem and family.ctas_refusal(-(-max(smem) // 4), 2) is None, log
