"""The bench's derived figures, from a recorded row (no GPU)."""
from __future__ import annotations

import pytest

from runtime.bench import _print_table, decode_bytes, routed_expert_rate

DIMS = {"hidden": 2048, "heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "experts": 64, "top_k": 6, "moe_intermediate": 1408, "intermediate": 10944,
        "layers": 27, "q_lora_rank": 0, "shared_experts": 2, "vocab": 102400}


def test_routed_expert_rate_is_touched_expert_bytes_over_the_two_expert_families():
    need = decode_bytes(DIMS, 1, 128, 512)
    row = {"bytes": need, "breakdown": {"families": {
        "moe_gate_up_silu": {"ms": 6.0, "launches": 52}, "moe_down": {"ms": 2.0, "launches": 52},
        "cublas/torch": {"ms": 5.0, "launches": 100}}}}
    r = routed_expert_rate(row)
    assert r["ms"] == pytest.approx(8.0)
    assert r["bytes_per_s"] == pytest.approx(need["routed_experts"] / 8e-3)
    # b=128 touches nearly all 64 experts: ~28.8 GB of expert weights a step at V2-Lite's shape
    assert 27e9 < need["routed_experts"] < 29e9


def test_no_breakdown_no_rate():
    assert routed_expert_rate({"bytes": {"routed_experts": 1.0}}) is None
    assert routed_expert_rate({"bytes": {"routed_experts": 1.0}, "breakdown": {"families": {}}}) is None


def test_table_prints_kernels_per_layer_and_the_routed_expert_rate(capsys):
    need = decode_bytes(DIMS, 1, 128, 512)
    row = {"batch": 128, "context": 512, "ms": 14.5, "floor_ms": 7.8, "fraction_of_bandwidth": 0.54, "bytes": need,
           "breakdown": {"launches": 591, "kernel_ms": 13.5, "families": {
               "moe_gate_up_silu": {"ms": 5.55, "launches": 52}, "moe_down": {"ms": 2.87, "launches": 52}}}}
    row["routed_experts"] = routed_expert_rate(row)
    _print_table({"gpu": "H200", "date": "2026-12-01", "copy_bandwidth_GBps": 4218.0, "layers": 27,
                  "decode": [row], "prefill": []})
    out = capsys.readouterr().out
    assert "591 kernels (21.9 a layer)" in out
    assert "8.42 ms   3.42 TB/s" in out
