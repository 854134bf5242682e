"""bench/perf_ab.py, the bench A/B of tuning options, on the CPU: its arms, the commands it runs,
its table."""
from __future__ import annotations

import sys

import pytest

from bench import perf_ab
from codegen.paths import REPO_ROOT


def test_arms_merge_their_options_by_name_in_order():
    arms = perf_ab.parse_arms(["base", "wide:--tune moe.expert_ffn_upto=128",
                               "two:--tune a.b=1 --tune=c.d=2", "wide:--no-pdl"])
    assert [a.name for a in arms] == ["base", "wide", "two"]
    assert arms[0].options == []
    assert arms[1].options == ["--tune", "moe.expert_ffn_upto=128", "--no-pdl"]
    assert arms[2].options == ["--tune", "a.b=1", "--tune=c.d=2"]


@pytest.mark.parametrize("bad", ["", "a b:--tune a.b=1", ":--tune a.b=1", "x:--tune", "x:--tune ab=1",
                                 "x:--tune a.b", "x:--tune=a.b", "x:tune a.b=1", "x:--decode 1x512",
                                 "x:--json=a.json", "x:--tune 'a.b=1"])
def test_a_malformed_arm_is_refused(bad):
    with pytest.raises(ValueError):
        perf_ab.parse_arms([bad])


def test_a_malformed_arm_is_one_line_from_main(capsys):
    with pytest.raises(SystemExit, match="perf_ab: arm x: --tune 'a.b' is not SECTION.KNOB=VALUE"):
        perf_ab.main(["--arm", "x:--tune a.b"])


def test_the_bench_command_passes_the_arm_options_to_dsgraph_bench_of_this_tree():
    (arm,) = perf_ab.parse_arms(["wide:--tune moe.expert_ffn_upto=128 --tune attention.cluster=4"])
    cmd = perf_ab.bench_command(arm, "1x512,8x512", "/tmp/x/wide_1.json")
    assert cmd == [sys.executable, "-m", "runtime.cli", "bench",
                   "--tune", "moe.expert_ffn_upto=128", "--tune", "attention.cluster=4",
                   "--no-transformers", "--prefill", "none", "--decode", "1x512,8x512", "--json", "/tmp/x/wide_1.json"]
    (base,) = perf_ab.parse_arms(["base"])
    assert perf_ab.bench_command(base, "1x512", "b.json")[3:5] == ["bench", "--no-transformers"]
    assert perf_ab.check_command("-j 8 tests/gpu/test_pdl.py -k 'route or x'") == \
        [sys.executable, "tests/gpu/run_isolated.py", "-j", "8", "tests/gpu/test_pdl.py", "-k", "route or x"]


def test_every_arm_runs_in_this_tree_round_by_round(tmp_path, monkeypatch, capsys):
    """No copy of the tree and no kernel cache of its own per arm: the cache key covers the tuning."""
    ran = []

    class Done:
        returncode = 0

    def fake_run(cmd, cwd=None, env=None, **kw):
        ran.append((cmd, cwd, env))
        if "--json" in cmd:
            ms = 2.0 if "--tune" in cmd else 2.1
            (tmp_path / cmd[cmd.index("--json") + 1]).write_text(
                '{"decode": [{"batch": 1, "context": 512, "ms": %s}]}' % ms)
        return Done()

    monkeypatch.setattr(perf_ab.subprocess, "run", fake_run)
    assert perf_ab.main(["--arm", "base", "--arm", "w:--tune moe.x=1", "--rounds", "2", "--decode", "1x512",
                         "--check", "-j 2 tests/gpu/test_pdl.py", "--out", str(tmp_path)]) == 0
    assert [c[0][1] for c in ran] == ["tests/gpu/run_isolated.py"] + ["-m"] * 4
    assert all(cwd == REPO_ROOT and env is None for _, cwd, env in ran)
    assert [c[0][c[0].index("--json") + 1].rsplit("/", 1)[1] for c in ran[1:]] == \
        ["base_1.json", "w_1.json", "base_2.json", "w_2.json"]
    out = capsys.readouterr().out
    assert "| b=1 ctx=512 | 2.10 / 2.10 | 2.00 / 2.00 |" in out
    # each arm's round printed as it ends, before the table
    lines = out.splitlines()
    order = ["perf_ab: w round 1: b=1 ctx=512 2.00 ms", "perf_ab: base round 2: b=1 ctx=512 2.10 ms",
             "| b=1 ctx=512 | 2.10 / 2.10 | 2.00 / 2.00 |"]
    assert [lines.index(o) for o in order] == sorted(lines.index(o) for o in order)


def test_the_table_puts_every_round_of_every_arm_side_by_side():
    run = lambda ms, rate: {"decode": [{"batch": 256, "context": 512, "ms": ms,  # noqa: E731
                                        "routed_experts": {"bytes_per_s": rate}}]}
    table = perf_ab.summary({"base": [run(11.1, 3.92e12), run(11.2, 3.91e12)], "al": [run(11.0, 4.01e12)]})
    assert "| case | base | al |" in table
    assert "| b=256 ctx=512 | 11.10 (3.920) / 11.20 (3.910) | 11.00 (4.010) |" in table


def test_prefill_cases_are_passed_and_tabled():
    (arm,) = perf_ab.parse_arms(["nf:--weights=fp8 --tune linear.norm_fp8=true"])   # a bench option's value: =
    cmd = perf_ab.bench_command(arm, "32x512", "nf_1.json", "32x512")
    assert cmd[cmd.index("--prefill") + 1] == "32x512"
    assert cmd[4:7] == ["--weights=fp8", "--tune", "linear.norm_fp8=true"]
    run = lambda tps: {"decode": [{"batch": 32, "context": 512, "ms": 8.1}],  # noqa: E731
                       "prefill": [{"batch": 32, "length": 512, "ms": 142.0, "tokens_per_s": tps}]}
    assert perf_ab.arm_line("nf", 1, run(116400.0)) == \
        "perf_ab: nf round 1: b=32 ctx=512 8.10 ms, prefill 32x512 116.4k tok/s"
    table = perf_ab.summary({"base": [run(115300.0)], "nf": [run(116400.0)]})
    assert table.index("| b=32 ctx=512 | 8.10 | 8.10 |") < \
        table.index("| prefill 32x512 | 115.3k tok/s | 116.4k tok/s |")
