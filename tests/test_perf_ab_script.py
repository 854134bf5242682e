"""tests/gpu/perf_ab.py, the bench A/B of switches, on the CPU: its arms, its trees, its table."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
import perf_ab  # noqa: E402

TICKETS = "templates/include/tickets.cuh"
OFF = f"sub {TICKETS} #define DSG_TICKETS_ACQ_REL 1=>#define DSG_TICKETS_ACQ_REL 0"


def test_arms_merge_their_edits_by_name_in_order():
    arms = perf_ab.parse_arms(["base", f"acq:{OFF}", "al:py codegen.families._moe_wgmma_skinny.ACT_EVICT_LAST=True",
                               "acq:py codegen.families.moe_expert_ffn.STAGED_FROM_BP=16"])
    assert [a.name for a in arms] == ["base", "acq", "al"]
    assert not arms[0].edits
    assert arms[1].subs == [(TICKETS, "#define DSG_TICKETS_ACQ_REL 1", "#define DSG_TICKETS_ACQ_REL 0")]
    assert arms[1].py == [("codegen.families.moe_expert_ffn", "STAGED_FROM_BP", 16)]
    assert arms[2].py == [("codegen.families._moe_wgmma_skinny", "ACT_EVICT_LAST", True)]


@pytest.mark.parametrize("bad", ["", "a b", "x:py NOATTR=1", "x:sub path no-arrow", "x:frob y",
                                 "x:py m.a=not_a_literal"])
def test_a_malformed_arm_is_refused(bad):
    with pytest.raises((ValueError, SyntaxError)):
        perf_ab.parse_arms([bad])


def test_an_arm_may_have_its_own_check():
    arms = perf_ab.parse_arms(["base", f"acq:{OFF}", "al:py m.a=1"])
    checks = perf_ab.parse_arm_checks(["acq=-j 8 tests/gpu/test_pdl.py -k 'route or x'"], arms)
    assert checks == {"acq": "-j 8 tests/gpu/test_pdl.py -k 'route or x'"}
    for bad in ("nope=tests/gpu/test_pdl.py", "acq", "acq=  "):
        with pytest.raises(ValueError):
            perf_ab.parse_arm_checks([bad], arms)


def test_an_arm_tree_is_the_checkout_with_its_edits(tmp_path):
    (arm,) = perf_ab.parse_arms([f"acq:{OFF}"])
    perf_ab.make_tree(perf_ab.ROOT, str(tmp_path), arm)
    assert "#define DSG_TICKETS_ACQ_REL 0" in (tmp_path / TICKETS).read_text()
    assert "#define DSG_TICKETS_ACQ_REL 0" not in open(os.path.join(perf_ab.ROOT, TICKETS)).read()
    assert (tmp_path / "runtime" / "cli.py").is_file() and not (tmp_path / ".venv").exists()
    (twice,) = perf_ab.parse_arms([f"x:sub {TICKETS} #=>//"])
    with pytest.raises(SystemExit, match="occurs"):
        perf_ab.make_tree(perf_ab.ROOT, str(tmp_path / "again"), twice)


def test_the_bench_command_sets_the_constants_first():
    (arm,) = perf_ab.parse_arms(["al:py codegen.families._moe_wgmma_skinny.ACT_EVICT_LAST=True"])
    cmd = perf_ab.bench_command(arm, ["--decode", "1x512"])
    code = cmd[-1]
    compile(code, "<perf_ab>", "exec")
    assert code.index("setattr(_m, 'ACT_EVICT_LAST', True)") < code.index("from runtime.cli import main")
    assert "main(['bench', *['--decode', '1x512']])" in code


def test_the_table_puts_every_round_of_every_arm_side_by_side():
    run = lambda ms, rate: {"decode": [{"batch": 256, "context": 512, "ms": ms,  # noqa: E731
                                        "routed_experts": {"bytes_per_s": rate}}]}
    table = perf_ab.summary({"base": [run(11.1, 3.92e12), run(11.2, 3.91e12)], "al": [run(11.0, 4.01e12)]})
    assert "| case | base | al |" in table
    assert "| b=256 ctx=512 | 11.10 (3.920) / 11.20 (3.910) | 11.00 (4.010) |" in table
