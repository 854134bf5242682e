"""`dsgraph bench --weights w8a8 | w4a8` on the CPU: the spec it compiles (msModelSlim's weight_formats over the
bench spec, as `spec --from-config` writes them for a config's quantize / moe_quantize), the bytes its floor
counts (int8 one byte a weight, packed int4 half a byte, the float32 scale per output channel; kv_b, router,
lm_head and cache as in bf16: a hand-computed case, the decode graph's own linear weights, the planner's
count), the seed checkpoint's shape (model_specs/deepseek_v3_1_w4a8_seed.yaml: what `--from-config` writes
from its config, lowered for sm_90a with its experts on the int kernels, one 80 GB GPU in `dsgraph plan`),
the random weights' per-expert quantisation, the options and the one-line refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from codegen.kernel import KernelLaunch, LibraryCall, Options
from ir.config_to_spec import spec_from_config
from ir.formats import FORMATS, companions_of, quantize
from ir.graph import build_graph
from ir.passes import run_pipeline
from ir.spec import load_spec
from runtime import bench, planner
from runtime.cli import main

ROOT = Path(__file__).resolve().parents[2]
LITE, SEED = "deepseek_v2_lite", "deepseek_v3_1_w4a8_seed"
INT_WEIGHTS = ("w8a8", "w4a8")
MOE_OPS = ("moe_gate_up_silu", "moe_gate_up", "moe_down", "moe_expert_ffn")


def _config(name: str) -> dict:
    return json.loads((ROOT / "model_specs" / "hf_configs" / f"{name}.json").read_text())


def _dims(spec) -> dict:
    return {k: (v or 0) for k, v in spec.dims.items()}


def _no_gpu():
    if torch.cuda.is_available():
        pytest.skip("with a GPU the command would run the benchmark")


@pytest.mark.parametrize("weights", INT_WEIGHTS)
def test_the_int_spec_is_msmodelslims_formats_over_the_bench_spec(weights):
    """The formats are the ones `spec --from-config` writes for V2-Lite's config with msModelSlim's keys."""
    dense, moe = bench.MSMODELSLIM[weights]
    keys = {"quantize": dense, **({"moe_quantize": moe} if moe else {})}
    want = load_spec(spec_from_config({**_config(LITE), **keys}), file="lite.yaml").weight_formats
    assert bench.bench_spec(LITE, weights).weight_formats == want
    assert dict(want)["model.layers.*.mlp.experts.*"] == ("int4_channel" if weights == "w4a8" else "int8_channel")


@pytest.mark.parametrize("weights", bench.WEIGHTS)
def test_the_layouts_are_what_the_bench_specs_declare(weights):
    from codegen.paths import spec_path
    spec = bench.bench_spec(LITE, weights)
    assert bench.weight_layout(load_spec(str(spec_path(spec))) if isinstance(spec, str) else spec) == \
        bench.LAYOUTS[weights]


def test_matrix_bytes_of_the_integer_formats():
    # int8 per channel: a byte a weight, a float32 scale a row (the zero offsets are read by no kernel)
    assert bench.matrix_bytes(2048, 1408, weights="int8_channel") == 2048 * 1408 + 4 * 2048
    # packed int4: two rows a byte
    assert bench.matrix_bytes(1408, 2048, weights="int4_channel") == 704 * 2048 + 4 * 1408
    assert bench.matrix_bytes(4, 512, weights="int4_channel_byte") == 4 * 512 + 4 * 4
    # per group of 256 inputs: a second float32 scale a row per group
    assert bench.matrix_bytes(4, 512, weights="int4_group256_packed") == 2 * 512 + 4 * 4 + 4 * 4 * 2
    assert bench.matrix_bytes(4, 512, weights="bf16") == bench.matrix_bytes(4, 512, weights=None) == 4 * 512 * 2
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        bench.matrix_bytes(4, 512, weights="int3")


def test_w4a8_decode_bytes_by_hand():
    """V2-Lite at batch 1, context 512: D 2048, H 16, C 512, R 64, N = V = 128, no q_lora, I 10944, M 1408,
    E 64 (K 6: 6 experts touched at batch 1), 2 shared experts, 27 layers of which 1 dense, vocab 102400."""
    spec = bench.bench_spec(LITE, "w4a8")
    got = bench.decode_bytes(_dims(spec), spec.plan.first_k_dense_replace, 1, 512, weights="w4a8")
    int8 = lambda o, i: o * i + 4 * o                  # noqa: E731
    int4 = lambda o, i: o // 2 * i + 4 * o             # noqa: E731
    attention = (int8(16 * 192, 2048) + int8(576, 2048) + 16 * 256 * 512 * 2 + int8(2048, 16 * 128)) * 27
    assert got["attention"] == attention
    assert got["dense_ffn"] == 2 * int8(10944, 2048) + int8(2048, 10944)
    assert got["routed_experts"] == pytest.approx(6 * (2 * int4(1408, 2048) + int4(2048, 1408)) * 26)
    assert got["shared_experts"] == (2 * int8(2816, 2048) + int8(2048, 2816)) * 26
    assert got["router"] == 64 * 2048 * 4 * 26
    assert got["lm_head"] == 102400 * 2048 * 2
    assert got["cache"] == 512 * 576 * 2 * 27
    assert got["total"] == pytest.approx(sum(v for k, v in got.items() if k != "total"))
    w8 = bench.decode_bytes(_dims(spec), 1, 1, 512, weights="w8a8")
    assert w8["routed_experts"] == pytest.approx(6 * (2 * int8(1408, 2048) + int8(2048, 1408)) * 26)
    assert {k: v for k, v in w8.items() if k not in ("routed_experts", "total")} == \
        {k: v for k, v in got.items() if k not in ("routed_experts", "total")}


@pytest.mark.parametrize("name,weights", [(LITE, "w4a8"), (LITE, "w8a8"), (SEED, "w4a8")])
def test_int_linear_bytes_are_the_decode_graphs_stored_linear_weights(name, weights):
    """linear_bytes is what the decode graph's linear ops bind, as stored: int8 / packed int4 bytes and
    their `_scale` companions (not the zero `_offset`s), lm_head in bf16; the shared experts counted where
    they run as linears (not stacked into the grouped experts)."""
    spec = bench.bench_spec(name, weights)
    G = run_pipeline(build_graph(spec, "decode"))
    info = G.graph["weights"]
    want, shared_linear = 0, False
    for _, data in G.nodes(data=True):
        if data.get("op") in ("linear", "multi_linear", "gate_up_silu"):
            for w in data["weights"].values():
                shared_linear |= "shared_experts" in w
                stored = info[w].shape
                if info[w].format in FORMATS:
                    fmt = FORMATS[info[w].format]
                    scale = next(c for c in companions_of(info, w) if c.endswith("_scale"))
                    want += stored[0] // fmt.pack * stored[1] + 4 * info[scale].shape[0]
                else:
                    want += stored[0] * stored[1] * 2
    layout = bench.weight_layout(spec)
    assert bench.linear_bytes(_dims(spec), spec.plan.first_k_dense_replace, shared=shared_linear,
                              weights=layout) == want


@pytest.mark.parametrize("name,weights", [(LITE, "w4a8"), (SEED, "w4a8"), (LITE, "w8a8")])
def test_int_decode_bytes_are_the_planners(name, weights):
    """`dsgraph plan` counts the same spec's bytes as stored: its routed experts without their scales (it
    counts every expert's scales and zero `_offset`s among the whole weights, 4 bytes a row each: 0.4% of
    a packed int4 row of V2-Lite's experts), and norms the bench leaves out."""
    spec = bench.bench_spec(name, weights)
    for batch, context in ((1, 512), (32, 4096)):
        (one,) = planner.plan_deployment(spec, (1,), batch=batch, context=context).plans
        ours = bench.decode_bytes(_dims(spec), spec.plan.first_k_dense_replace, batch, context, weights=weights)
        assert one.read["routed_experts"] == pytest.approx(ours["routed_experts"], rel=5e-3)
        assert one.read["routed_experts"] < ours["routed_experts"]
        # the planner: every expert's scale and offset, 8 bytes a row; ours: the touched experts' scales
        d, moe_layers = spec.dims, spec.dims["layers"] - spec.plan.first_k_dense_replace
        rows = (2 * d["moe_intermediate"] + d["hidden"]) * moe_layers
        touched = d["experts"] * (1 - (1 - d["top_k"] / d["experts"]) ** batch)
        assert one.read["total"] == pytest.approx(ours["total"] + rows * (8 * d["experts"] - 4 * touched), rel=2e-3)
        assert one.read["kv_cache"] == ours["cache"]


def test_the_seed_spec_is_what_from_config_writes_from_its_config():
    """The shipped seed spec is `spec --from-config` of its config.json: DeepSeek-V3's, 4 layers, msModelSlim's
    quantize w8a8_dynamic / moe_quantize w4a8_dynamic (the seed document: 3 dense layers, 256 routed experts
    and 1 shared, top 8 of 8 groups, 4 groups kept, dense FFN 18432, experts 2048)."""
    text = (ROOT / "model_specs" / f"{SEED}.yaml").read_text()
    cfg = _config(SEED)
    assert spec_from_config(cfg, name=SEED, title=text.splitlines()[0][2:]) == text
    assert (cfg["quantize"], cfg["moe_quantize"]) == bench.MSMODELSLIM["w4a8"]
    assert {k: v for k, v in cfg.items() if k not in ("_name_or_path", "num_hidden_layers", "quantize",
                                                        "moe_quantize")} == \
        {k: v for k, v in _config("deepseek_v3").items() if k not in ("_name_or_path", "num_hidden_layers",
                                                                       "quantization_config")}
    spec = load_spec(str(ROOT / "model_specs" / f"{SEED}.yaml"))
    d = spec.dims
    assert (d["layers"], spec.plan.first_k_dense_replace, d["experts"], d["shared_experts"], d["top_k"]) == \
        (4, 3, 256, 1, 8)
    assert (d["hidden"], d["intermediate"], d["moe_intermediate"], d["groups"], d["topk_groups"]) == \
        (7168, 18432, 2048, 8, 4)
    assert bench.weight_layout(spec) == bench.LAYOUTS["w4a8"]


def test_the_seed_spec_lowers_for_sm90a_with_its_experts_on_the_int_kernel():
    """Both phases lower for the cuda backend on sm_90a; the routed experts run on the int4 kernel (the
    per-row quantiser and mma_int, "wi4") at every token count: no library call serves them."""
    from codegen.families import _moe_int
    from codegen.lower import lower_graph
    spec = load_spec(str(ROOT / "model_specs" / f"{SEED}.yaml"))
    for phase in ("decode", "prefill"):
        G = run_pipeline(build_graph(spec, phase))
        steps = lower_graph(G, Options(arch="sm_90a")).steps
        moe_nodes = {n for n, d in G.nodes(data=True) if d["op"] in MOE_OPS}
        assert moe_nodes
        int_launches = [s for s in steps if isinstance(s, KernelLaunch) and s.template == _moe_int.TEMPLATE]
        assert {n for s in int_launches for n in s.nodes} == moe_nodes
        assert all(s.params["wfmt"] == "int4_channel" for s in int_launches if s.stage == _moe_int.VARIANT)
        assert not [s for s in steps if isinstance(s, LibraryCall) and s.node in moe_nodes], phase


def test_the_seed_spec_fits_one_80gb_gpu():
    spec = load_spec(str(ROOT / "model_specs" / f"{SEED}.yaml"))
    hw = planner.hardware(batch=1, context=512, gpu_mem_gb=80.0)
    (one,) = planner.plan_deployment(spec, (1,), batch=1, context=512, hw=hw).plans
    assert one.fits and 11e9 < one.weights < 12e9      # the seed document: about 11.5 GB of weights


def test_random_int_weights_are_quantised_per_expert_as_the_whole_stack():
    """Engine.from_spec's random weights for the w4a8 spec: the stacked experts packed int4 with their scales,
    equal to quantising the same float draw whole (model_loader quantises one expert at a time)."""
    from runtime.model_loader import compile_graphs, random_weights, weight_specs
    from runtime.weights import WeightSpec
    spec = bench.bench_spec("deepseek_tiny", "w4a8")
    specs = weight_specs(compile_graphs(spec).graphs)
    name = next(n for n, s in specs.items() if s.format == "int4_channel" and s.parts and "down_proj" in n)
    held = random_weights({n: s for n, s in specs.items() if n.startswith(name.rsplit(".", 1)[0])},
                          dtype=torch.bfloat16, device="cpu", seed=3)
    s = specs[name]
    floats = random_weights({name: WeightSpec(s.shape, parts=s.parts)}, dtype=torch.float32, device="cpu", seed=3)
    q, (scale, offset) = quantize(floats[name], FORMATS["int4_channel"])
    assert held[name].dtype == torch.int8 and tuple(held[name].shape) == (s.shape[0], s.shape[1] // 2, s.shape[2])
    assert torch.equal(held[name], q)
    assert torch.equal(held[name + "_scale"], scale) and torch.equal(held[name + "_offset"], offset)


def test_the_weights_option_takes_the_integer_layouts(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--weights {bf16,fp8,w8a8,w4a8}" in out and "packed int4" in out
    for w in INT_WEIGHTS:
        line = bench.transformers_skipped(w)
        assert f"--weights {w}" in line and "\n" not in line


def test_the_seed_spec_under_w4a8_gets_as_far_as_the_gpu(capsys, tmp_path):
    _no_gpu()
    assert main(["bench", "--spec", SEED, "--weights", "w4a8", "--json", str(tmp_path / "b.json")]) == 2
    assert capsys.readouterr().err.strip() == "dsgraph: error: dsgraph bench needs a CUDA GPU"


@pytest.mark.parametrize("weights", ["bf16", "fp8", "w8a8"])
def test_the_seed_spec_under_another_layout_is_one_line(weights, capsys, tmp_path):
    _no_gpu()
    assert main(["bench", "--spec", SEED, "--weights", weights, "--json", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "deepseek_v3_1_w4a8_seed.yaml" in err and "run it with --weights w4a8" in err


@pytest.mark.parametrize("weights", INT_WEIGHTS)
def test_a_shape_the_int_kernels_cannot_serve_is_one_line_before_the_gpu(weights, capsys, tmp_path):
    """An odd expert width: packed int4 cannot pair its output channels (w4a8's lowering refuses it); w8a8's
    one value a byte serves it, and the command goes on to look for the GPU."""
    _no_gpu()
    odd = tmp_path / "odd.yaml"
    odd.write_text(spec_from_config({**_config("deepseek_tiny"), "moe_intermediate_size": 45}, name="odd"))
    assert main(["bench", "--spec", str(odd), "--weights", weights, "--json", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    if weights == "w4a8":
        assert "int4_channel packs two output channels a byte; 45 do not pair" in err
    else:
        assert err == "dsgraph: error: dsgraph bench needs a CUDA GPU"


@pytest.mark.parametrize("weights", INT_WEIGHTS)
def test_the_table_names_the_integer_layout(weights, capsys):
    bench._print_table({"gpu": "H200", "date": "2026-12-06", "copy_bandwidth_GBps": 4240.0, "weights": weights,
                        "decode": [], "prefill": []})
    head = capsys.readouterr().out.strip().splitlines()[0]
    assert head.endswith(bench.WEIGHTS_TITLE[weights]) and "msModelSlim" in head
