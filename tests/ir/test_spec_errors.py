"""Hand-written broken specs: each mistake gives one SpecError naming the file, the exact
YAML path and the line of the offending entry (the line is located by searching the
edited text, so the expectation does not drift when the spec is reformatted)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ir import SpecError, load_spec, parse_spec

BASE = (Path(__file__).resolve().parents[2] / "model_specs" / "deepseek_v2_lite.yaml").read_text()
FILE = "broken.yaml"


def _edit(old: str, new: str) -> tuple[str, int]:
    """The base spec with ``old`` (which must occur once) replaced by ``new``; and the line
    where ``new`` starts (or, when ``new`` is empty, where ``old`` was)."""
    assert BASE.count(old) == 1, f"{old!r} occurs {BASE.count(old)} times"
    at = BASE.index(old)
    return BASE.replace(old, new), BASE[:at].count("\n") + 1


def _line_of(text: str, needle: str) -> int:
    assert text.count(needle) == 1, needle
    return text[:text.index(needle)].count("\n") + 1


def _error(text: str) -> SpecError:
    with pytest.raises(SpecError) as err:
        load_spec(text, file=FILE)
    return err.value


def _check(err: SpecError, path: str, line: int, *fragments: str) -> None:
    assert (err.file, err.path, err.line) == (FILE, path, line), str(err)
    prefix = f"{FILE}:{line} at {path}: " if path else f"{FILE}:{line}: "
    assert str(err).startswith(prefix), str(err)
    for f in fragments:
        assert f in err.message, str(err)


def test_unknown_op():
    text, line = _edit("{op: silu_and_mul, in: [g, u], out: a}", "{op: swiglu, in: [g, u], out: a}")
    _check(_error(text), "blocks.dense_ffn.ops[2].op", line, "unknown op 'swiglu'", "silu_and_mul")


def test_a_typoed_op_gets_a_did_you_mean():
    text, line = _edit("{op: silu_and_mul, in: [g, u], out: a}", "{op: silu_and_mull, in: [g, u], out: a}")
    _check(_error(text), "blocks.dense_ffn.ops[2].op", line, "unknown op 'silu_and_mull'; did you mean 'silu_and_mul'?")


def test_a_typoed_dim_gets_a_did_you_mean():
    text, line = _edit("out_dim: moe_intermediate, out: [eg, eu]", "out_dim: moe_intermediat, out: [eg, eu]")
    _check(_error(text), "blocks.moe_ffn.ops[3].out_dim", line, "did you mean 'moe_intermediate'?")
    text, _ = _edit("  kv_lora_rank: 512         # C\n", "  kv_lora_rnk: 512\n")
    _check(_error(text), "dims", _line_of(text, "dims:\n"), "missing dim 'kv_lora_rank' ('kv_lora_rnk' is not a dim name")


def test_a_typoed_key_or_value_gets_a_did_you_mean():
    text, line = _edit("schema: 1", "schemaa: 1")
    _check(_error(text), "schemaa", line, "did you mean 'schema'?")
    text, line = _edit("in: [q_nope, q_rot, kv_cache]", "in: [q_nope, q_rott, kv_cache]")
    _check(_error(text), "blocks.mla.ops[7].in[1]", line, "did you mean 'q_rot'?")


def test_a_config_json_given_as_a_spec_points_to_spec_from_config():
    config = (Path(__file__).resolve().parents[2] / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text()
    with pytest.raises(SpecError, match="not a dsgraph spec: write a spec from it with `dsgraph spec --from-config"):
        load_spec(config, file="config.json")


def test_undefined_value():
    text, line = _edit("in: [q_nope, q_rot, kv_cache]", "in: [q_nope, q_rott, kv_cache]")
    _check(_error(text), "blocks.mla.ops[7].in[1]", line, "undefined value 'q_rott'", "q_rot")


def test_value_defined_twice():
    text, line = _edit("out_dim: intermediate, out: u}", "out_dim: intermediate, out: g}")
    _check(_error(text), "blocks.dense_ffn.ops[1].out", line, "value 'g' is defined twice")


def test_block_output_never_computed():
    text, line = _edit("    outputs: [logits]\n", "    outputs: [logit]\n")
    _check(_error(text), "blocks.head.outputs[0]", line, "block output 'logit' is never computed")


def test_o_proj_out_dim_wrong_is_a_shape_mismatch_at_the_residual_add():
    text, _ = _edit('o_proj.weight", out_dim: hidden, out: y}', 'o_proj.weight", out_dim: "hidden - 1", out: y}')
    err = _error(text)
    _check(err, "blocks.decoder_layer.ops[2]", _line_of(text, "{op: add, in: [x, attn_out], out: x_mid}"),
           "add (layer 0)", "act[T, 2048] and act[T, 2047]")


def test_kv_a_out_dim_wrong_is_a_shape_mismatch_at_the_split():
    text, _ = _edit('out_dim: "kv_lora_rank + qk_rope_head_dim", out: ckv}', 'out_dim: kv_lora_rank, out: ckv}')
    _check(_error(text), "blocks.mla.ops[3]", _line_of(text, "{op: split, in: ckv,"),
           "split (layer 0)", "sizes [512, 64] add up to 576, the input is act[T, 512]")


def test_dtype_mismatch_router_not_in_fp32():
    text, _ = _edit("out_dim: experts, precision: fp32,", "out_dim: experts, precision: act,")
    _check(_error(text), "blocks.moe_ffn.ops[1]", _line_of(text, "{op: moe_topk,"),
           "moe_topk (layer 1)", "expects fp32 router logits [T, E], got act[T, 64]")


def test_missing_dim():
    text, _ = _edit("  kv_lora_rank: 512         # C\n", "")
    _check(_error(text), "dims", _line_of(text, "dims:\n"), "missing dim 'kv_lora_rank'")


def test_undefined_dim_in_an_expression():
    text, line = _edit("out_dim: moe_intermediate, out: [eg, eu]", "out_dim: moe_intermediat, out: [eg, eu]")
    _check(_error(text), "blocks.moe_ffn.ops[3].out_dim", line, "undefined dim 'moe_intermediat'")


def test_null_dim_used():
    text, line = _edit('q_proj.weight", out_dim: "heads * (qk_nope_head_dim + qk_rope_head_dim)"',
                       'q_proj.weight", out_dim: q_lora_rank')
    _check(_error(text), "blocks.mla.ops[0].out_dim", line, "dim 'q_lora_rank' is null")


def test_dim_of_wrong_type():
    text, line = _edit("  heads: 16 ", "  heads: sixteen ")
    _check(_error(text), "dims.heads", line, "dim 'heads' must be a positive integer, got 'sixteen'")


def test_attribute_of_wrong_type():
    text, _ = _edit("norm_topk_prob: false,", "norm_topk_prob: 0,")
    _check(_error(text), "blocks.moe_ffn.ops[1].norm_topk_prob", _line_of(text, "norm_topk_prob: 0"),
           "attribute 'norm_topk_prob' of moe_topk: expected true or false, got 0")


def test_config_value_of_wrong_type():
    text, line = _edit("rms_norm_eps: 1.0e-06", "rms_norm_eps: [1.0e-06]")
    _check(_error(text), "config.rms_norm_eps", line, "expected a number")


def test_choice_attribute_out_of_range():
    text, line = _edit("scoring: softmax, method: greedy", "scoring: softmax, method: greedier")
    _check(_error(text), "blocks.moe_ffn.ops[1].method", line, "expected one of greedy, group_limited_greedy, noaux_tc")


def test_unknown_attribute():
    text, line = _edit('"model.norm.weight", out: h}', '"model.norm.weight", epsilon: 1.0e-05, out: h}')
    _check(_error(text), "blocks.head.ops[0].epsilon", line, "unknown attribute 'epsilon' for op 'rms_norm'")


def test_wrong_number_of_inputs():
    text, line = _edit("{op: add, in: [routed, shared], out: y}", "{op: add, in: [routed], out: y}")
    _check(_error(text), "blocks.moe_ffn.ops[11].in", line, "op 'add' takes 2 input(s), got 1")


def test_wrong_number_of_inputs_to_an_op_that_takes_a_range():
    """moe_combine_residual takes 3 or 4 inputs: the count is checked against the range (it used
    to be compared with the tuple itself, so the op could not be written in a spec at all)."""
    text, line = _edit("{op: moe_combine, in: [eo, topk_weights], out: routed}",
                       "{op: moe_combine_residual, in: [eo, topk_weights], out: routed}")
    _check(_error(text), "blocks.moe_ffn.ops[6].in", line, "op 'moe_combine_residual' takes 3 to 4 input(s), got 2")


def test_op_without_out():
    text, line = _edit('"model.norm.weight", out: h}', '"model.norm.weight"}')
    _check(_error(text), "blocks.head.ops[0]", line, "op 'rms_norm' needs 'out'")


def test_per_expert_weight_without_expert_placeholder():
    text, line = _edit('"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"',
                       '"model.layers.{layer}.mlp.experts.down_proj.weight"')
    _check(_error(text), "blocks.moe_ffn.ops[5].weight", line, "must contain {expert}")


def test_malformed_weight_template():
    text, line = _edit('weight: "model.norm.weight"', 'weight: "model.norm.{weight"')
    _check(_error(text), "blocks.head.ops[0].weight", line, "not a valid name template")


def test_layer_placeholder_outside_a_layer():
    text, line = _edit('weight: "model.norm.weight"', 'weight: "model.layers.{layer}.norm.weight"')
    _check(_error(text), "blocks.head.ops[0].weight", line, "uses {layer}", "outside a decoder layer")


def test_unknown_block_in_layer_plan():
    text, line = _edit("moe_layer: {attention: mla, ffn: moe_ffn}", "moe_layer: {attention: mla, ffn: moe}")
    _check(_error(text), "layer_plan.moe_layer.ffn", line, "unknown block 'moe'")


def test_blocks_calling_each_other_in_a_cycle():
    text, _ = _edit('{op: linear, in: a, weight: "model.layers.{layer}.mlp.down_proj.weight", out_dim: hidden, out: y}',
                    '{op: call, block: helper, in: a, out: y}')
    text += ("\n  helper:\n    inputs: [z]\n    outputs: [w]\n    ops:\n"
             "      - {op: call, block: dense_ffn, in: z, out: w}\n")
    _check(_error(text), "blocks.helper.ops[0].block", _line_of(text, "{op: call, block: dense_ffn,"),
           "blocks call each other in a cycle: dense_ffn -> helper -> dense_ffn")


def test_attention_placeholder_inside_the_attention_block():
    o_proj = '{op: linear, in: o, weight: "model.layers.{layer}.self_attn.o_proj.weight", out_dim: hidden, out: y}'
    text, line = _edit(o_proj, '{op: call, block: "{attention}", in: o, out: y}')
    _check(_error(text), "blocks.mla.ops[8].block", line, "cycle: mla -> mla")


def test_layer_placeholder_block_outside_a_layer():
    text, line = _edit('{op: embedding, in: ids, weight: "model.embed_tokens.weight", out: x}',
                       '{op: embedding, in: ids, weight: "model.embed_tokens.weight", out: x0}\n'
                       '      - {op: call, block: "{ffn}", in: x0, out: x}')
    _check(_error(text), "blocks.embed.ops[1].block", line + 1, "{ffn}", "outside")


def test_zero_or_negative_dims_in_attributes():
    text, line = _edit("out_dim: intermediate, out: g}", "out_dim: 0, out: g}")
    _check(_error(text), "blocks.dense_ffn.ops[0].out_dim", line, "a dim must be a positive integer, got 0")
    text, line = _edit('out_dim: hidden, out: shared}', 'out_dim: "hidden // (heads - 16)", out: shared}')
    _check(_error(text), "blocks.moe_ffn.ops[10].out_dim", line, "division by zero")


def test_yarn_with_impossible_original_length():
    text, line = _edit("original_max_position_embeddings: 4096", "original_max_position_embeddings: 0")
    _check(_error(text), "config.rope.original_max_position_embeddings", line, "must be positive")


def test_unknown_top_level_key():
    text = BASE + "extras: 1\n"
    _check(_error(text), "extras", _line_of(text, "extras: 1"), "unknown top-level key 'extras'")


def test_duplicate_key():
    text, line = _edit("  heads: 16 ", "  heads: 16\n  heads: 16 ")
    _check(_error(text), "dims", line + 1, "duplicate key 'heads'")


def test_not_yaml():
    text, line = _edit("  heads: 16 ", "  heads: [16 ")
    err = _error(text)
    assert err.file == FILE and err.line is not None and "not valid YAML" in str(err)


def test_spec_file_name_is_the_basename(tmp_path):
    text, line = _edit("{op: silu_and_mul, in: [g, u], out: a}", "{op: swiglu, in: [g, u], out: a}")
    path = tmp_path / "my_model.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(str(path))
    assert str(err.value).startswith(f"my_model.yaml:{line} at blocks.dense_ffn.ops[2].op: ")


def test_parse_spec_alone_skips_shapes():
    """parse_spec checks names and structure only; load_spec also builds the graph."""
    text, _ = _edit('o_proj.weight", out_dim: hidden, out: y}', 'o_proj.weight", out_dim: "hidden - 1", out: y}')
    assert parse_spec(text, FILE).dims["hidden"] == 2048
    with pytest.raises(SpecError):
        load_spec(text, file=FILE)
