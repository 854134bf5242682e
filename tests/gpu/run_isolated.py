"""Run GPU tests one pytest process per test, several at a time, and print one table.

A kernel that faults (a misaligned or out-of-bounds access) loses the CUDA context of its
process: every later test in that process would fail with it.  One process per test keeps
each result its own, and a few processes share the GPU at once.

    python3 tests/gpu/run_isolated.py [-j 4] [--wrap "compute-sanitizer --tool memcheck"]
                                      [--log-dir DIR] [--timeout S] [--budget S] [--group function]
                                      [PYTEST_ARGS... e.g. tests/gpu -k mla]

Each test's result line is printed (and flushed) as soon as it ends; at the end, the table of all
of them in test order.  A test still running after --timeout seconds (a kernel that never
finishes) is killed, with everything it started, and counts as TIMEOUT, a failure: one hang cannot
hold the whole run.  On SIGTERM or SIGINT, or once the whole run has taken --budget seconds, the
tests still running are killed and the table of what finished is printed, with what was stopped
and how many never started: a run cut short by a time limit still leaves its record.

Exit status 0 only when every test passed (or was skipped) and the run was not stopped.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def collect(pytest_cmd: list[str], pytest_args: list[str]) -> list[str]:
    out = subprocess.run([*pytest_cmd, "--collect-only", "-q", "-p", "no:cacheprovider", *pytest_args],
                         cwd=ROOT, capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        sys.exit(f"run_isolated: pytest collected no tests from {pytest_args}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def group(nodes: list[str], by: str) -> list[str]:
    """The node ids one process each runs: tests, test functions (pytest runs every parametrization
    of `file::function`) or files, in collection order."""
    if by == "function":
        nodes = [n.split("[", 1)[0] for n in nodes]
    elif by == "file":
        nodes = [n.split("::", 1)[0] for n in nodes]
    return list(dict.fromkeys(nodes))


class Run:
    """One test's pytest process: its output goes to a file (a pipe left unread would block it)."""

    def __init__(self, node: str, cmd: list[str]):
        self.node, self.t0 = node, time.time()
        self.out = tempfile.TemporaryFile(mode="w+")
        # its own process group, so a timeout kills the sanitizer wrapper and pytest together
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def secs(self) -> float:
        return time.time() - self.t0

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def result(self, timed_out: bool, log_dir: Path | None) -> tuple[str, str, float, str]:
        self.out.seek(0)
        text = self.out.read()
        self.out.close()
        if log_dir is not None:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.node)[-150:]
            (log_dir / f"{safe}.log").write_text(text)
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
        if timed_out:
            status = "TIMEOUT"
        elif self.proc.returncode == 0:
            status = "skipped" if " skipped" in last[0] and " passed" not in last[0] else "passed"
        else:
            status = "FAILED"
        summary = "\n".join(ln for ln in text.splitlines()
                            if ln.startswith(("EXAMPLES", "E2E", "E   ", "FAILED", "=========")) or "ERROR SUMMARY" in ln)
        return self.node, status, self.secs(), summary


def row(node: str, status: str, secs: float, summary: str = "") -> str:
    text = f"{status:8s} {secs:6.1f}s  {node}"
    return text + ("\n    " + summary.replace("\n", "\n    ") if summary else "")


def run_all(nodes: list[str], pytest_cmd: list[str], wrap: list[str], jobs: int, timeout: float,
            deadline: float, log_dir: Path | None) -> tuple[list, list, list[str], str | None]:
    """Runs every node, `jobs` at a time, printing each result as it ends.  Returns (results,
    (node, seconds) of those still running when stopped, those never started, why it stopped: a
    signal's name, "the --budget", or None)."""
    pending, running, results = list(nodes), [], []
    stopped: list[str] = []

    def on_signal(signum, frame):
        stopped.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while (pending or running) and not stopped:
            while pending and len(running) < jobs:
                node = pending.pop(0)
                running.append(Run(node, [*wrap, *pytest_cmd, "-q", "-s", "-p", "no:cacheprovider", node]))
            time.sleep(0.05)
            for r in list(running):
                timed_out = r.proc.poll() is None and r.secs() > timeout
                if timed_out:
                    r.kill()
                if r.proc.poll() is not None:
                    running.remove(r)
                    results.append(r.result(timed_out, log_dir))
                    print(row(*results[-1]), flush=True)
            if time.time() > deadline and not stopped:
                stopped.append("the --budget")
        cut = [(r.node, r.secs()) for r in running]
        for r in running:
            r.kill()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return results, cut, pending, (stopped[0] if stopped else None)


def main(argv=None) -> int:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-j", type=int, default=4, help="tests at a time (default: 4)")
    ap.add_argument("--wrap", default="", help="a command each pytest process runs under (default: none)")
    ap.add_argument("--log-dir", default=None, help="keep each test's full output here (default: not kept)")
    ap.add_argument("--timeout", type=float, default=240.0,
                    help="seconds one test may run before it is killed as TIMEOUT (default: 240; the "
                         "slowest test took 70 s at -j 8 on the H200; raise it under a sanitizer)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds the whole run may take, collection included: then the tests still "
                         "running are stopped and the table so far printed (default: no limit)")
    ap.add_argument("--group", choices=("test", "function", "file"), default="test",
                    help="what one process runs: one test (default), every parametrization of one test "
                         "function, or one file; fewer processes start, but a fault takes its group's "
                         "later tests down with it")
    ap.add_argument("--pytest", default=None, help=argparse.SUPPRESS)   # the CPU tests' stand-in for pytest
    args, pytest_args = ap.parse_known_args(argv)
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    pytest_cmd = shlex.split(args.pytest) if args.pytest else [sys.executable, "-m", "pytest"]
    nodes = group(collect(pytest_cmd, pytest_args or ["tests/gpu"]), args.group)
    wrap = shlex.split(args.wrap)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    deadline = t_start + args.budget if args.budget is not None else float("inf")
    results, cut, never, why = run_all(nodes, pytest_cmd, wrap, max(1, args.j), args.timeout, deadline, log_dir)
    order = {n: i for i, n in enumerate(nodes)}
    bad = sum(status in ("FAILED", "TIMEOUT") for _, status, _, _ in results)
    print(f"\n{'stopped by ' + why if why else 'all done'} after {time.time() - t_start:.0f} s; in test order:")
    for res in sorted(results, key=lambda r: order[r[0]]):
        print(row(*res))
    for node, secs in cut:
        print(row(node, "STOPPED", secs))
    if never:
        print(f"not started: {len(never)} tests")
    print(f"{len(results) - bad} passed, {bad} failed" + (f", {len(cut)} stopped, {len(never)} not started" if why else ""),
          flush=True)
    return 1 if bad or why else 0


if __name__ == "__main__":
    sys.exit(main())
