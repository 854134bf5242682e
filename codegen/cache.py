"""Content-addressed bundle cache.

The contract (after FlashInfer's JIT cache): try to load; take the key's lock;
try again (another process may have built it meanwhile); build into a private
temporary folder; record a checksum of every file in the manifest; rename the
folder into place. The rename is the commit: an entry under its final name is
complete unless something damaged it later, and damage is caught by the
checksums and repaired by rebuilding. This module only stores and verifies;
it never compiles.

Layout: <root>/<key[:2]>/<key>/{manifest.json, kernels/...}, with the lock
file <root>/<key[:2]>/<key>.lock beside it. Lock files stay on disk: removing
one while another process waits on it would let two builders in.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterator

from .errors import DsgraphError

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
# The compiler is these packages: any change to their source can change output.
_COMPILER_PACKAGES = ("ir", "codegen")
_KEY_RE = re.compile(r"[0-9a-f]{64}")


class CacheError(RuntimeError):
    """A builder broke the cache contract (e.g. wrote no manifest)."""


class CacheDirError(DsgraphError):
    """The cache's folder (the user's --cache-dir / $DSGRAPH_CACHE_DIR) cannot hold the cache:
    it is a file, or it cannot be created or written."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def compiler_source_hash(root: str | Path | None = None) -> str:
    """sha256 over (relative path, bytes) of every *.py under ir/ and codegen/."""
    base = Path(root) if root is not None else REPO_ROOT
    files = sorted(
        (p.relative_to(base).as_posix(), p)
        for pkg in _COMPILER_PACKAGES if (base / pkg).is_dir()
        for p in (base / pkg).rglob("*.py") if p.is_file()
    )
    h = hashlib.sha256()
    for rel, path in files:
        data = path.read_bytes()
        # Length-prefixed framing: no two different file sets hash the same stream.
        for part in (rel.encode(), data):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def cache_key(*, spec_text: str, template_texts: dict[str, str], compiler_hash: str,
              nvrtc_version: tuple, arch: str, options: dict) -> str:
    """sha256 of a canonical JSON of exactly these inputs, and nothing else."""
    if not isinstance(spec_text, str) or not isinstance(compiler_hash, str) \
            or not isinstance(arch, str):
        raise TypeError("spec_text, compiler_hash and arch must be strings")
    if not isinstance(template_texts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in template_texts.items()):
        raise TypeError("template_texts must map relative path (str) -> text (str)")
    payload = {
        "spec_text": spec_text,
        "template_texts": template_texts,
        "compiler_hash": compiler_hash,
        "nvrtc_version": list(nvrtc_version),
        "arch": arch,
        "options": options,
    }
    try:
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cache-key inputs must be plain JSON data "
                         f"(str keys, no NaN): {e}") from e
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def default_cache_dir() -> Path:
    env = os.environ.get("DSGRAPH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dsgraph"


def default_cache_origin() -> str:
    """Where default_cache_dir() came from, for an error about that folder."""
    return "from $DSGRAPH_CACHE_DIR" if os.environ.get("DSGRAPH_CACHE_DIR") else "the default"


def _under(path, root: Path) -> bool:
    try:
        return os.path.commonpath([os.path.abspath(path), os.path.abspath(root)]) == os.path.abspath(root)
    except (TypeError, ValueError):   # no path (filename None, bytes), or another drive
        return False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unique_name(parent: Path, prefix: str) -> Path:
    """A fresh name in `parent` that no other writer picks (O_EXCL / mkdir still guard it)."""
    return parent / f"{prefix}{os.getpid()}-{secrets.token_hex(8)}"


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 would outlive the rename; 0666 lets the user's umask decide.
    tmp = _unique_name(path.parent, f"{path.name}.tmp-")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class BundleCache:
    def __init__(self, root: str | Path, origin: str = ""):
        self.root = Path(root)
        self.origin = origin   # how the user named the root ("from $DSGRAPH_CACHE_DIR"): errors say it

    def _unusable(self, why: str) -> CacheDirError:
        origin = f" ({self.origin})" if self.origin else ""
        return CacheDirError(f"bundle cache folder {self.root}{origin} {why}")

    def check_root(self) -> None:
        """CacheDirError unless the root is a folder, made here if missing: checked before a build
        starts, so a cache folder that is a file costs a second, not a compile."""
        if self.root.exists() and not self.root.is_dir():
            raise self._unusable("is a file, not a folder")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._unusable(f"cannot be created: {e.strerror or e}") from None

    def _check_key(self, key: str) -> None:
        # Keys become paths; only a sha256 hex digest is allowed in.
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"cache key must be a sha256 hex digest, got {key!r}")

    def entry(self, key: str) -> Path:
        self._check_key(key)
        return self.root / key[:2] / key

    # -- verification -------------------------------------------------------

    @staticmethod
    def _intact(path: Path) -> bool:
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            return False
        for rel, digest in files.items():
            p = Path(rel)
            if p.is_absolute() or ".." in p.parts or not isinstance(digest, str):
                return False
            try:
                if _sha256_file(path / p) != digest:
                    return False
            except OSError:
                return False
        return True

    def _discard(self, path: Path) -> None:
        # Rename first so the final name is free at once and no reader ever
        # sees a half-deleted entry; then delete at leisure.
        aside = path.with_name(f"{path.name}.damaged-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return  # someone else already removed it
        shutil.rmtree(aside, ignore_errors=True)

    def _lookup_locked(self, key: str) -> Path | None:
        path = self.entry(key)
        if not path.exists():
            return None
        if self._intact(path):
            return path
        self._discard(path)
        return None

    def lookup(self, key: str) -> Path | None:
        """The entry for `key` if it is complete and intact; a damaged one is removed."""
        path = self.entry(key)
        if not path.exists():
            return None
        if self._intact(path):
            return path
        # Removing happens under the lock only: unlocked, we could remove an
        # entry that a builder committed just after we looked.
        with self._lock(key):
            return self._lookup_locked(key)

    # -- building -----------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        shard = self.entry(key).parent
        shard.mkdir(parents=True, exist_ok=True)
        fd = os.open(shard / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    @staticmethod
    def _seal(tmp: Path) -> None:
        """Record every file's sha256 in the manifest (which the builder wrote last)."""
        manifest_path = tmp / MANIFEST
        if not manifest_path.is_file():
            raise CacheError(f"bundle builder wrote no {MANIFEST} into {tmp}")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise CacheError(f"bundle builder wrote an invalid {MANIFEST}: {e}") from e
        if not isinstance(manifest, dict):
            raise CacheError(f"{MANIFEST} must hold a JSON object")
        manifest["files"] = {
            p.relative_to(tmp).as_posix(): _sha256_file(p)
            for p in sorted(tmp.rglob("*"))
            if p.is_file() and p != manifest_path
        }
        text = json.dumps(manifest, sort_keys=True, indent=2) + "\n"
        write_atomic(manifest_path, text.encode("utf-8"))

    def get_or_build(self, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
        """The entry for `key`, building it with `build(tmp_dir)` if needed.

        Returns (path, built_now). `build` writes the bundle into the folder it is
        given (manifest.json last); it runs at most once across processes per key.
        """
        try:
            return self._get_or_build(key, build)
        except OSError as e:
            # The cache's own files (shards, locks, the entry being built): the folder is at
            # fault (read-only, full, ...), and the user's name for it is what they can fix.
            if _under(e.filename, self.root):
                raise self._unusable(f"cannot be written: {e.strerror or e} ({e.filename})") from None
            raise

    def _get_or_build(self, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
        hit = self.lookup(key)
        if hit is not None:
            return hit, False
        final = self.entry(key)
        shard = final.parent
        with self._lock(key):
            hit = self._lookup_locked(key)
            if hit is not None:
                return hit, False
            # Holding the lock means no live builder for this key: leftovers
            # are from crashed ones.
            for pattern in (f"{key}.tmp-*", f"{key}.damaged-*"):
                for stale in shard.glob(pattern):
                    shutil.rmtree(stale, ignore_errors=True)
            tmp = _unique_name(shard, f"{key}.tmp-")
            tmp.mkdir(0o777)  # not mkdtemp's 0700: the umask decides, as for any folder the user makes
            try:
                build(tmp)
                self._seal(tmp)
                if final.exists():  # damaged or unfinished, or _lookup_locked would have kept it
                    self._discard(final)
                os.rename(tmp, final)
                _fsync_dir(shard)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return final, True
