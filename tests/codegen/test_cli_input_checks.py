"""Bad option values, paths and environment reach the user as one line naming what they gave and
what is accepted, before anything expensive runs (a compile, a model load, a benchmark) and never
as a traceback or a silently different run."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import codegen.nvrtc as nvrtc
from codegen.bundle import MAX_BLOCK_SIZE, BundleError, compile_bundle
from codegen.cache import BundleCache, CacheDirError
from codegen.paths import MODEL_SPECS_DIR
from runtime.cli import main

TINY = str(MODEL_SPECS_DIR / "deepseek_tiny.yaml")
TINY_CONFIG = str(MODEL_SPECS_DIR / "hf_configs" / "deepseek_tiny.json")
RANDOM = ["generate", "--random-weights", "--spec", TINY, "--ids", "1", "--backend", "reference", "--device", "cpu"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def no_compile(monkeypatch):
    """Any NVRTC compile fails the test: the check under test must come first."""
    def refuse(*a, **kw):
        raise AssertionError("compiled a kernel before checking the options")
    monkeypatch.setattr(nvrtc, "compile_cubin", refuse)


@pytest.fixture
def fake_nvrtc(monkeypatch):
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda src, name, **kw: nvrtc.CompileResult(b"CUBIN", ""))


def one_line_error(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert err.startswith("dsgraph: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def option_error(capsys, argv, *words) -> None:
    """argparse refuses the value at the option: exit 2, the option and the words in its message."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    for w in words:
        assert w in last, last


# -- compile ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_999", "sm_1000"])
def test_an_arch_nvrtc_cannot_target_is_one_line(tmp_path, capsys, no_compile, arch):
    assert main(["compile", TINY, "-o", str(tmp_path / "b"), "--arch", arch]) == 2
    one_line_error(capsys, f"cannot target {arch}", "it supports sm_")


@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_89", "sm_10"])
def test_an_arch_older_than_hopper_says_what_is_supported(tmp_path, capsys, no_compile, arch):
    assert main(["compile", TINY, "-o", str(tmp_path / "b"), "--arch", arch]) == 2
    one_line_error(capsys, "written for Hopper GPUs (compute capability 9.0: H100, H200)", f"{arch} is older",
                   "sm_90 or sm_90a")


def test_the_arch_error_is_a_dsgraph_error_and_still_a_value_error():
    with pytest.raises(nvrtc.ArchError) as info:
        nvrtc.check_target("sm_70")
    assert isinstance(info.value, ValueError) and isinstance(info.value, nvrtc.DsgraphError)


def test_a_cache_folder_that_is_a_file_is_one_line(tmp_path, capsys, monkeypatch, no_compile):
    afile = tmp_path / "notes.json"
    afile.write_text("{}")
    assert main(["compile", TINY, "-o", str(tmp_path / "b"), "--cache-dir", str(afile)]) == 2
    one_line_error(capsys, f"bundle cache folder {afile} is a file, not a folder")
    monkeypatch.setenv("DSGRAPH_CACHE_DIR", str(afile))
    assert main(["compile", TINY, "-o", str(tmp_path / "b")]) == 2
    one_line_error(capsys, f"bundle cache folder {afile} (from $DSGRAPH_CACHE_DIR) is a file")
    assert main(["compile", TINY, "-o", str(tmp_path / "b"), "--cache-dir", str(afile / "sub")]) == 2
    one_line_error(capsys, f"bundle cache folder {afile / 'sub'} cannot be created")


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path):
    root = tmp_path / "cache"

    def build(tmp: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp / "kernels"))
    with pytest.raises(CacheDirError, match=f"bundle cache folder {root} cannot be written: Permission denied"):
        BundleCache(root).get_or_build("ab" * 32, build)

    def elsewhere(tmp: Path) -> None:     # an OSError about another path is not the cache's
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "other"))
    with pytest.raises(PermissionError):
        BundleCache(root).get_or_build("cd" * 32, elsewhere)


def test_an_output_path_under_a_file_is_refused_before_compiling(tmp_path, capsys, cache_dir, no_compile):
    afile = tmp_path / "tiny.json"
    afile.write_text("{}")
    assert main(["compile", TINY, "-o", str(afile / "sub")]) == 2
    one_line_error(capsys, f"cannot write the bundle to {afile / 'sub'}", f"{afile} is a file, not a folder")
    assert not list(cache_dir.glob("*/*/manifest.json"))


def test_an_output_path_that_cannot_be_written_names_the_users_path(tmp_path, capsys, monkeypatch, fake_nvrtc):
    import codegen.bundle as bundle
    out = tmp_path / "out"

    def copytree(src, dst, **kw):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(dst))
    monkeypatch.setattr(bundle.shutil, "copytree", copytree)
    assert main(["compile", TINY, "-o", str(out)]) == 2
    err = one_line_error(capsys, f"cannot write the bundle to {out}: No such file or directory")
    assert ".tmp-" not in err


def test_an_unreadable_spec_is_one_line(tmp_path, capsys, no_compile):
    binary = tmp_path / "x.yaml"
    binary.write_bytes(b"\xff\xfe\x00 not yaml")
    assert main(["compile", str(binary), "-o", str(tmp_path / "b")]) == 2
    one_line_error(capsys, str(binary), "not UTF-8 text")


@pytest.mark.parametrize("argv, words", [
    (["--jobs", "0"], ["--jobs", "must be a whole number >= 1, got 0"]),
    (["--jobs", "-3"], ["--jobs", ">= 1"]),
    (["--tp", "0"], ["--tp", ">= 1"]),
    (["--block-size", "0"], ["--block-size", f"from 1 to {MAX_BLOCK_SIZE}"]),
    (["--block-size", str(MAX_BLOCK_SIZE + 1)], ["--block-size", f"from 1 to {MAX_BLOCK_SIZE}"]),
    (["--block-size", "99999999999999999999"], ["--block-size", f"from 1 to {MAX_BLOCK_SIZE}"]),
    (["--block-size", "4.5"], ["--block-size", "expected a whole number"]),
])
def test_compile_option_values_are_checked_at_the_option(tmp_path, capsys, no_compile, argv, words):
    option_error(capsys, ["compile", TINY, "-o", str(tmp_path / "b"), *argv], *words)


def test_diff_block_size_is_checked_at_the_option(capsys):
    option_error(capsys, ["diff", TINY, TINY, "--block-size", "0"], "--block-size", "from 1 to")


@pytest.mark.parametrize("kw, match", [(dict(block_size=MAX_BLOCK_SIZE + 1), "block_size"),
                                      (dict(jobs=0), "jobs"), (dict(jobs=-3), "jobs")])
def test_compile_bundle_refuses_what_the_kernels_and_the_compiler_cannot_take(tmp_path, no_compile, kw, match):
    with pytest.raises(BundleError, match=match):
        compile_bundle(TINY, cache_dir=tmp_path / "c", progress=False, **kw)


# -- generate -----------------------------------------------------------------------------

@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "abc", "RANK": "0"}, ["WORLD_SIZE='abc'", "whole number"]),
    ({"RANK": "1"}, ["RANK=1 is set but WORLD_SIZE is not", "torchrun"]),
    ({"WORLD_SIZE": "2"}, ["WORLD_SIZE=2 is set but RANK is not"]),
    ({"WORLD_SIZE": "2", "RANK": "2"}, ["RANK=2 and WORLD_SIZE=2", "0..WORLD_SIZE-1"]),
])
def test_torchruns_environment_is_checked(capsys, monkeypatch, env, words):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(RANDOM) == 2
    one_line_error(capsys, *words)


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1", ""])
def test_ids_with_an_empty_item_are_refused(capsys, ids):
    argv = [a if a != "1" else ids for a in RANDOM]
    assert main(argv) == 2
    one_line_error(capsys, "--ids must be comma-separated integers with no empty item")


def test_model_and_random_weights_are_exclusive(tmp_path, capsys):
    option_error(capsys, ["generate", "--model", str(tmp_path), "--random-weights", "--ids", "1"],
                 "--random-weights", "not allowed with argument --model")


@pytest.mark.parametrize("argv, words", [
    (["--temperature", "-1"], ["temperature must be a finite number >= 0"]),
    (["--top-p", "0"], ["--top-p must be in (0, 1]"]),              # the engine's message, in CLI terms
    (["--max-new-tokens", "0"], ["--max-new-tokens must be an integer >= 1"]),
    (["--device", ""], ["device '' is not a torch device"]),
])
def test_pure_argument_errors_come_before_the_model_loads(tmp_path, capsys, argv, words):
    """A missing checkpoint would be a WeightError: the option's own error is reported first."""
    assert main(["generate", "--model", str(tmp_path / "missing"), "--ids", "1", "--backend", "reference",
                 *argv]) == 2
    one_line_error(capsys, *words)


@pytest.mark.parametrize("argv, words", [
    (["--block-size", "99999999999999999999"], ["--block-size", "from 1 to"]),
    (["--max-seq-len", "0"], ["--max-seq-len", ">= 1"]),
    (["--tp", "0"], ["--tp", ">= 1"]),
])
def test_generate_option_values_are_checked_at_the_option(capsys, argv, words):
    option_error(capsys, [*RANDOM, *argv], *words)


def test_a_broken_tokenizer_says_why(tmp_path, capsys):
    pytest.importorskip("transformers")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{corrupt")
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--backend", "reference",
                 "--device", "cpu"]) == 2
    one_line_error(capsys, "--prompt needs a tokenizer", "cannot read it from tokenizer.json")
    (model / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--backend", "reference",
                 "--device", "cpu"]) == 2
    one_line_error(capsys, f"(none in {model})")


# -- spec --------------------------------------------------------------------------------

def test_a_config_that_is_a_folder_or_empty_says_so(tmp_path, capsys):
    assert main(["spec", "--from-config", str(tmp_path)]) == 2
    one_line_error(capsys, "is a folder")
    empty = tmp_path / "config.json"
    empty.write_text("\n")
    assert main(["spec", "--from-config", str(empty)]) == 2
    one_line_error(capsys, "is empty")
    if os.path.exists(os.devnull):       # not a regular file: read as one (a pipe works the same way)
        assert main(["spec", "--from-config", os.devnull]) == 2
        one_line_error(capsys, "not valid JSON")


def test_a_config_from_a_pipe_is_read(tmp_path, capsys):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    import threading
    writer = threading.Thread(target=lambda: fifo.write_text(Path(TINY_CONFIG).read_text()))
    writer.start()
    assert main(["spec", "--from-config", str(fifo)]) == 0
    writer.join()
    assert "deepseek_tiny" in capsys.readouterr().out


# -- bench -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--iters", "0"], ["--iters", ">= 1"]),
    (["--block-size", "0"], ["--block-size", "from 1 to"]),
])
def test_bench_option_values_are_checked_at_the_option(capsys, argv, words):
    option_error(capsys, ["bench", *argv], *words)


def test_bench_json_path_is_checked_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--json", "nodir/x.json"]) == 2
    one_line_error(capsys, "--json nodir/x.json: its folder nodir does not exist")
    assert main(["bench", "--json", str(tmp_path)]) == 2
    one_line_error(capsys, "is a folder")


# -- plan --------------------------------------------------------------------------------

def test_plan_gpus_lists_refused_counts_and_plans_the_rest(capsys):
    assert main(["plan", TINY, "--gpus", "2,3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [p["gpus"] for p in d["plans"]] == [2] and list(d["refused"]) == ["3"]
