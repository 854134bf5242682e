"""Tiny specs for the codegen tests (CPU only): the same HF-like config the GPU
harness uses, written to a file so the bundle path sees a real spec file."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests" / "gpu") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from harness import tiny_config  # noqa: E402

from ir.config_to_spec import spec_from_config  # noqa: E402


def tiny_spec_text(**overrides) -> str:
    return spec_from_config(tiny_config(**overrides), name="tiny")


def write_tiny_spec(path: Path, **overrides) -> Path:
    path.write_text(tiny_spec_text(**overrides), encoding="utf-8")
    return path
