"""msModelSlim W8A8 / W4A8 checkpoints (issue 50 items 1-3 on the CPU): `dsgraph quantize --to w8a8 | w4a8`
writes the layout (3 shards + index, per-expert names, a description naming every tensor's type), the loader
maps each weight to its format and checks every value, and a damaged checkpoint is one WeightError naming
the tensor and its type.  Tiny V3-style model from transformers (hf_tiny's v3_tp: even widths, packable)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/e2e is on sys.path)
from ir.formats import FORMATS  # noqa: E402
from ir.formats_int import int_values, pack_int4, unpack_int4  # noqa: E402
from runtime.cli import main as cli_main  # noqa: E402
from runtime.errors import InputError, WeightError  # noqa: E402
from runtime.msmodelslim import DESCRIPTION_FILE, INDEX_FILE, MsModelSlim, is_msmodelslim  # noqa: E402
from runtime.quantize import quantize_checkpoint  # noqa: E402
from runtime.weights import Checkpoint  # noqa: E402

EXPERT = "model.layers.2.mlp.experts.3.{}_proj.weight"
Q_A = "model.layers.0.self_attn.q_a_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return hf_tiny.build("v3_tp", tmp_path_factory.mktemp("v3"))


@pytest.fixture(scope="module")
def w4a8(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("w4a8") / "ckpt"
    assert cli_main(["quantize", "--to", "w4a8", str(tiny), str(out)]) == 0
    return out


def test_w4a8_is_written_in_msmodelslims_layout(tiny, w4a8):
    config = json.loads((w4a8 / "config.json").read_text())
    assert config["quantize"] == "w8a8_dynamic" and config["moe_quantize"] == "w4a8_dynamic"
    index = json.loads((w4a8 / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) == 3
    desc = json.loads((w4a8 / DESCRIPTION_FILE).read_text())
    assert desc["version"] == "1.0.0" and desc["model_quant_type"] == "W4A8_DYNAMIC"
    assert set(index) == {k for k in desc if "." in k}
    gate = EXPERT.format("gate")
    assert desc[gate] == desc[gate + "_scale"] == desc[gate + "_offset"] == "W4A8_DYNAMIC"
    assert desc[Q_A] == "W8A8_DYNAMIC" and desc["model.layers.0.self_attn.kv_b_proj.weight"] == "FLOAT"
    assert desc["model.layers.2.mlp.gate.weight"] == "FLOAT" and desc["lm_head.weight"] == "FLOAT"
    assert desc["model.layers.2.mlp.shared_experts.up_proj.weight"] == "W8A8_DYNAMIC"
    ck, src = Checkpoint._from_index(w4a8, INDEX_FILE), Checkpoint.open(tiny)
    inter, hidden = src.shape(gate)
    assert ck.shape(gate) == (inter // 2, hidden) and ck.dtype_str(gate) == "I8"     # two int4 per byte along O
    assert ck.shape(gate + "_scale") == (inter, 1) and ck.dtype_str(gate + "_scale") == "F32"
    assert ck.shape(EXPERT.format("down")[: -len("weight")] + "scale_bias") == (hidden, 16)
    assert ck.shape(EXPERT.format("up")[: -len("weight")] + "scale_bias") == (inter, 1)
    assert ck.shape(Q_A) == src.shape(Q_A) and ck.dtype_str(Q_A) == "I8"
    assert (w4a8 / "generation_config.json").is_file() == (tiny / "generation_config.json").is_file()


def test_the_loader_maps_formats_checks_values_and_dequantises(tiny, w4a8):
    assert is_msmodelslim(w4a8) and not is_msmodelslim(tiny)
    ms = MsModelSlim.open(w4a8)
    ms.check()
    assert ms.weights[EXPERT.format("down")].fmt is FORMATS["int4_channel"]
    assert ms.weights[Q_A].fmt is FORMATS["int8_channel"]
    assert "model.layers.0.self_attn.kv_b_proj.weight" not in ms.weights
    view, src = ms.dequantised(), Checkpoint.open(tiny)
    assert view.names() == src.names()
    for name, fmt_max in ((EXPERT.format("gate"), 7), (Q_A, 127)):
        w, back = src.get(name), view.get(name)
        assert view.shape(name) == tuple(w.shape) and view.dtype_str(name) == "F32"
        step = w.abs().amax(1, keepdim=True) / fmt_max
        assert bool(((back - w).abs() <= 0.5 * step * (1 + 1e-5)).all())
        torch.testing.assert_close(view.get(name, (0, 2, 6)), back[2:6])


def test_w8a8_stores_the_experts_in_int8_too(tiny, tmp_path):
    out = tmp_path / "w8a8"
    done = quantize_checkpoint(tiny, out, "w8a8")
    ms = MsModelSlim.open(out)
    ms.check()
    assert ms.weights[EXPERT.format("up")].fmt is FORMATS["int8_channel"]
    assert done["quantised"] == len(ms.weights)
    assert "moe_quantize" not in json.loads((out / "config.json").read_text())


def _damage(ckpt_dir, tmp_path, name, change):
    """A copy of the checkpoint with tensor `name` replaced by change(tensor)."""
    import shutil
    out = tmp_path / "damaged"
    shutil.copytree(ckpt_dir, out)
    file = json.loads((out / INDEX_FILE).read_text())["weight_map"][name]
    tensors = load_file(str(out / file))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(out / file), metadata={"format": "pt"})
    return out


SB = EXPERT.format("up")[: -len("weight")] + "scale_bias"
MUTANTS = {
    "scale_bias off by 1%": (SB, lambda t: t * 1.01, SB),
    "nibbles swapped": (EXPERT.format("up"), lambda t: pack_int4(unpack_int4(t).reshape(-1, 2, t.shape[1]).flip(1)
                                                                 .reshape(-1, t.shape[1])), SB),
    "a weight scale off by 1%": (EXPERT.format("gate") + "_scale", lambda t: t * 1.01, "scale_bias"),
    "a nonzero offset": (Q_A + "_offset", lambda t: t + 0.5, "asymmetric"),
    "int8 stored as float": (Q_A, lambda t: t.float(), "is F32"),
    "a scale of the wrong shape": (Q_A + "_scale", lambda t: t[:-1], Q_A + "_scale"),
}


@pytest.mark.parametrize("case", MUTANTS)
def test_a_damaged_checkpoint_is_one_weight_error_naming_the_tensor(w4a8, tmp_path, case):
    name, change, says = MUTANTS[case]
    bad = _damage(w4a8, tmp_path, name, change)
    with pytest.raises(WeightError, match=says) as err:
        MsModelSlim.open(bad).check()
    assert "W4A8_DYNAMIC" in str(err.value) or "W8A8_DYNAMIC" in str(err.value)


def _edit_description(ckpt_dir, tmp_path, edit):
    import shutil
    out = tmp_path / "edited"
    shutil.copytree(ckpt_dir, out)
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    edit(desc)
    (out / DESCRIPTION_FILE).write_text(json.dumps(desc))
    return out


def test_description_mistakes_name_the_tensor_and_its_type(w4a8, tmp_path):
    def unknown(d):
        d[Q_A] = "W4A4_MXFP4"
    with pytest.raises(WeightError, match=f"{Q_A}: type 'W4A4_MXFP4'"):
        MsModelSlim.open(_edit_description(w4a8, tmp_path / "a", unknown))

    def forgotten(d):
        del d[EXPERT.format("down") + "_offset"]
    with pytest.raises(WeightError, match=f"{EXPERT.format('down')}_offset: in the checkpoint but not in"):
        MsModelSlim.open(_edit_description(w4a8, tmp_path / "b", forgotten))

    def mixed(d):
        d[Q_A + "_scale"] = "W8A8"
    with pytest.raises(WeightError, match="described as 'W8A8'"):
        MsModelSlim.open(_edit_description(w4a8, tmp_path / "c", mixed))


def test_older_int4_layouts_load_and_version_1_0_0_must_pack(tmp_path):
    """Per group of 256 (one int4 per byte, msModelSlim before 1.0.0) and packed per group."""
    src = tmp_path / "float"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {EXPERT.format(r): torch.randn(256, 512, generator=g) * 0.05 for r in ("gate", "up", "down")}
    tensors["model.embed_tokens.weight"] = torch.randn(11, 512, generator=g)
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    for fmt in ("int4_group256", "int4_group256_packed", "int4_channel_byte"):
        out = tmp_path / fmt
        quantize_checkpoint(src, out, "w4a8", int4_format=fmt)
        ms = MsModelSlim.open(out)
        ms.check()
        assert ms.weights[EXPERT.format("up")].fmt is FORMATS[fmt]
        q = int_values(Checkpoint.open(out).get(EXPERT.format("up")), FORMATS[fmt])
        assert q.shape == (256, 512) and int(q.min()) >= -8 and int(q.max()) <= 7
    bad = _edit_description(tmp_path / "int4_group256", tmp_path / "v", lambda d: d.update(version="1.0.0"))
    with pytest.raises(WeightError, match="version 1.0.0 packs two int4 per byte"):
        MsModelSlim.open(bad)
    with pytest.raises(InputError, match="packs 2 output channels per byte"):
        quantize_checkpoint(_odd(tmp_path), tmp_path / "odd", "w4a8")      # 45 output channels


def _odd(tmp_path):
    src = tmp_path / "odd_float"
    src.mkdir()
    save_file({EXPERT.format("down"): torch.randn(45, 14)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    return src


def _static_w8a8(root, damage=None):
    """A one-linear checkpoint in static W8A8 (per-tensor input scale / offset, deq_scale, quant_bias)."""
    from ir.formats import quantize
    root.mkdir()
    g = torch.Generator().manual_seed(5)
    stored, (scale, offset) = quantize(torch.randn(6, 16, generator=g) * 0.1, FORMATS["int8_static"])
    m = "model.layers.0.self_attn.o_proj"
    in_s, in_off = torch.tensor([0.02]), torch.tensor([3], dtype=torch.int8)
    t = {f"{m}.weight": stored, f"{m}.weight_scale": scale, f"{m}.weight_offset": offset,
         f"{m}.input_scale": in_s, f"{m}.input_offset": in_off,
         f"{m}.deq_scale": (in_s * scale.reshape(-1)).to(torch.float32),
         f"{m}.quant_bias": (-3 * stored.to(torch.int64).sum(1)).to(torch.int32)}
    if damage:
        t[f"{m}.{damage}"] = t[f"{m}.{damage}"] + 1
    save_file(t, str(root / "model.safetensors"))
    (root / DESCRIPTION_FILE).write_text(json.dumps({"version": "1.0.0", **{n: "W8A8" for n in t}}))
    return root


def test_static_w8a8_is_checked_at_load(tmp_path):
    ms = MsModelSlim.open(_static_w8a8(tmp_path / "ok"))
    ms.check()
    assert ms.weights["model.layers.0.self_attn.o_proj.weight"].fmt is FORMATS["int8_static"]
    for damage, says in (("deq_scale", "not input_scale \\* weight_scale"), ("quant_bias", "not -input_offset")):
        with pytest.raises(WeightError, match=f"o_proj.{damage} \\(W8A8, int8_static\\): is {says}"):
            MsModelSlim.open(_static_w8a8(tmp_path / damage, damage)).check()


def test_a_checkpoint_in_another_int4_layout_than_the_config_says_is_one_weight_error(tiny, tmp_path):
    """config.json's w4a8_dynamic means msModelSlim 1.0.0's packed int4; one int4 a byte does not load as it."""
    from runtime import Engine
    out = tmp_path / "byte"
    quantize_checkpoint(tiny, out, "w4a8", int4_format="int4_channel_byte")
    with pytest.raises(WeightError, match=r"experts\.\d+\.(gate|up|down)_proj\.weight: checkpoint has shape"):
        Engine.from_pretrained(str(out), backend="reference", device="cpu", dtype=torch.float32)


def test_packed_int4_weighs_half_a_byte_an_element():
    from runtime.memory import weight_bytes
    from runtime.weights import WeightSpec
    assert weight_bytes({"w": WeightSpec((2, 8, 4), format="int4_channel")}, torch.bfloat16) == 32
    assert weight_bytes({"w": WeightSpec((2, 8, 4), format="int8_channel")}, torch.bfloat16) == 64


def test_anti_outlier_norm_biases_are_refused_not_dropped(w4a8, tmp_path):
    from runtime import Engine
    bias = "model.layers.0.input_layernorm.bias"
    out = _damage(w4a8, tmp_path, "model.layers.0.input_layernorm.weight", lambda t: t)
    file = json.loads((out / INDEX_FILE).read_text())["weight_map"]["model.layers.0.input_layernorm.weight"]
    tensors = load_file(str(out / file))
    tensors[bias] = torch.full_like(tensors["model.layers.0.input_layernorm.weight"], 0.1)
    save_file(tensors, str(out / file), metadata={"format": "pt"})
    index = json.loads((out / INDEX_FILE).read_text())
    index["weight_map"][bias] = file
    (out / INDEX_FILE).write_text(json.dumps(index))
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    (out / DESCRIPTION_FILE).write_text(json.dumps({**desc, bias: "FLOAT"}))
    MsModelSlim.open(out).check()            # a well-formed checkpoint ...
    with pytest.raises(WeightError, match=f"{bias} \\(FLOAT\\): an RMSNorm bias"):
        Engine.from_pretrained(str(out), backend="reference", device="cpu", dtype=torch.float32)   # ... not run


def test_random_weights_in_the_msmodelslim_formats_run_on_the_reference():
    """Engine.from_spec (benchmarks, smoke runs) quantises its random weights into the spec's integer formats."""
    from pathlib import Path

    import ir
    from ir.config_to_spec import spec_from_config
    from runtime import Engine
    tiny = json.loads((Path(__file__).resolve().parents[2] / "model_specs/hf_configs/deepseek_tiny.json").read_text())
    spec = ir.load_spec(spec_from_config({**tiny, "quantize": "w8a8_dynamic", "moe_quantize": "w4a8_dynamic"}),
                        file="config.json")
    engine = Engine.from_spec(spec, backend="reference", device="cpu", dtype=torch.float32)
    weights = engine.backend.weights
    experts = [n for n in weights if n.endswith("experts.*.down_proj.weight")]
    assert experts and all(weights[n].dtype == torch.int8 for n in experts)
    assert torch.isfinite(engine.logits([[1, 2, 3]])[0]).all()
