"""The bundle cache: its key covers exactly its inputs; entries are built once,
verified on lookup, rebuilt when damaged; concurrent builders of one key build
it once."""
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.cache import (BundleCache, CacheError, cache_key, compiler_source_hash,
                           default_cache_dir, write_atomic)

FIELDS = ("spec_text", "template_texts", "compiler_hash", "nvrtc_version", "arch", "options")

inputs = st.fixed_dictionaries({
    "spec_text": st.text(max_size=40),
    "template_texts": st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=20),
                                      min_size=1, max_size=4),
    "compiler_hash": st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    "nvrtc_version": st.tuples(st.integers(12, 14), st.integers(0, 9)),
    "arch": st.sampled_from(["sm_80", "sm_90", "sm_90a", "sm_100a"]),
    "options": st.dictionaries(st.sampled_from(["lineinfo", "max_regs", "split_k"]),
                               st.one_of(st.booleans(), st.integers(0, 255))),
})


def perturb(field, value):
    if field in ("spec_text", "compiler_hash"):
        return value + "x"
    if field == "template_texts":
        path = sorted(value)[0]  # change one template's text only
        return {**value, path: value[path] + "\n"}
    if field == "nvrtc_version":
        return (value[0], value[1] + 1)
    if field == "arch":
        return value + "a" if not value.endswith("a") else value[:-1]
    return {**value, "__perturbed__": 1}


@settings(max_examples=60, deadline=None)
@given(inputs, st.sampled_from(FIELDS))
def test_key_changes_with_each_input_and_only_then(kw, field):
    key = cache_key(**kw)
    # Equal inputs built afresh (dicts in another order) give the same key.
    same = {**kw, "template_texts": dict(reversed(list(kw["template_texts"].items()))),
            "options": dict(reversed(list(kw["options"].items())))}
    assert cache_key(**same) == key
    assert cache_key(**{**kw, field: perturb(field, kw[field])}) != key


def test_compiler_source_hash(tmp_path):
    (tmp_path / "ir").mkdir()
    (tmp_path / "codegen").mkdir()
    (tmp_path / "ir" / "a.py").write_text("x = 1\n")
    (tmp_path / "codegen" / "b.py").write_text("y = 2\n")
    (tmp_path / "codegen" / "notes.txt").write_text("ignored\n")
    h = compiler_source_hash(tmp_path)
    (tmp_path / "codegen" / "notes.txt").write_text("still ignored\n")
    assert compiler_source_hash(tmp_path) == h
    (tmp_path / "ir" / "a.py").write_text("x = 2\n")
    assert compiler_source_hash(tmp_path) != h
    assert len(compiler_source_hash()) == 64


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DSGRAPH_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DSGRAPH_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "dsgraph"


KEY = "ab" + "0" * 62


def build_bundle(out: Path, counter_dir: Path | None = None, delay: float = 0.0) -> None:
    if counter_dir is not None:
        (counter_dir / f"build-{os.getpid()}-{time.monotonic_ns()}").touch()
    time.sleep(delay)
    write_atomic(out / "kernels" / "k.cu", b"// source\n")
    write_atomic(out / "kernels" / "k.cubin", b"\x7fELF" + bytes(range(64)))
    write_atomic(out / "manifest.json", json.dumps({"schema": 1}).encode())


def test_builds_once_then_hits(tmp_path):
    cache = BundleCache(tmp_path / "cache")
    calls = []
    path, built = cache.get_or_build(KEY, lambda d: (calls.append(d), build_bundle(d)))
    assert built and path == cache.entry(KEY) == tmp_path / "cache" / "ab" / KEY
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["schema"] == 1
    assert set(manifest["files"]) == {"kernels/k.cu", "kernels/k.cubin"}
    path2, built2 = cache.get_or_build(KEY, lambda d: pytest.fail("rebuilt a good entry"))
    assert (path2, built2) == (path, False)
    assert len(calls) == 1
    assert cache.lookup(KEY) == path
    # No temporary folders are left behind.
    assert sorted(p.name for p in path.parent.iterdir()) == [KEY, KEY + ".lock"]


def test_corrupted_file_is_detected_and_rebuilt(tmp_path):
    cache = BundleCache(tmp_path)
    path, _ = cache.get_or_build(KEY, build_bundle)
    cubin = path / "kernels" / "k.cubin"
    data = bytearray(cubin.read_bytes())
    data[5] ^= 0xFF
    cubin.write_bytes(bytes(data))
    assert cache.lookup(KEY) is None
    assert not path.exists()  # the damaged entry was removed
    path2, built = cache.get_or_build(KEY, build_bundle)
    assert built and cache.lookup(KEY) == path2


def test_missing_file_is_damage(tmp_path):
    cache = BundleCache(tmp_path)
    path, _ = cache.get_or_build(KEY, build_bundle)
    (path / "kernels" / "k.cu").unlink()
    _, built = cache.get_or_build(KEY, build_bundle)
    assert built


def test_entry_without_manifest_is_ignored_and_rebuilt(tmp_path):
    cache = BundleCache(tmp_path)
    half = cache.entry(KEY)  # what a crash mid-write could leave behind
    (half / "kernels").mkdir(parents=True)
    (half / "kernels" / "k.cubin").write_bytes(b"\x7fELF")
    assert cache.lookup(KEY) is None
    path, built = cache.get_or_build(KEY, build_bundle)
    assert built and (path / "manifest.json").is_file()


def test_failed_build_leaves_nothing(tmp_path):
    cache = BundleCache(tmp_path)

    def boom(d):
        (d / "partial").write_text("x")
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        cache.get_or_build(KEY, boom)
    with pytest.raises(CacheError, match="manifest"):
        cache.get_or_build(KEY, lambda d: None)
    assert sorted(p.name for p in (tmp_path / "ab").iterdir()) == [KEY + ".lock"]


def test_bad_key_is_rejected(tmp_path):
    with pytest.raises(ValueError):
        BundleCache(tmp_path).entry("../etc")


def _worker(root, counter_dir, result_dir, barrier):
    barrier.wait()
    path, built = BundleCache(root).get_or_build(
        KEY, lambda d: build_bundle(d, Path(counter_dir), delay=0.3))
    (Path(result_dir) / str(os.getpid())).write_text(json.dumps([str(path), built]))


def test_concurrent_builders_build_once(tmp_path):
    counter, results = tmp_path / "counter", tmp_path / "results"
    counter.mkdir()
    results.mkdir()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_worker, args=(str(tmp_path / "cache"), str(counter),
                                               str(results), barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    outcomes = [json.loads(f.read_text()) for f in results.iterdir()]
    assert len(outcomes) == 2
    assert {path for path, _ in outcomes} == {str(tmp_path / "cache" / "ab" / KEY)}
    assert sorted(built for _, built in outcomes) == [False, True]
    assert len(list(counter.iterdir())) == 1
