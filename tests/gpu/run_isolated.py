"""Run GPU tests one pytest process per test, several at a time, and print one table.

A kernel that faults (a misaligned or out-of-bounds access) loses the CUDA context of its
process: every later test in that process would fail with it.  One process per test keeps
each result its own, and a few processes share the GPU at once.

    python3 tests/gpu/run_isolated.py [-j 4] [--wrap "compute-sanitizer --tool memcheck"]
                                      [--log-dir DIR] [--timeout S] [PYTEST_ARGS... e.g. tests/gpu -k mla]

A test still running after --timeout seconds (a kernel that never finishes) is killed, with
everything it started, and counts as TIMEOUT, a failure: one hang cannot hold the whole run.

Exit status 0 only when every test passed (or was skipped).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def collect(pytest_args: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *pytest_args], cwd=ROOT, capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        sys.exit(f"run_isolated: pytest collected no tests from {pytest_args}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def run_one(node: str, wrap: list[str], log_dir: Path | None, timeout: float) -> tuple[str, str, float, str]:
    t0 = time.time()
    cmd = [*wrap, sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", node]
    # its own process group, so a timeout kills the sanitizer wrapper and pytest together
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    text = out + err
    if log_dir is not None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)[-150:]
        (log_dir / f"{safe}.log").write_text(text)
    last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
    if timed_out:
        status = "TIMEOUT"
    elif proc.returncode == 0:
        status = "skipped" if " skipped" in last[0] and " passed" not in last[0] else "passed"
    else:
        status = "FAILED"
    summary = "\n".join(ln for ln in text.splitlines()
                        if ln.startswith(("EXAMPLES", "E2E", "E   ", "FAILED", "=========")) or "ERROR SUMMARY" in ln)
    return node, status, time.time() - t0, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-j", type=int, default=4, help="tests at a time (default: 4)")
    ap.add_argument("--wrap", default="", help="a command each pytest process runs under (default: none)")
    ap.add_argument("--log-dir", default=None, help="keep each test's full output here (default: not kept)")
    ap.add_argument("--timeout", type=float, default=240.0,
                    help="seconds one test may run before it is killed as TIMEOUT (default: 240; the "
                         "slowest test took 70 s at -j 8 on the H200; raise it under a sanitizer)")
    args, pytest_args = ap.parse_known_args(argv)
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    nodes = collect(pytest_args or ["tests/gpu"])
    wrap = shlex.split(args.wrap)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with ThreadPoolExecutor(max_workers=max(1, args.j)) as pool:
        results = list(pool.map(lambda n: run_one(n, wrap, log_dir, args.timeout), nodes))
    bad = 0
    for node, status, secs, summary in results:
        print(f"{status:8s} {secs:6.1f}s  {node}")
        if summary:
            print("    " + summary.replace("\n", "\n    "))
        bad += status in ("FAILED", "TIMEOUT")
    print(f"{len(results) - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
