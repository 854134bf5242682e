"""bench/perf_segment.py on the CPU: its arms are the launches it says (the members' own, each member as a
one-member segment, the chain as one segment at each CTAs-an-SM setting), it refuses a bad chain or CTAs
count in one line, and --compile-only compiles every kernel it would time without spills."""
from __future__ import annotations

import subprocess
import sys

import pytest

from codegen.paths import REPO_ROOT


def test_the_arms_are_the_launches_singles_and_the_segment_at_each_ctas():
    from bench.perf_segment import arms
    got = arms("o_norm", "bf16", [1, 2])
    assert list(got) == ["launches", "single/1", "segment/1", "single/2", "segment/2"]
    assert [la.family for la in got["launches"]] == ["linear_skinny", "fused_add_rms_norm"]
    for ctas in (1, 2):
        assert [len(la.params["members"]) for la in got[f"single/{ctas}"]] == [1, 1]
        (seg,) = got[f"segment/{ctas}"]
        assert [m["kernel"] for m in seg.params["members"]] == [la.name for la in got["launches"]]
        assert seg.params.get("ctas", 1) == ctas and all(la.params.get("ctas", 1) == ctas
                                                         for la in got[f"single/{ctas}"])
    assert len(arms("mlp", "bf16", [2])["segment/2"][0].params["members"]) == 4


@pytest.mark.parametrize("argv", [["--chains", "attention"], ["--ctas", "3"]])
def test_a_bad_chain_or_ctas_stops_with_one_line(argv):
    r = subprocess.run([sys.executable, "-m", "bench.perf_segment", *argv, "--compile-only"], cwd=REPO_ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_compile_only_compiles_every_arm_without_spills():
    r = subprocess.run([sys.executable, "-m", "bench.perf_segment", "--compile-only", "--chains", "o_norm",
                        "--ctas", "1,2"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert {line.split()[1] for line in lines} == {"launches", "single/1", "segment/1", "single/2", "segment/2"}
    assert not any("SPILLS" in line for line in lines)
