"""`dsgraph bench --weights w4a8 | w8a8` end to end on the GPU, on the tiny spec (the full-size runs are the
benchmark itself): the engine holds msModelSlim's layout, every case runs, the floor counts the layout the
compiled spec declares, the routed experts run on the int kernels, and transformers is skipped in one line.
In its own process: the bench's profiles leave CUPTI attached to the process that ran them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("weights", ["w4a8", "w8a8"])
def test_the_int_bench_runs_the_tiny_spec(weights, tmp_path):
    from ir.config_to_spec import spec_from_config
    from runtime import bench
    # the tiny model with room for the bench engine's max_seq_len (MAX_LENGTH)
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    path = tmp_path / "tiny.yaml"
    path.write_text(spec_from_config({**tiny, "max_position_embeddings": bench.MAX_LENGTH}, name="tiny"))
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "--spec", str(path), "--weights", weights,
           "--decode", "1x64,32x200", "--prefill", "2x100", "--iters", "3", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert bench.transformers_skipped(weights) in r.stdout
    result = json.loads(out.read_text())
    assert result["weights"] == weights and result["weight_layout"] == bench.LAYOUTS[weights]
    assert result["transformers_skipped"] == bench.transformers_skipped(weights)
    spec = bench.bench_spec(str(path), weights)
    dims = {k: (v or 0) for k, v in spec.dims.items()}
    for row in result["decode"]:
        want = bench.decode_bytes(dims, spec.plan.first_k_dense_replace, row["batch"], row["context"],
                                  weights=weights)
        assert row["bytes"] == pytest.approx(want)
        assert row["ms"] > 0 and row["floor_ms"] > 0
        fams = row["breakdown"]["families"]
        assert any(f in fams for f in bench.ROUTED_EXPERT_FAMILIES), fams
    assert [(p["batch"], p["length"]) for p in result["prefill"]] == [(2, 100)]
