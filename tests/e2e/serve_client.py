"""Start `dsgraph serve` in a subprocess for a test (the CPU tests here and tests/gpu's), and wait
until it answers."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_log(proc: subprocess.Popen) -> str:
    """What the server wrote to stderr so far (kept in a file: a pipe nobody reads could fill and
    stall the server)."""
    return Path(proc.log_path).read_text(encoding="utf-8", errors="replace")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {server_log(proc)[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError("the server did not answer /health in time")


def start_server(model_dir: Path, *args: str, timeout: float = 180.0) -> tuple[str, subprocess.Popen]:
    """`dsgraph serve model_dir *args` on a free port of 127.0.0.1, as a user starts it; (url, process)
    once /health answers."""
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)   # the caller's too
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    with tempfile.NamedTemporaryFile(prefix="dsgraph-serve-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", str(model_dir), "--port", str(port),
                                 "--log-level", "warning", *args],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    proc.log_path = log.name
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout)
    return url, proc
