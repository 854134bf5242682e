"""`dsgraph bench --weights fp8` on the CPU: the spec it compiles (V3's FP8 weight_formats over the spec,
as weight_format="fp8" applies them), the random weights the engine then holds (FP8 bytes and block
scales), and the bytes its floor counts: one byte a weight plus a float32 scale per 128 x 128 block for
every decoder linear, kv_b and the experts, the router, lm_head and cache as in bf16 -- the same count
as `dsgraph plan` and as the FP8 decode graph's own linear weights."""
from __future__ import annotations

import pytest
import torch

from ir.formats import FP8, FP8_CHECKPOINT_GLOBS, scale_shape
from runtime import bench, planner
from runtime.cli import main

LITE = "deepseek_v2_lite"


def _dims(spec) -> dict:
    return {k: (v or 0) for k, v in spec.dims.items()}


def test_the_fp8_spec_is_v3s_formats_over_the_bench_spec():
    spec = bench.bench_spec(LITE, "fp8")
    assert spec.weight_formats == tuple((g, FP8.name) for g in FP8_CHECKPOINT_GLOBS)
    assert bench.bench_spec("some/path.yaml", "bf16") == "some/path.yaml"


def test_the_fp8_engine_holds_fp8_bytes_and_scales():
    """The random weights of the FP8 spec are quantised to the block layout (Engine.from_spec draws and
    quantises them): kv_b, the projections and the experts FP8, the embedding and lm_head not."""
    from runtime import Engine
    engine = Engine.from_spec(bench.bench_spec("deepseek_tiny", "fp8"), backend="reference", device="cpu")
    held = engine.backend.weights
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert held[kv_b].dtype == torch.float8_e4m3fn
    assert tuple(held[kv_b + "_scale_inv"].shape) == scale_shape(tuple(held[kv_b].shape), FP8)
    assert any(n.startswith("model.layers.1.mlp.experts") and t.dtype == torch.float8_e4m3fn for n, t in held.items())
    assert held["lm_head.weight"].dtype != torch.float8_e4m3fn
    assert held["model.embed_tokens.weight"].dtype != torch.float8_e4m3fn


def test_matrix_bytes_count_the_ceil_blocks():
    assert bench.matrix_bytes(576, 2048) == 576 * 2048 * 2
    assert bench.matrix_bytes(576, 2048, weights="fp8") == 576 * 2048 + 4 * 5 * 16     # 576 rows: 5 row blocks
    assert bench.matrix_bytes(1, 1, weights="fp8") == 1 + 4


def test_fp8_decode_bytes_halve_the_weights_and_keep_the_rest():
    spec = bench.bench_spec(LITE, "fp8")
    d, first = _dims(spec), spec.plan.first_k_dense_replace
    for batch, ctx in ((1, 512), (32, 4096), (128, 512)):
        bf, f8 = bench.decode_bytes(d, first, batch, ctx), bench.decode_bytes(d, first, batch, ctx, weights="fp8")
        for part in ("attention", "dense_ffn", "routed_experts", "shared_experts"):
            assert 0.5 < f8[part] / bf[part] < 0.5005, (part, f8[part] / bf[part])     # + 4 bytes a 16384 weights
        for part in ("router", "lm_head", "cache"):
            assert f8[part] == bf[part], part
        assert f8["total"] == pytest.approx(sum(v for k, v in f8.items() if k != "total"))


def test_fp8_decode_bytes_are_the_planners():
    """`dsgraph plan` counts the FP8 spec's bytes as stored (its routed experts without their scales,
    0.02% of them; norms and the embedding rows the bench leaves out)."""
    spec = bench.bench_spec(LITE, "fp8")
    for batch, context in ((1, 512), (32, 4096)):
        (one,) = planner.plan_deployment(spec, (1,), batch=batch, context=context).plans
        ours = bench.decode_bytes(_dims(spec), spec.plan.first_k_dense_replace, batch, context, weights="fp8")
        assert one.read["total"] == pytest.approx(ours["total"], rel=2e-3)
        assert one.read["routed_experts"] == pytest.approx(ours["routed_experts"], rel=1e-3)
        assert one.read["kv_cache"] == ours["cache"]


@pytest.mark.parametrize("name", [LITE, "deepseek_v3"])
def test_fp8_linear_bytes_are_the_decode_graphs_stored_linear_weights(name):
    """linear_bytes(weights="fp8") is what the FP8 decode graph's linear ops bind, as stored: FP8 bytes
    and their scale companions, lm_head in bf16 (the shared experts run in the grouped expert ops)."""
    from ir.formats import companions_of
    from ir.graph import build_graph
    from ir.passes import run_pipeline
    spec = bench.bench_spec(name, "fp8")
    G = run_pipeline(build_graph(spec, "decode"))
    info = G.graph["weights"]
    want = 0
    for _, data in G.nodes(data=True):
        if data.get("op") in ("linear", "multi_linear", "gate_up_silu"):
            for w in data["weights"].values():
                rows, cols = info[w].shape
                if info[w].format == FP8.name:
                    (scale,) = companions_of(info, w)
                    sr, sc = info[scale].shape
                    want += rows * cols + 4 * sr * sc
                else:
                    want += rows * cols * 2
    assert bench.linear_bytes(_dims(spec), spec.plan.first_k_dense_replace, shared=False, weights="fp8") == want


def test_the_weights_option(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--weights", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--weights {bf16,fp8,w8a8,w4a8}" in out and "(default: bf16)" in out
    assert "--weights fp8" in bench.TRANSFORMERS_FP8 and "\n" not in bench.TRANSFORMERS_FP8
