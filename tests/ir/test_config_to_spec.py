"""ir.config_to_spec: the shipped specs are exactly what `--from-config` writes, they load,
and both phase graphs built from them pass the verifier."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ir import PHASES, SpecError, build_graph, load_spec, verify
from ir.config_to_spec import spec_from_config, spec_from_config_file

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "model_specs"
SHIPPED = ["deepseek_v2_lite", "deepseek_v2", "deepseek_v3"]


def _config(name: str) -> dict:
    return json.loads((SPECS / "hf_configs" / f"{name}.json").read_text())


def _title(text: str) -> str:
    first = text.splitlines()[0]
    assert first.startswith("# ")
    return first[2:]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spec_is_what_from_config_writes(name):
    # The shipped specs are the architectures with weights in the activation dtype; V3's FP8 storage
    # is their weight_formats (test_v3_config_gives_fp8_weight_formats).
    text = (SPECS / f"{name}.yaml").read_text()
    assert spec_from_config(_config(name), name=name, title=_title(text), weight_formats=False) == text
    if name != "deepseek_v3":
        assert spec_from_config(_config(name), name=name, title=_title(text)) == text


def test_v3_config_gives_fp8_weight_formats():
    """V3's quantization_config: every decoder-layer linear is FP8 with its scale; the embedding, norms,
    router gate and its bias and lm_head stay in the activation dtype."""
    from ir.formats import FP8, weight_format
    text = spec_from_config(_config("deepseek_v3"), name="deepseek_v3")
    spec = load_spec(text, file="v3.yaml", check=False)
    assert spec.weight_formats == (("model.layers.*.self_attn.*_proj*.weight", FP8.name),
                                   ("model.layers.*.mlp.*_proj.weight", FP8.name))
    small = dict(_config("deepseek_v3"), num_hidden_layers=4, n_routed_experts=8, n_group=4, topk_group=2,
                 num_experts_per_tok=2)
    G = build_graph(load_spec(spec_from_config(small), file="v3.yaml"), "prefill")
    fp8 = {n for n, info in G.graph["weights"].items() if info.format == FP8.name}
    kept = {n for n, info in G.graph["weights"].items() if info.format is None and not n.endswith("_scale_inv")}
    layer = {n.split(".", 3)[3] for n in fp8}
    assert layer == {"self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                     "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight", "mlp.experts.*.gate_proj.weight",
                     "mlp.experts.*.up_proj.weight", "mlp.experts.*.down_proj.weight",
                     "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                     "mlp.shared_experts.down_proj.weight"}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.3.mlp.gate.weight",
            "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.kv_a_layernorm.weight"} <= kept
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert weight_format(G, kv_a) is FP8
    assert G.graph["weights"][kv_a + "_scale_inv"].shape == (5, 56)      # 576 rows: 5 ceil blocks; 7168 / 128


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spec_builds_and_verifies_in_both_phases(name):
    spec = load_spec(str(SPECS / f"{name}.yaml"))
    assert spec.file == f"{name}.yaml" and spec.name == name
    graphs = {phase: build_graph(spec, phase) for phase in PHASES}
    for phase, G in graphs.items():
        verify(G)
        assert G.graph["phase"] == phase
        assert G.graph["values"]["logits"].shape == ("T", spec.dims["vocab"])
    assert graphs["prefill"].graph["weights"] == graphs["decode"].graph["weights"]


def test_shipped_dims_are_the_published_ones():
    lite, v2, v3 = (load_spec(str(SPECS / f"{n}.yaml")) for n in SHIPPED)
    assert lite.dims["q_lora_rank"] is None and lite.dims["experts"] == 64 and lite.dims["top_k"] == 6
    assert v2.dims["q_lora_rank"] == 1536 and v2.dims["experts"] == 160 and v2.dims["layers"] == 60
    assert v3.dims["experts"] == 256 and v3.dims["top_k"] == 8 and v3.plan.first_k_dense_replace == 3
    for spec in (lite, v2, v3):
        assert spec.model.cache_width == 576


def test_default_name_and_title_come_from_the_config():
    text = spec_from_config(_config("deepseek_v2_lite"))
    assert text.startswith("# deepseek_v2_lite (deepseek_v2)\n")
    assert "\nname: deepseek_v2_lite\n" in text


def test_config_file_round_trip(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config("deepseek_v3")))
    assert spec_from_config_file(str(path)) == spec_from_config(_config("deepseek_v3"))


def test_legacy_rope_scaling_and_v5_rope_parameters_give_the_same_spec():
    legacy = _config("deepseek_v2_lite")
    modern = dict(legacy)
    scaling = modern.pop("rope_scaling")
    modern["rope_parameters"] = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn",
                                 "rope_theta": modern.pop("rope_theta")}
    assert spec_from_config(modern) == spec_from_config(legacy)


def _broken(**changes) -> dict:
    cfg = _config("deepseek_v2_lite")
    for key, value in changes.items():
        if value is ...:
            del cfg[key]
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("changes, path, message", [
    (dict(model_type="llama"), "model_type", "model_type must be deepseek_v2 or deepseek_v3, got 'llama'"),
    (dict(hidden_size=...), "hidden_size", "config.json lacks 'hidden_size'"),
    (dict(kv_lora_rank=None), "kv_lora_rank", "config.json lacks 'kv_lora_rank'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling", "rope scaling 'linear' is not supported"),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling", "needs original_max_position_embeddings"),
    (dict(scoring_func="sigmoid"), "topk_method", "routing sigmoid/greedy is not supported"),
    (dict(n_shared_experts=0), "n_shared_experts", "without shared experts"),
])
def test_configs_we_cannot_translate(changes, path, message):
    with pytest.raises(SpecError) as err:
        spec_from_config(_broken(**changes))
    assert err.value.file == "config.json" and err.value.path == path
    assert message in str(err.value)


def test_unreadable_config_files(tmp_path):
    with pytest.raises(SpecError, match="cannot read config"):
        spec_from_config_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "deepseek_v2",\n oops}')
    with pytest.raises(SpecError) as err:
        spec_from_config_file(str(bad))
    assert err.value.line == 2 and "not valid JSON" in str(err.value)


def test_tiny_spec_is_a_small_v2_lite_written_by_from_config():
    """model_specs/deepseek_tiny.yaml (smoke runs, the README's examples) comes from its config the
    same way, keeps DeepSeek-V2-Lite's structure, and is small enough for a CPU in seconds."""
    text = (SPECS / "deepseek_tiny.yaml").read_text()
    assert spec_from_config(_config("deepseek_tiny"), name="deepseek_tiny", title=_title(text)) == text
    tiny, lite = load_spec(str(SPECS / "deepseek_tiny.yaml")), load_spec(str(SPECS / "deepseek_v2_lite.yaml"))
    assert tiny.model.model_type == lite.model.model_type and tiny.dims["q_lora_rank"] is None
    assert tiny.model.rope.scaling == lite.model.rope.scaling == "yarn"
    assert tiny.plan.first_k_dense_replace == 1 and tiny.dims["layers"] == 2
    for phase in PHASES:
        G = build_graph(tiny, phase)
        verify(G)
        params = sum(math.prod(w.shape) for w in G.graph["weights"].values())
        assert params < 1_000_000


@pytest.mark.parametrize("quant, says", [
    ({"quantize": "w8a8"}, "quantize 'w8a8' is not supported"),
    ({"quantize": "w8a8_dynamic", "moe_quantize": "w4a4_dynamic"}, "moe_quantize 'w4a4_dynamic' is not supported"),
    ({"moe_quantize": "w4a8_dynamic"}, "moe_quantize without quantize"),
    ({"quantize": "w8a8_dynamic", "quantization_config": {"quant_method": "fp8"}}, "ambiguous"),
])
def test_msmodelslim_quantisation_keys_the_spec_cannot_store_are_one_error(quant, says):
    with pytest.raises(SpecError, match=says):
        spec_from_config({**_config("deepseek_tiny"), **quant})


def test_msmodelslim_quantisation_keys_become_weight_formats():
    cfg = {**_config("deepseek_tiny"), "quantize": "w8a8_dynamic", "moe_quantize": "w4a8_dynamic"}
    G = build_graph(load_spec(spec_from_config(cfg), file="config.json"), "prefill")
    formats = {n: w.format for n, w in G.graph["weights"].items()}
    assert formats["model.layers.1.mlp.experts.*.down_proj.weight"] == "int4_channel"
    assert formats["model.layers.1.mlp.shared_experts.down_proj.weight"] == "int8_channel"
    assert formats["model.layers.0.self_attn.kv_b_proj.weight"] is None
    assert formats["model.layers.1.mlp.gate.weight"] is None and formats["lm_head.weight"] is None
    assert all(formats[n] == "int8_channel" for n in formats if n.endswith(("q_a_proj.weight", "o_proj.weight")))
