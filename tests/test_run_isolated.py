"""tests/gpu/run_isolated.py on the CPU, with a stand-in for pytest: each result is printed as
its test ends; a signal or the run's --budget stops the tests still running and prints what
finished; a hung test is a TIMEOUT."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "gpu", "run_isolated.py")

# A pytest stand-in: `--collect-only` lists the tests ($FAKE_TESTS, or five); a test `name_S` sleeps
# S seconds and passes (`fail` fails at once), writing its pid to PIDS first, so a test can check it was killed.
FAKE = textwrap.dedent("""
    import os, sys, time
    args = sys.argv[1:]
    if "--collect-only" in args:
        tests = os.environ.get("FAKE_TESTS", "t.py::slow_2,t.py::fast_0,t.py::fail,t.py::hang_60,t.py::later_0")
        print("\\n".join(tests.split(",")) + "\\n\\n5 tests collected")
        sys.exit(0)
    node = args[-1]
    name = node.split("::")[1] if "::" in node else node
    with open(os.environ["PIDS"], "a") as fh:
        fh.write(f"{name} {os.getpid()}\\n")
    if name == "fail":
        print("E   assert 1 == 2")
        print("1 failed in 0.01s")
        sys.exit(1)
    time.sleep(float(name.split("_")[1].split("[")[0]) if "_" in name else 0)
    print("1 passed in 0.01s")
""")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_pytest.py"
    script.write_text(FAKE)
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    return f"{sys.executable} {script}"


def _start(fake, *args):
    return subprocess.Popen([sys.executable, RUNNER, "--pytest", fake, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _pids(tmp_path) -> dict[str, int]:
    return {name: int(pid) for name, pid in (ln.split() for ln in (tmp_path / "pids").read_text().splitlines())}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_each_result_is_printed_as_its_test_ends_and_a_hang_is_a_timeout(fake, tmp_path):
    proc = _start(fake, "-j", "2", "--timeout", "4", "-k", "ignored")
    first = proc.stdout.readline()
    # slow_2 started first, but fast_0 ended first and is printed while slow_2 still runs
    assert first.split()[0] == "passed" and first.rstrip().endswith("t.py::fast_0"), first
    out = first + proc.stdout.read()
    assert proc.wait(timeout=60) == 1
    live, table = out.split("all done after")
    assert [ln.split()[-1] for ln in live.splitlines() if "t.py::" in ln][-1] in ("t.py::hang_60", "t.py::later_0")
    assert "    E   assert 1 == 2" in live
    rows = [ln.split() for ln in table.splitlines() if "t.py::" in ln]
    assert [(r[0], r[-1]) for r in rows] == [("passed", "t.py::slow_2"), ("passed", "t.py::fast_0"),
                                             ("FAILED", "t.py::fail"), ("TIMEOUT", "t.py::hang_60"),
                                             ("passed", "t.py::later_0")]
    assert table.rstrip().endswith("3 passed, 2 failed")
    assert _gone(_pids(tmp_path)["hang_60"])


@pytest.mark.slow     # waits out its 15 s budget
def test_the_budget_stops_the_run_and_prints_what_finished(fake, tmp_path):
    t0 = time.time()
    proc = _start(fake, "-j", "1", "--budget", "15")     # one at a time: later_0 waits behind hang_60
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.time() - t0 < 40
    table = out.split("stopped by the --budget after")[1]
    done = {ln.split()[-1]: ln.split()[0] for ln in table.splitlines() if "t.py::" in ln}
    assert done == {"t.py::slow_2": "passed", "t.py::fast_0": "passed", "t.py::fail": "FAILED",
                    "t.py::hang_60": "STOPPED"}, out
    assert "not started: 1 tests" in table
    assert "2 passed, 1 failed, 1 stopped, 1 not started" in table
    assert _gone(_pids(tmp_path)["hang_60"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_and_prints_what_finished(fake, tmp_path, sig):
    proc = _start(fake, "-j", "3")
    lines = []
    while not all(any(f"t.py::{t}" in ln for ln in lines) for t in ("fast_0", "fail")):
        lines.append(proc.stdout.readline())
        assert lines[-1], "".join(lines)
    t0 = time.time()
    while "hang_60" not in _pids(tmp_path):              # it started in the slot one of them left
        assert time.time() - t0 < 30
        time.sleep(0.05)
    proc.send_signal(sig)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=30) != 0
    table = out.split(f"stopped by {signal.Signals(sig).name} after")[1]
    done = {ln.split()[-1]: ln.split()[0] for ln in table.splitlines() if "t.py::" in ln}
    assert done["t.py::fast_0"] == "passed" and done["t.py::fail"] == "FAILED"
    assert done["t.py::hang_60"] == "STOPPED"
    assert _gone(_pids(tmp_path)["hang_60"])


@pytest.mark.parametrize("by, ran", [("test", ["p_0[a]", "p_0[b]", "q_0"]), ("function", ["p_0", "q_0"]),
                                     ("file", ["t.py"])])
def test_a_process_may_run_a_test_function_or_a_file(fake, tmp_path, monkeypatch, by, ran):
    monkeypatch.setenv("FAKE_TESTS", "t.py::p_0[a],t.py::p_0[b],t.py::q_0")
    proc = _start(fake, "-j", "1", "--group", by)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert list(_pids(tmp_path)) == ran
