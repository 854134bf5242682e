"""The committed generated CUDA of the shipped specs (tests/codegen/golden) is current.

When this fails, look at the diff (`python -m runtime.cli diff golden worktree`),
and if the change is intended, refresh the goldens with the command it prints."""
from __future__ import annotations

import pytest

from codegen import goldens


@pytest.mark.slow
def test_goldens_are_current():
    expected = goldens.expected_files()
    committed = goldens.committed_files()
    diff = goldens.stale(expected, committed)
    lines = [f"  {label}: {p}" for label, paths in diff.items() for p in paths[:20]]
    assert not any(diff.values()), (
        "generated CUDA differs from the committed goldens:\n" + "\n".join(lines) +
        f"\nreview with `python -m runtime.cli diff golden worktree`; "
        f"refresh with: {goldens.REFRESH_COMMAND}")


def test_index_lists_every_golden_kernel():
    committed = goldens.committed_files()
    import json
    index = json.loads(committed.get(goldens.INDEX, "{}"))
    assert set(index) == {"deepseek_v2_lite", "deepseek_v2", "deepseek_v3", "deepseek_v3_1_w4a8_seed"}
    for spec, entry in index.items():
        on_disk = sorted(p.split("/", 1)[1][:-3] for p in committed if p.startswith(spec + "/"))
        assert entry["kernels"] == on_disk
