"""A new user's install, for real: fresh virtual environments, pip, the `dsgraph` console script.

- The README's first command, run as written by bash in a copy of the checkout: it compiles
  the default bundle and installs no torch (the compiler does not need it).
- The wheel: built from the checkout, installed into a fresh virtual environment, and
  `dsgraph compile` run from another folder builds the default bundle, so the templates and
  the model specs are in the wheel.

Slow (each creates a virtual environment, installs the compiler's dependencies and compiles
DeepSeek-V2-Lite cold), but part of CI.  pip is used as configured on the machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from test_readme import FIRST_COMMAND, ROOT, blocks

pytestmark = pytest.mark.slow

# What a clean clone does not have (build outputs, virtual environments, caches).
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", ".ci-venv", "venv", "__pycache__", "*.egg-info", "build",
                                     "dist", "bundle", ".hypothesis", ".pytest_cache", ".whl", "out")
TIMEOUT = 1500


def _checkout_copy(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=_NOT_SOURCE, symlinks=True)
    return dest


def _env(tmp_path: Path) -> dict:
    """The caller's environment minus its virtual environment, with a private bundle cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env["DSGRAPH_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def _run(cmd, cwd, env, shell=False) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, shell=shell,
                       executable="/bin/bash" if shell else None)
    assert r.returncode == 0, f"{cmd}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    return r


def _installed(python: Path, env) -> set[str]:
    out = _run([str(python), "-m", "pip", "list", "--format=json"], cwd=python.parent, env=env).stdout
    return {p["name"].lower() for p in json.loads(out)}


# The default spec's distinct kernels (decode's and prefill's), as `dsgraph compile` counts them
V2_LITE_KERNELS = 32


def _check_default_bundle(out: str, bundle: Path) -> None:
    assert "spec     deepseek_v2_lite" in out and f"kernels  {V2_LITE_KERNELS} unique" in out, out
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["spec"]["name"] == "deepseek_v2_lite" and len(manifest["kernels"]) == V2_LITE_KERNELS


def test_readme_first_command_compiles_without_torch(tmp_path):
    assert FIRST_COMMAND in [b.strip() for b in blocks("bash")]
    repo = _checkout_copy(tmp_path / "dsgraph")
    env = _env(tmp_path)
    r = _run(FIRST_COMMAND, cwd=repo, env=env, shell=True)
    _check_default_bundle(r.stdout, repo / "bundle")
    python = repo / ".venv" / "bin" / "python"
    packages = _installed(python, env)
    assert "dsgraph" in packages and "nvidia-cuda-nvrtc" in packages
    assert not packages & {"torch", "triton", "numpy", "safetensors"}, sorted(packages)


def test_wheel_installs_and_compiles_from_another_folder(tmp_path):
    repo = _checkout_copy(tmp_path / "dsgraph")
    env = _env(tmp_path)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(repo)],
         cwd=tmp_path, env=env)
    (wheel,) = (tmp_path / "dist").glob("dsgraph-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("templates", "model_specs"):
        shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / data).rglob("*") if p.is_file()}
        assert {f"codegen/{p}" for p in shipped} <= names, f"{data}/ is not all in the wheel"
    # the timing tools and the tests are for developers, not users
    assert not {n for n in names if n.startswith(("bench/", "tests/"))}, "bench/ or tests/ in the wheel"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env)
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", str(wheel)], cwd=tmp_path, env=env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dsgraph = str(venv / "bin" / "dsgraph")
    version = _run([dsgraph, "--version"], cwd=elsewhere, env=env).stdout
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import codegen, os; print(os.path.dirname("
                      "os.path.dirname(codegen.__file__)))"], cwd=elsewhere, env=env).stdout.strip())
    assert version.startswith("dsgraph ") and f" from {site} " in version and str(venv) in str(site)
    r = _run([dsgraph, "compile"], cwd=elsewhere, env=env)
    _check_default_bundle(r.stdout, elsewhere / "bundle")
    assert f"({site / 'codegen' / 'model_specs' / 'deepseek_v2_lite.yaml'})" in r.stdout
    # a shipped spec by its name, from any folder (the same bundle: a cache hit)
    r = _run([dsgraph, "compile", "deepseek_v2_lite", "-o", "by_name"], cwd=elsewhere, env=env)
    _check_default_bundle(r.stdout, elsewhere / "by_name")
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "torch" not in _installed(venv / "bin" / "python", env)
