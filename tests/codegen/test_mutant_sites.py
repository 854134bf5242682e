"""Every planted mutant of tests/gpu/test_mutants.py still has its site: its `old` text occurs
exactly once in its template.  The GPU test checks the same before it mutates, but only on a GPU;
here a template change that moves a mutant's site fails on the CPU, in CI, in the same commit."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"
TEMPLATES = Path(__file__).resolve().parents[2] / "templates"


def _mutants():
    pytest.importorskip("hypothesis")
    sys.path.insert(0, str(GPU_TESTS))
    try:
        import test_mutants
    finally:
        sys.path.remove(str(GPU_TESTS))
    return test_mutants.MUTANTS


def test_every_mutant_site_occurs_once():
    wrong = [f"{m.name}: {(TEMPLATES / m.file).read_text().count(m.old)}x in templates/{m.file}"
             for m in _mutants() if (TEMPLATES / m.file).read_text().count(m.old) != 1]
    assert not wrong, "mutation sites that do not occur exactly once:\n" + "\n".join(wrong)
