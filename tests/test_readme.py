"""The README is true: every command in it that needs no GPU runs here, as written.

README code blocks are sorted by their info string: ``bash`` and ``python`` blocks are things
to run, anything else (``text`` synopses, YAML, console transcripts) is illustration.  Each
runnable block is either run below, one of the two setup commands (the first one runs in a
fresh virtual environment in tests/test_packaging.py; the second is CI itself, so .ci/run
must be exactly it), or GPU-only, and a new block that is none of these fails the suite.

`dsgraph ...` lines run through `runtime.cli.main`, the console script's entry point, in a
folder where the README's relative paths resolve; tests/test_packaging.py runs the
installed console script itself.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"

FIRST_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && dsgraph compile"
# the checkpoint-to-text example (docs/TESTING.md holds the GPU suite's commands)
GPU_MARKERS = ('device="cuda"', "tests/gpu/run_isolated.py")


def blocks(kind: str | None = None) -> list[str]:
    """The README's fenced code blocks (of one info string, or all)."""
    found = re.findall(r"^```([^\n]*)\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    return [body for info, body in found if kind is None or info.strip() == kind]


def _setup_commands() -> list[str]:
    return [b.strip() for b in blocks("bash") if b.strip().startswith("python3 -m venv")]


def _is_gpu(block: str) -> bool:
    return any(m in block for m in GPU_MARKERS)


def _runnable_bash() -> list[str]:
    return [b for b in blocks("bash") if not b.strip().startswith("python3 -m venv") and not _is_gpu(b)]


def _runnable_python() -> list[str]:
    return [b for b in blocks("python") if not _is_gpu(b)]


def test_every_runnable_block_is_accounted_for():
    runnable = blocks("bash") + blocks("python")
    setup, gpu = _setup_commands(), [b for b in runnable if _is_gpu(b)]
    assert setup == [FIRST_COMMAND, ci_command()]
    assert len(gpu) == 1, "a new GPU-only README block: list it here on purpose"
    assert len(runnable) == len(setup) + len(gpu) + len(_runnable_bash()) + len(_runnable_python())
    assert _runnable_bash() and _runnable_python()
    assert {info.strip() for info in re.findall(r"^```([^\n]*)\n.*?^```", README.read_text(), re.M | re.S)} <= \
        {"", "bash", "python", "text", "yaml"}


def ci_command() -> str:
    """The command .ci/run runs: its one line that starts a virtual environment."""
    lines = [line.strip() for line in CI.read_text().splitlines() if line.startswith("python3 -m venv")]
    assert len(lines) == 1, ".ci/run should run one command: the README's test command"
    return lines[0]


def test_ci_runs_exactly_the_readme_test_command():
    test_command = _setup_commands()[1]
    assert test_command == ci_command()
    # The tests' torch comes from an explicit CPU index, never a bare `pip install torch`.
    assert "pip install torch==" in test_command and "--index-url https://download.pytorch.org/whl/cpu" in test_command
    assert "torch" not in FIRST_COMMAND


@pytest.fixture
def repo_cwd(tmp_path, monkeypatch):
    """A folder where the README's relative paths (model_specs/...) resolve, outputs land in tmp."""
    (tmp_path / "model_specs").symlink_to(ROOT / "model_specs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def _dsgraph(line: str, capsys) -> tuple[int, str, str]:
    from runtime.cli import main
    argv = shlex.split(line, comments=True)
    assert argv[0] == "dsgraph", line
    try:
        rc = main(argv[1:])
    except SystemExit as e:          # --version / --help exit through argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow
def test_readme_cli_examples_run_as_written(repo_cwd, capsys):
    (block,) = _runnable_bash()
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 5
    results = {}
    for line in lines:
        rc, out, err = _dsgraph(line, capsys)
        assert rc == 0, f"{line}\n{out}\n{err}"
        results[shlex.split(line)[1]] = out + err
    assert results["--version"].startswith("dsgraph ")
    assert (repo_cwd / "my_tiny.yaml").is_file()
    assert (repo_cwd / "bundle_tiny" / "manifest.json").is_file() and "kernels  33 unique" in results["compile"]
    assert "0 changed, 0 added, 0 removed, 33 identical kernels" in results["diff"]
    ids = next(line for line in results["generate"].splitlines() if line.startswith("ids:"))
    assert len(ids.split(":")[1].split(",")) == 8 and "(length)" in results["generate"]


def test_readme_python_example_runs_as_written(repo_cwd, capsys):
    (block,) = _runnable_python()
    exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip()
    ids, reason = printed.rsplit(" ", 1)
    assert len(eval(ids)) == 8 and reason == "length"


def test_readme_spec_error_is_what_dsgraph_prints(repo_cwd, capsys):
    """The console transcript under "The spec": the same broken spec gives the same line."""
    text = README.read_text()
    command, shown = re.search(r"^\$ (dsgraph compile broken\.yaml)\s+#.*\n(dsgraph: error: .*)$", text, re.M).groups()
    good = "sizes: [kv_lora_rank, qk_rope_head_dim]"
    spec = (ROOT / "model_specs" / "deepseek_v2_lite.yaml").read_text()
    assert spec.count(good) == 1
    (repo_cwd / "broken.yaml").write_text(spec.replace(good, "sizes: [kv_lora_rank, qk_nope_head_dim]"))
    rc, out, err = _dsgraph(command, capsys)
    assert rc == 2 and err.strip() == shown


def test_readme_is_for_users_and_its_paths_exist():
    """At most 250 lines, docs/ linked once, and every repository path it names is there."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert len(re.findall(r"\]\((docs/[^)]*)\)", text)) == 1
    tops = ("model_specs/", "ir/", "codegen/", "templates/", "runtime/", "tests/", "bench/", "docs/", ".ci/")
    named = {p for p in re.findall(r"`([^`\s]+)`", text) if p.startswith(tops) and not set(p) & set("*{<")}
    assert named, "the README names no repository path"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
