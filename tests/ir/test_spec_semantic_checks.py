"""Specs and configs that are well-formed but state a model the kernels would run wrongly: each is
one SpecError naming the file, the YAML path (or config key) and the line, before anything is
compiled.  Before these checks every one of them compiled and ran: an rms_norm eps of -1 gave NaN
logits, a router two experts wide only ever routed to 2 of 8 experts, a gelu config ran silu, and a
dim past int32 failed in NVRTC."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ir import SpecError, build_graph, load_spec, verify
from ir.config_to_spec import spec_from_config
from ir.ops import OPS
from ir.ops.base import MAX_WIDTH, AttrError

ROOT = Path(__file__).resolve().parents[2]
TINY = (ROOT / "model_specs" / "deepseek_tiny.yaml").read_text()
FILE = "i.yaml"


def _config(name: str) -> dict:
    return json.loads((ROOT / "model_specs" / "hf_configs" / f"{name}.json").read_text())


def _error(*edits: tuple[str, str]) -> tuple[SpecError, str]:
    text = TINY
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    with pytest.raises(SpecError) as err:
        load_spec(text, file=FILE)
    return err.value, text


def _check(err: SpecError, text: str, path: str, needle: str, *fragments: str) -> None:
    """err names FILE, `path` and the line holding `needle`, and says each fragment, in one line."""
    assert text.count(needle) == 1, needle
    line = text[:text.index(needle)].count("\n") + 1
    assert (err.file, err.path, err.line) == (FILE, path, line), str(err)
    assert str(err).startswith(f"{FILE}:{line} at {path}: ") and "\n" not in str(err), str(err)
    for f in fragments:
        assert f in err.message, str(err)


# -- 1. numeric attributes and dims: ranges stated once, with the attribute -------------------

@pytest.mark.parametrize("eps", ["-1.0", "0.0", "0"])
def test_rms_norm_eps_must_be_positive(eps):
    err, text = _error(("eps: 1.0e-6, out: c_n}", f"eps: {eps}, out: c_n}}"))
    _check(err, text, "blocks.mla.ops[4].eps", f"eps: {eps}, out: c_n", "attribute 'eps' of rms_norm", "> 0")


@pytest.mark.parametrize("factor", ["0.0", "-2.5"])
def test_routed_scaling_factor_must_be_positive(factor):
    err, text = _error(("routed_scaling_factor: 1.0,", f"routed_scaling_factor: {factor},"))
    _check(err, text, "blocks.moe_ffn.ops[1].routed_scaling_factor", f"routed_scaling_factor: {factor}",
           "attribute 'routed_scaling_factor' of moe_topk", "> 0")


def test_a_negative_shared_expert_count_is_refused_where_written():
    err, text = _error(("{op: moe_combine, in: [eo, topk_weights], out: routed}",
                        "{op: moe_combine_residual, in: [eo, topk_weights, x, x], shared_experts: -1, out: routed}"))
    _check(err, text, "blocks.moe_ffn.ops[6].shared_experts", "shared_experts: -1",
           "attribute 'shared_experts' of moe_combine_residual", ">= 0")


def test_every_numeric_attribute_states_its_range():
    """A new op's eps or scale cannot silently accept 0 or a negative value: every float attribute
    is declared positive, every int attribute has a minimum, every dim is >= 1 and within MAX_WIDTH."""
    for name, op in OPS.items():
        for key, attr in op.attrs.items():
            where = f"{name}.{key}"
            if attr.kind == "float":
                assert attr.positive, where
                for bad in (0, -1.0):
                    with pytest.raises(AttrError):
                        attr.parse(bad, {})
            elif attr.kind == "int":
                assert attr.minimum is not None, where
                with pytest.raises(AttrError):
                    attr.parse(attr.minimum - 1, {})
            elif attr.kind in ("dim", "dims"):
                for bad in (0, MAX_WIDTH + 1):
                    with pytest.raises(AttrError):
                        attr.parse([bad] if attr.kind == "dims" else bad, {})


def test_top_k_past_the_experts_is_a_dims_error():
    err, text = _error(("  top_k: 2 ", "  top_k: 9 "))
    _check(err, text, "dims.top_k", "top_k: 9 ", "top_k (9) must be at most experts (8)")


def test_topk_groups_past_the_groups_is_a_dims_error():
    err, text = _error(("  topk_groups: 1\n", "  topk_groups: 2\n"))
    _check(err, text, "dims.topk_groups", "topk_groups: 2", "topk_groups (2) must be at most groups (1)")


def test_an_op_that_routes_another_top_k_than_the_dims_is_refused():
    err, text = _error(("top_k: top_k,", "top_k: 1,"))
    _check(err, text, "blocks.moe_ffn.ops[1]", "{op: moe_topk,", "moe_topk (layer 1)",
           "top_k=1 differs from the spec's dims.top_k (2)")


# -- 2. widths an op's attributes imply ------------------------------------------------------

def test_router_narrower_than_the_experts_is_refused():
    err, text = _error(("out_dim: experts, precision: fp32", "out_dim: top_k, precision: fp32"))
    _check(err, text, "blocks.moe_ffn.ops[1]", "{op: moe_topk,", "moe_topk (layer 1)",
           "the router's width (2", "number of routed experts (dims.experts = 8)")


def test_expert_ops_that_stack_another_expert_count_are_refused():
    text = TINY.replace("num_experts: experts", "num_experts: 4")
    with pytest.raises(SpecError) as err:
        load_spec(text, file=FILE)
    _check(err.value, text, "blocks.moe_ffn.ops[3]", "{op: moe_gate_up,", "moe_gate_up (layer 1)",
           "gate stacks 4 experts (num_experts)", "dims.experts = 8")


# -- 4. dims the kernels' 32-bit indices cannot reach ------------------------------------------

def test_a_dim_past_the_kernels_index_range_is_a_dims_error():
    err, text = _error(("  hidden: 128 ", "  hidden: 99999999999 "))
    _check(err, text, "dims.hidden", "hidden: 99999999999", "99999999999 is past the 536854528", "32-bit")


def test_a_derived_width_past_the_index_range_is_refused_at_its_op():
    # Each dim is fine; the attention's output width H*V = 20000 * 30000 is not.
    err, text = _error(("  heads: 4 ", "  heads: 20000 "), ("  v_head_dim: 32 ", "  v_head_dim: 30000 "))
    _check(err, text, "blocks.mla.ops[7]", "{op: mla_attention,", "mla_attention (layer 0)", "value o would be act[T, 600000000]",
           f"past the {MAX_WIDTH}")


def test_the_limit_is_a_quarter_of_int32_less_tile_padding():
    assert MAX_WIDTH == (2**31 - 2**16) // 4 == 536854528


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_the_largest_shipped_specs_pass(name):
    spec = load_spec(str(ROOT / "model_specs" / f"{name}.yaml"))
    verify(build_graph(spec, "decode"))


# -- 3. config keys the kernels do not implement ---------------------------------------------

def _config_error(base: str, **changes) -> SpecError:
    cfg = {**_config(base), **changes}
    with pytest.raises(SpecError) as err:
        spec_from_config(cfg)
    assert err.value.file == "config.json" and "\n" not in str(err.value), str(err.value)
    return err.value


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_an_activation_other_than_silu_is_refused(act):
    err = _config_error("deepseek_tiny", hidden_act=act)
    assert err.path == "hidden_act" and f"hidden_act {act!r} is not supported" in err.message
    assert "silu only" in err.message


@pytest.mark.parametrize("base, key", [("deepseek_tiny", "attention_bias"), ("deepseek_v3", "attention_bias"),
                                       ("deepseek_tiny", "mlp_bias")])
def test_biases_are_refused(base, key):
    err = _config_error(base, **{key: True})
    assert err.path == key and "no bias" in err.message


@pytest.mark.parametrize("quant", [
    {"quant_method": "gptq", "bits": 4, "group_size": 128},
    {"quant_method": "awq", "bits": 4},
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {"load_in_8bit": True},
])
def test_quantisations_the_loader_does_not_dequantise_are_refused(quant):
    err = _config_error("deepseek_tiny", quantization_config=quant)
    assert err.path == "quantization_config.quant_method" and "is not supported" in err.message
    assert "fp8" in err.message


@pytest.mark.parametrize("key, value", [("weight_block_size", [64, 64]), ("fmt", "e5m2"),
                                        ("activation_scheme", "static"), ("scale_fmt", "ue8m0")])
def test_fp8_other_than_deepseek_v3s_blocks_is_refused(key, value):
    quant = {**_config("deepseek_v3")["quantization_config"], key: value}
    err = _config_error("deepseek_v3", quantization_config=quant)
    assert err.path == f"quantization_config.{key}" and f"{value!r} is not supported" in err.message


@pytest.mark.parametrize("factor", [0.0, -1.0])
def test_a_routed_scaling_factor_of_zero_or_less_is_refused_at_its_key(factor):
    err = _config_error("deepseek_tiny", routed_scaling_factor=factor)
    assert err.path == "routed_scaling_factor" and "positive" in err.message


def test_what_runs_is_accepted_and_absent_keys_mean_transformers_defaults():
    spec_from_config(_config("deepseek_v3"))                            # its FP8 block quantisation
    spec_from_config({**_config("deepseek_v3"), "quantization_config": {
        **_config("deepseek_v3")["quantization_config"], "activation_scheme": "Dynamic", "weight_block_size": (128, 128)}})
    spec_from_config({**_config("deepseek_v3"), "quantization_config": {"quant_method": "fp8"}})
    spec_from_config({**_config("deepseek_v3"), "mlp_bias": True})      # DeepseekV3 has no mlp_bias
    spec_from_config({**_config("deepseek_tiny"), "hidden_act": "swish"})   # transformers: also SiLU
    cfg = _config("deepseek_tiny")
    for key in ("hidden_act", "attention_bias"):
        del cfg[key]
    assert spec_from_config(cfg) == spec_from_config(_config("deepseek_tiny"))


def test_from_pretrained_writes_its_spec_through_the_same_check():
    from runtime.model_loader import resolve_spec
    with pytest.raises(SpecError) as err:
        resolve_spec(None, {**_config("deepseek_tiny"), "hidden_act": "gelu"})
    assert err.value.file == "config.json" and err.value.path == "hidden_act"
