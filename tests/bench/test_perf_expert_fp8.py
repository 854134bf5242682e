"""bench/perf_expert_fp8.py on the CPU: it times the launches the lowering runs (bf16: decode's wgmma tiles,
down's one-token launch; FP8: the wgmma_skinny_fp8 launch), and its quantiser is V3's block rule."""
from __future__ import annotations

import torch

from bench import perf_expert_fp8 as pe
from ir.formats import FP8, dequantize


def test_the_bench_times_the_lowerings_launches():
    for op, KD, N in pe.OPS:
        _, _, bf16 = pe.graph(op, KD, N, False)
        _, _, fp8 = pe.graph(op, KD, N, True)
        assert "wgmma_skinny" in {la.stage for la in bf16}
        # decode's launch (down: and its one-token launch, on by default), then the FP8 x FP8 prefill launches
        # (no work at the bench's decode token counts)
        decode = ["wgmma_skinny_fp8", "wgmma_skinny_fp8_t1"] if op == "moe_down" else ["wgmma_skinny_fp8"]
        assert [la.stage for la in fp8] == [*decode, "quant_x", "wgmma_fp8"] and "_wfp8" in fp8[0].name


def test_the_bench_quantiser_is_v3s_block_rule():
    w = torch.randn(2, 200, 144)
    q, s = pe.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2, 2)
    assert torch.allclose(s[:, 1, 1], w[:, 128:, 128:].abs().amax(dim=(1, 2)) / 448)
    back = torch.stack([dequantize(q[e], (s[e],), FP8) for e in range(2)])
    assert ((back - w).abs() <= w.abs() / 16 + s.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)[:, :, :144]).all()


def test_the_bench_lowers_the_fp8_side_with_its_tune_knobs():
    tuning = pe.parse_tune(["moe.fp8_one_token_down=true", "moe.fp8_widen_ahead=true"])
    _, _, down = pe.graph("moe_down", pe.M, pe.D, True, tuning)
    assert [la.stage for la in down][:2] == ["wgmma_skinny_fp8", "wgmma_skinny_fp8_t1"]
    assert all("__wa__" in la.name for la in down[:2])
