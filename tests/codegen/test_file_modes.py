"""Bundles and cache entries are created with the user's umask (mkdtemp's 0700 and mkstemp's
0600 must not survive the rename into place)."""
from __future__ import annotations

import os
import stat

import pytest

from tiny import write_tiny_spec


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_bundle_files_follow_the_umask(umask, tmp_path, monkeypatch):
    import codegen.nvrtc as nvrtc
    from codegen.bundle import compile_bundle
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, **kw: nvrtc.CompileResult(b"CUBIN", ""))
    spec = write_tiny_spec(tmp_path / "tiny.yaml")
    old = os.umask(umask)
    try:
        res = compile_bundle(spec, tmp_path / "bundle", cache_dir=tmp_path / "cache", strict=False, progress=False)
    finally:
        os.umask(old)
    want_dir, want_file = 0o777 & ~umask, 0o666 & ~umask
    paths = [res.path, *res.path.rglob("*")]
    entry = next((tmp_path / "cache").glob("*/*[0-9a-f]"))       # the cache entry itself
    paths += [entry, *entry.rglob("*")]
    for p in paths:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (want_dir if p.is_dir() else want_file), f"{p}: {oct(mode)}"
