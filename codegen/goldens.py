"""Golden files: the generated CUDA of every shipped spec, committed for review.

    tests/codegen/golden/index.json                 spec -> its kernels (+ ops left unlowered)
    tests/codegen/golden/<spec name>/<kernel>.cu    rendered source (no cubins)
    tests/codegen/golden/include/<header>.cuh       every dsgraph header those sources include

Together that is everything that reaches NVRTC (sources and headers; the numbers that
change the computation are template constants, so they are in the sources).  Rendered
with dsgraph's defaults (codegen.kernel.DEFAULTS), without the compiler hash, so a Python
change that leaves the generated code alone leaves the goldens alone.  `dsgraph goldens`
rewrites them; tests/codegen/test_golden.py fails when they are stale.  A diff of these
files is the reviewable effect of a change to a template, a header, a family or a pass
(tinygrad's "process replay").
"""
from __future__ import annotations

import collections
import json
import os
from pathlib import Path

from .cache import REPO_ROOT, write_atomic
from .kernel import DEFAULTS

GOLDEN_DIR = REPO_ROOT / "tests" / "codegen" / "golden"
SHIPPED_SPECS = ("deepseek_v2_lite", "deepseek_v2", "deepseek_v3", "deepseek_v3_1_w4a8_seed")
GOLDEN_OPTIONS = {"dtype": DEFAULTS.dtype, "block_size": DEFAULTS.block_size}
INDEX = "index.json"
INCLUDE = "include"
REFRESH_COMMAND = "dsgraph goldens"


def spec_path(name: str) -> Path:
    return REPO_ROOT / "model_specs" / f"{name}.yaml"


def render_spec_sources(path, *, dtype: str = DEFAULTS.dtype, block_size: int = DEFAULTS.block_size):
    """(spec name, {kernel: source}, {header: text}, {phase: {op: count}} of unlowered nodes)."""
    from .bundle import render_spec
    name, kernels, unlowered = render_spec(str(path), dtype=dtype, block_size=block_size, strict=False)
    counts: dict = {}
    for phase, _node, op in unlowered:
        counts.setdefault(phase, collections.Counter())[op] += 1
    headers = {h: text for k in kernels for h, text in k.includes.items()}
    return (name, {k.name: k.source for k in kernels}, dict(sorted(headers.items())),
            {ph: dict(sorted(c.items())) for ph, c in sorted(counts.items())})


def expected_files(specs=SHIPPED_SPECS) -> dict[str, str]:
    """Relative path under GOLDEN_DIR -> text, for what the working tree generates now."""
    files: dict[str, str] = {}
    index: dict = {}
    for spec in specs:
        name, sources, headers, unlowered = render_spec_sources(spec_path(spec), **GOLDEN_OPTIONS)
        for kernel, src in sources.items():
            files[f"{name}/{kernel}.cu"] = src
        for header, text in headers.items():
            files[f"{INCLUDE}/{header}"] = text
        index[name] = {"spec": f"model_specs/{spec}.yaml", "options": GOLDEN_OPTIONS,
                       "kernels": sorted(sources), "includes": sorted(headers), "unlowered_ops": unlowered}
    files[INDEX] = json.dumps(index, sort_keys=True, indent=1) + "\n"
    return dict(sorted(files.items()))


def committed_files(root: Path = GOLDEN_DIR) -> dict[str, str]:
    if not root.is_dir():
        return {}
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and (p.suffix in (".cu", ".cuh") or p.name == INDEX):
            out[p.relative_to(root).as_posix()] = p.read_bytes().decode("utf-8")
    return out


def stale(expected: dict[str, str], committed: dict[str, str]) -> dict[str, list[str]]:
    return {
        "missing": sorted(set(expected) - set(committed)),
        "extra": sorted(set(committed) - set(expected)),
        "changed": sorted(k for k in set(expected) & set(committed) if expected[k] != committed[k]),
    }


def write(expected: dict[str, str], root: Path = GOLDEN_DIR) -> dict[str, list[str]]:
    """Make `root` hold exactly `expected` (removing stale .cu files); returns what changed."""
    diff = stale(expected, committed_files(root))
    for rel in diff["extra"]:
        os.unlink(root / rel)
    for rel in diff["missing"] + diff["changed"]:
        write_atomic(root / rel, expected[rel].encode("utf-8"))
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    return diff
