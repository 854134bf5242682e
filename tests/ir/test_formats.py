"""ir/formats.py: the format of a bound weight, its companions bound beside it, stacked and sliced."""
import types

import pytest

from ir.formats import FP8, FORMATS, companion_names, scale_shape, set_format, weight_format, with_companions
from ir.ops.base import WeightInfo, WeightSlice


def _graph(weights):
    return types.SimpleNamespace(graph={"weights": weights})


def test_weight_format_reads_the_graph_and_defaults_to_the_activation_dtype():
    W = {"a.weight": WeightInfo((576, 200)), "gate.weight": WeightInfo((16, 200), keep_fp32=True),
         "n.weight": WeightInfo((200,))}
    set_format(W, "a.weight", FP8)
    G = _graph(W)
    assert weight_format(G, "a.weight") is FP8
    assert W["a.weight_scale_inv"] == WeightInfo((5, 2), True)           # 576 rows: 4 whole blocks and one of 64
    assert weight_format(G, "a.weight_scale_inv") is FORMATS["fp32"]
    assert weight_format(G, "gate.weight") is FORMATS["fp32"]
    assert weight_format(G, "n.weight") is FORMATS["bf16"]
    assert weight_format(G, "n.weight", act="fp16") is FORMATS["fp16"]
    assert with_companions(W, {"a.weight"}) == {"a.weight", "a.weight_scale_inv"}


def test_stacked_companions_follow_the_parts_slices_on_block_edges():
    parts = (WeightSlice("s.up.weight", 0, 256, 512, (512, 300)), "e.0.up.weight", "e.1.up.weight")
    W = {"e.*.up.weight": WeightInfo((3, 256, 300), parts=parts)}
    set_format(W, "e.*.up.weight", FP8)
    scale = W["e.*.up.weight_scale_inv"]
    assert scale.shape == (3, *scale_shape((256, 300), FP8)) == (3, 2, 3)
    assert scale.parts == (WeightSlice("s.up.weight_scale_inv", 0, 2, 4, (4, 3)),
                           "e.0.up.weight_scale_inv", "e.1.up.weight_scale_inv")
    assert companion_names("e.*.up.weight", FP8) == ("e.*.up.weight_scale_inv",)


def test_a_slice_off_the_block_edges_is_refused():
    W = {"x": WeightInfo((2, 64, 300), parts=(WeightSlice("s", 0, 0, 64, (128, 300)),
                                              WeightSlice("s", 0, 64, 128, (128, 300))))}
    with pytest.raises(ValueError, match="does not fall on the 128-wide blocks"):
        set_format(W, "x", FP8)


def test_unscaled_formats_are_the_activation_dtype():
    with pytest.raises(ValueError, match="unscaled"):
        set_format({"x": WeightInfo((4, 4))}, "x", FORMATS["bf16"])


# ---- the spec's weight_formats ------------------------------------------------------------------

import json
from pathlib import Path

import ir
from ir.config_to_spec import spec_from_config

ROOT = Path(__file__).resolve().parents[2]
TINY = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())


def _spec(formats: str):
    return ir.load_spec(spec_from_config(TINY, name="tiny") + "\nweight_formats:\n" + formats, file="t.yaml")


def test_spec_weight_formats_first_match_wins_and_act_carves_out():
    spec = _spec('  "model.layers.0.*": act\n  "model.layers.*_proj*.weight": fp8_e4m3_block128\n')
    G = ir.build_graph(spec, "decode")
    fp8 = sorted(n for n, i in G.graph["weights"].items() if i.format)
    assert fp8 and all(n.startswith("model.layers.1.") for n in fp8)
    assert "model.layers.1.mlp.experts.*.gate_proj.weight_scale_inv" in G.graph["weights"]
    ir.verify(G)


@pytest.mark.parametrize("formats, message", [
    ('  "model.layers.*.nothing.weight": fp8_e4m3_block128\n', "matches no weight the spec binds"),
    ('  "model.embed_tokens.weight": fp8_e4m3_block128\n', "embedding .* cannot take a quantised weight"),
    ('  "model.layers.*.mlp.gate.weight": fp8_e4m3_block128\n', "is kept in float32"),
    ('  "lm_head.weight": int3\n', "weight format must be act"),
])
def test_spec_weight_format_mistakes_are_located_errors(formats, message):
    with pytest.raises(ir.SpecError, match=message) as info:
        _spec(formats)
    assert "t.yaml" in str(info.value) and "weight_formats" in str(info.value)
