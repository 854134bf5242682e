"""Hugging Face DeepSeek-V2/V3 ``config.json`` -> a dsgraph spec (YAML text).

The spec states the math op by op; this module only picks, from the config, which
of DeepSeek's published variants each part is: q projected directly or through
q_lora, the rope pair layout, the router's scoring and top-k method.
"""
from __future__ import annotations

import json
import math
import os
import re

import yaml

from .errors import SpecError
from .formats import FP8, FP8_BLOCK, FP8_CHECKPOINT_GLOBS, weight_formats_yaml

CONFIG = "config.json"
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")

HEADER = """\
# {title}
# Written by `dsgraph spec --from-config`; edit freely, it is the source of truth once written.
# Dimension legend used in every shape comment:
#   T tokens in the step, D hidden, H heads, C kv_lora_rank, R qk_rope_head_dim,
#   N qk_nope_head_dim, V v_head_dim, Q q_lora_rank, I dense intermediate,
#   M moe_intermediate, E routed experts, K experts per token.
"""

Q_DIRECT = """\
      - {op: linear, in: x, weight: "model.layers.{layer}.self_attn.q_proj.weight", out_dim: "heads * (qk_nope_head_dim + qk_rope_head_dim)", out: q}   # [T, H*(N+R)]
"""
Q_LORA = """\
      - {op: linear, in: x, weight: "model.layers.{layer}.self_attn.q_a_proj.weight", out_dim: q_lora_rank, out: q_a}                               # [T, Q]
      - {op: rms_norm, in: q_a, weight: "model.layers.{layer}.self_attn.q_a_layernorm.weight", eps: 1.0e-6, out: q_a_n}   # eps fixed, as in transformers
      - {op: linear, in: q_a_n, weight: "model.layers.{layer}.self_attn.q_b_proj.weight", out_dim: "heads * (qk_nope_head_dim + qk_rope_head_dim)", out: q}  # [T, H*(N+R)]
"""

BODY = """\
layer_plan:
  first_k_dense_replace: {first_k_dense_replace}        # layers [0, {first_k_dense_replace}) use the dense FFN
  moe_layer_freq: {moe_layer_freq}               # then layer i is MoE when i % moe_layer_freq == 0
  dense_layer: {{attention: mla, ffn: dense_ffn}}
  moe_layer: {{attention: mla, ffn: moe_ffn}}

blocks:
  embed:                          # ids: [T] -> x: [T, D]
    inputs: [ids]
    outputs: [x]
    ops:
      - {{op: embedding, in: ids, weight: "model.embed_tokens.weight", out: x}}

  decoder_layer:                  # pre-norm residual around attention and FFN
    inputs: [x]
    outputs: [x_out]
    ops:
      - {{op: rms_norm, in: x, weight: "model.layers.{{layer}}.input_layernorm.weight", out: h_attn}}
      - {{op: call, block: "{{attention}}", in: h_attn, out: attn_out}}
      - {{op: add, in: [x, attn_out], out: x_mid}}
      - {{op: rms_norm, in: x_mid, weight: "model.layers.{{layer}}.post_attention_layernorm.weight", out: h_ffn}}
      - {{op: call, block: "{{ffn}}", in: h_ffn, out: ffn_out}}
      - {{op: add, in: [x_mid, ffn_out], out: x_out}}

  mla:                            # x: [T, D] -> y: [T, D]
    inputs: [x]
    outputs: [y]
    ops:
{q_ops}\
      - {{op: split, in: q, heads: heads, sizes: [qk_nope_head_dim, qk_rope_head_dim], out: [q_nope, q_pe]}}                                        # [T, H, N], [T, H, R]
      - {{op: linear, in: x, weight: "model.layers.{{layer}}.self_attn.kv_a_proj_with_mqa.weight", out_dim: "kv_lora_rank + qk_rope_head_dim", out: ckv}}  # [T, C+R]
      - {{op: split, in: ckv, sizes: [kv_lora_rank, qk_rope_head_dim], out: [c, k_pe]}}                                                             # [T, C], [T, R]
      - {{op: rms_norm, in: c, weight: "model.layers.{{layer}}.self_attn.kv_a_layernorm.weight", eps: 1.0e-6, out: c_n}}   # eps fixed, as in transformers
      - {{op: rope, in: [q_pe, k_pe], pairs: {rope_pairs}, output: {rope_output}, out: [q_rot, k_rot]}}
      - {{op: cache_write, in: [c_n, k_rot], out: kv_cache}}                                                                                          # rows [C | R]
      - {{op: mla_attention, in: [q_nope, q_rot, kv_cache], kv_b: "model.layers.{{layer}}.self_attn.kv_b_proj.weight", out: o}}                     # [T, H*V]
      - {{op: linear, in: o, weight: "model.layers.{{layer}}.self_attn.o_proj.weight", out_dim: hidden, out: y}}

  dense_ffn:                      # x: [T, D] -> y: [T, D]
    inputs: [x]
    outputs: [y]
    ops:
      - {{op: linear, in: x, weight: "model.layers.{{layer}}.mlp.gate_proj.weight", out_dim: intermediate, out: g}}
      - {{op: linear, in: x, weight: "model.layers.{{layer}}.mlp.up_proj.weight", out_dim: intermediate, out: u}}
      - {{op: silu_and_mul, in: [g, u], out: a}}
      - {{op: linear, in: a, weight: "model.layers.{{layer}}.mlp.down_proj.weight", out_dim: hidden, out: y}}

  moe_ffn:                        # x: [T, D] -> y: [T, D]
    inputs: [x]
    outputs: [y]
    ops:
      - {{op: linear, in: x, weight: "model.layers.{{layer}}.mlp.gate.weight", out_dim: experts, precision: fp32, out: router_logits}}   # [T, E] fp32
      - {{op: moe_topk, in: router_logits, scoring: {scoring}, method: {method}, top_k: top_k, groups: groups, topk_groups: topk_groups,
         norm_topk_prob: {norm_topk_prob}, routed_scaling_factor: {routed_scaling_factor},{bias} out: [topk_ids, topk_weights]}}      # [T, K]
      - {{op: moe_align, in: topk_ids, num_experts: experts, out: routing}}
      - {{op: moe_gate_up, in: [x, routing], gate: "model.layers.{{layer}}.mlp.experts.{{expert}}.gate_proj.weight",
         up: "model.layers.{{layer}}.mlp.experts.{{expert}}.up_proj.weight", num_experts: experts, out_dim: moe_intermediate, out: [eg, eu]}}  # [T*K, M] each
      - {{op: silu_and_mul, in: [eg, eu], out: ea}}                                                                                     # [T*K, M]
      - {{op: moe_down, in: [ea, routing], weight: "model.layers.{{layer}}.mlp.experts.{{expert}}.down_proj.weight", num_experts: experts, out_dim: hidden, out: eo}}  # [T*K, D]
      - {{op: moe_combine, in: [eo, topk_weights], out: routed}}                                                                       # [T, D]
      - {{op: linear, in: x, weight: "model.layers.{{layer}}.mlp.shared_experts.gate_proj.weight", out_dim: "moe_intermediate * shared_experts", out: sg}}
      - {{op: linear, in: x, weight: "model.layers.{{layer}}.mlp.shared_experts.up_proj.weight", out_dim: "moe_intermediate * shared_experts", out: su}}
      - {{op: silu_and_mul, in: [sg, su], out: sa}}
      - {{op: linear, in: sa, weight: "model.layers.{{layer}}.mlp.shared_experts.down_proj.weight", out_dim: hidden, out: shared}}
      - {{op: add, in: [routed, shared], out: y}}

  head:                           # x: [T, D] -> logits: [T, vocab]
    inputs: [x]
    outputs: [logits]
    ops:
      - {{op: rms_norm, in: x, weight: "model.norm.weight", out: h}}
      - {{op: linear, in: h, weight: "{lm_head}", out_dim: vocab, out: logits}}
"""


def _num(x) -> str:
    """Floats written so YAML reads them back as floats (1.0e-06, not 1e-06)."""
    text = repr(float(x))
    if "e" in text and "." not in text.split("e")[0]:
        mant, exp = text.split("e")
        text = f"{mant}.0e{exp}"
    return text


class _Config:
    """Typed reads of a config.json dict: every value the spec uses is checked here, so a bad
    one is a SpecError naming the config file and its key, never a TypeError further on."""

    def __init__(self, cfg: dict, file: str):
        self.cfg, self.file = cfg, file

    def error(self, key: str, message: str) -> SpecError:
        return SpecError(message, file=self.file, path=key)

    def int(self, key: str, *, minimum: int = 1, default=..., source: dict | None = None, prefix: str = ""):
        """An integer >= minimum; a missing or null key gives `default` (or an error when there is none)."""
        data = self.cfg if source is None else source
        value = data.get(key)
        if value is None:
            if default is ...:
                raise self.error(prefix + key, f"config.json lacks {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(prefix + key, f"{key} must be an integer >= {minimum}, got {value!r}")
        if value < minimum:
            raise self.error(prefix + key, f"{key} must be an integer >= {minimum}, got {value}")
        return value

    def float(self, key: str, *, default, positive: bool = False, source: dict | None = None, prefix: str = ""):
        """A finite number (positive when asked); a missing or null key gives `default`."""
        data = self.cfg if source is None else source
        value = data.get(key)
        if value is None:
            return default
        what = "a positive finite number" if positive else "a finite number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(prefix + key, f"{key} must be {what}, got {value!r}")
        if positive and value <= 0:
            raise self.error(prefix + key, f"{key} must be {what}, got {value!r}")
        return value

    def bool(self, key: str, *, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"{key} must be true or false, got {value!r}")
        return value

    def str(self, key: str, *, default):
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, f"{key} must be a string, got {value!r}")
        return value


def _rope_params(c: _Config) -> dict:
    cfg = c.cfg
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    raw = cfg.get(key) or {}
    if not isinstance(raw, dict):
        raise c.error(key, f"{key} must be a mapping (or null), got {raw!r}")
    p = f"{key}."
    theta = c.float("rope_theta", source=raw, prefix=p, positive=True, default=None)
    if theta is None:
        theta = c.float("rope_theta", default=10000.0, positive=True)
    kind = raw.get("type", raw.get("rope_type", "default"))
    if kind in (None, "default"):
        return {"theta": theta, "scaling": "none"}
    if kind != "yarn":
        raise SpecError(f"rope scaling {kind!r} is not supported (DeepSeek models use yarn or none)", file=c.file,
                        path="rope_scaling")
    out = {"theta": theta, "scaling": "yarn"}
    if raw.get("original_max_position_embeddings") is None:
        raise SpecError("yarn rope scaling needs original_max_position_embeddings", file=c.file, path="rope_scaling")
    orig = c.int("original_max_position_embeddings", source=raw, prefix=p)
    factor = c.float("factor", source=raw, prefix=p, positive=True, default=None)
    if factor is None:
        factor = c.int("max_position_embeddings") / orig
    out.update(factor=factor, original_max_position_embeddings=orig,
               beta_fast=c.float("beta_fast", source=raw, prefix=p, positive=True, default=None) or 32,
               beta_slow=c.float("beta_slow", source=raw, prefix=p, positive=True, default=None) or 1)
    mscale = c.float("mscale", source=raw, prefix=p, default=None)
    if mscale:
        # Left out when unset: transformers then scales cos/sin by mscale(factor) even if
        # mscale_all_dim is set, which is what RopeConfig's default (0.0, unset) means.
        out["mscale"] = mscale
    out["mscale_all_dim"] = c.float("mscale_all_dim", source=raw, prefix=p, default=None) or 0.0
    if "truncate" in raw:
        if not isinstance(raw["truncate"], bool):
            raise c.error(p + "truncate", f"truncate must be true or false, got {raw['truncate']!r}")
        out["truncate"] = raw["truncate"]
    return out


# What the kernels compute, for the config keys that could ask for something else (absent keys
# take transformers' DeepseekV2/V3Config defaults: silu, no biases, no quantization).
SILU = ("silu", "swish")          # transformers' ACT2FN: both names are SiLU
# The one quantisation a config may ask for: DeepSeek-V3's FP8 checkpoints (F8_E4M3 weights, a
# float32 inverse scale per 128x128 block; transformers' FineGrainedFP8Config), ir/formats.FP8.
# Each key may be absent (transformers' default is the value here) or equal to it.
FP8_METHOD = "fp8"
KEPT_UNQUANTISED = ("lm_head", "model.embed_tokens")   # modules_to_not_convert entries that change nothing here
FP8_KEYS = {"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "scale_fmt": "float", "expert_dtype": "fp8"}


def check_computable(cfg: dict, *, file: str = CONFIG) -> None:
    """Refuse a config whose model the kernels would compute wrongly: another activation than
    SiLU, projections with biases, weights quantised in another format than ir/formats.FP8.
    spec_from_config runs it; so may whoever pairs a checkpoint with a spec of its own."""
    _check_computable(_Config(cfg, file), cfg.get("model_type") == "deepseek_v3")


def _check_computable(c: _Config, v3: bool) -> bool:
    """Raise on what the kernels would compute wrongly; whether the checkpoint stores FP8 weights."""
    act = c.str("hidden_act", default="silu")
    if act not in SILU:
        raise c.error("hidden_act", f"hidden_act {act!r} is not supported: dsgraph's kernels implement silu only")
    biases = ["attention_bias"] + ([] if v3 else ["mlp_bias"])   # transformers' DeepseekV3 has no mlp_bias
    for key in biases:
        if c.bool(key, default=False):
            raise c.error(key, f"{key}: true is not supported: dsgraph's projections have no bias")
    quant = c.cfg.get("quantization_config")
    if quant is None:
        return False
    if not isinstance(quant, dict):
        raise c.error("quantization_config", f"quantization_config must be a mapping (or null), got {quant!r}")
    method = quant.get("quant_method")
    if method != FP8_METHOD:
        what = "a quantization_config without quant_method" if method is None else f"quantization {method!r}"
        raise c.error("quantization_config.quant_method",
                      f"{what} is not supported: dsgraph loads unquantised weights or DeepSeek-V3's "
                      f"FP8 (quant_method {FP8_METHOD}: e4m3 weights, a float32 scale per {FP8_BLOCK}x{FP8_BLOCK} block)")
    for key, accepted in FP8_KEYS.items():
        value = quant.get(key)
        # as transformers reads them: a block size may be a tuple, activation_scheme any case
        seen = list(value) if isinstance(value, tuple) else value.lower() if isinstance(value, str) else value
        if value is not None and seen != accepted:
            raise c.error(f"quantization_config.{key}", f"fp8 {key} {value!r} is not supported: dsgraph reads "
                                                        f"{key} {accepted!r} only")
    for module in quant.get("modules_to_not_convert") or ():
        if module not in KEPT_UNQUANTISED:
            raise c.error("quantization_config.modules_to_not_convert",
                          f"module {module!r} kept unquantised is not supported: dsgraph's FP8 layout stores every "
                          f"decoder-layer linear in FP8 (write the spec's weight_formats by hand for another split)")
    return True


# Huawei msModelSlim's config.json keys: `quantize` for the ordinary linears, `moe_quantize` for the routed
# experts (runtime/msmodelslim.py reads the checkpoint).  What each value stores the weights as
# (ir/formats.py); w4a8_dynamic is msModelSlim 1.0.0's packed per-channel int4 -- a checkpoint in an older
# int4 layout is a WeightError at load naming the tensor.
MSMODELSLIM_FORMATS = {"w8a8_dynamic": "int8_channel", "w4a8_dynamic": "int4_channel"}


def _msmodelslim_formats(c: _Config, has_moe: bool) -> str:
    """The spec's weight_formats for a config with msModelSlim's `quantize` / `moe_quantize`, or ""."""
    dense, moe = c.cfg.get("quantize"), c.cfg.get("moe_quantize")
    if dense is None and moe is None:
        return ""
    if c.cfg.get("quantization_config") is not None:
        raise c.error("quantize", "a config with both quantization_config and msModelSlim's quantize is ambiguous")
    for key, value, accepted in (("quantize", dense, ("w8a8_dynamic",)),
                                 ("moe_quantize", moe, ("w8a8_dynamic", "w4a8_dynamic"))):
        if value is not None and value not in accepted:
            raise c.error(key, f"{key} {value!r} is not supported: dsgraph reads msModelSlim's "
                               f"{' and '.join(accepted)} (static w8a8 is checked at load but not run)")
    if dense is None:
        raise c.error("moe_quantize", "moe_quantize without quantize: msModelSlim quantises the other linears too")
    return msmodelslim_weight_formats(dense, moe, has_moe)


def msmodelslim_weight_formats(dense: str, moe: str | None, has_moe: bool) -> str:
    """A spec's ``weight_formats:`` section for msModelSlim's `quantize` = `dense` and `moe_quantize` = `moe`
    (None: the routed experts as `dense`), both checked values of MSMODELSLIM_FORMATS; `has_moe`: whether the
    spec has a MoE layer (a glob must match some weight)."""
    rules = [("model.layers.*.self_attn.kv_b_proj.weight", "act")]   # msModelSlim keeps kv_b_proj float
    if has_moe:
        rules.append(("model.layers.*.mlp.experts.*", MSMODELSLIM_FORMATS[moe or dense]))
    rules += [("model.layers.*.self_attn.*_proj*.weight", MSMODELSLIM_FORMATS[dense]),
              ("model.layers.*.mlp.*_proj.weight", MSMODELSLIM_FORMATS[dense])]
    lines = ["", "weight_formats:                 # msModelSlim's layout (config.json quantize / moe_quantize; "
                 "first match wins)"]
    lines += [f"  {json.dumps(g)}: {f}" for g, f in rules]
    return "\n".join(lines) + "\n"


def _yaml_str(text: str) -> str:
    """`text` as a YAML scalar that reads back as this string: plain when it is a simple
    name (the shipped specs), else double-quoted (JSON's quoting is valid YAML)."""
    if _PLAIN_NAME.fullmatch(text) and yaml.safe_load(text) == text:
        return text
    return json.dumps(text, ensure_ascii=False)


def spec_from_config(cfg: dict, name: str | None = None, title: str | None = None, *, file: str = CONFIG,
                     weight_formats: bool = True) -> str:
    """Return spec YAML text for a Hugging Face DeepSeek-V2/V3 config dict.  Every value it
    reads is checked first (type, range, the constraints between dims), so a config it cannot
    translate is one SpecError naming `file` and the key.  A quantization_config (DeepSeek-V3's
    FP8) becomes the spec's weight_formats, so the weights load as stored; weight_formats=False
    leaves it out (the architecture alone: model_specs/deepseek_v3.yaml, whose FP8 form is
    `--dtype fp8`)."""
    if not isinstance(cfg, dict):
        raise SpecError(f"a config.json is a JSON object, got {type(cfg).__name__}", file=file)
    c = _Config(cfg, file)
    model_type = cfg.get("model_type")
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        raise SpecError(f"model_type must be deepseek_v2 or deepseek_v3, got {model_type!r}", file=file,
                        path="model_type")
    required = ["hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                "vocab_size", "num_hidden_layers", "max_position_embeddings"]
    for key in required:
        if cfg.get(key) is None:
            raise SpecError(f"config.json lacks {key!r}", file=file, path=key)
    ints = {key: c.int(key) for key in required}
    q_lora_rank = c.int("q_lora_rank", default=None)
    shared = c.int("n_shared_experts", minimum=0, default=0)
    n_group = c.int("n_group", default=1)
    topk_group = c.int("topk_group", default=1)
    first_dense = c.int("first_k_dense_replace", minimum=0, default=0)
    moe_freq = c.int("moe_layer_freq", default=1)
    E, K = ints["n_routed_experts"], ints["num_experts_per_tok"]
    if ints["qk_rope_head_dim"] % 2:
        raise c.error("qk_rope_head_dim", f"qk_rope_head_dim must be even (rotary pairs), got {ints['qk_rope_head_dim']}")
    if K > E:
        raise c.error("num_experts_per_tok", f"num_experts_per_tok ({K}) must be at most n_routed_experts ({E})")
    if E % n_group:
        raise c.error("n_group", f"n_routed_experts ({E}) must divide into n_group ({n_group}) equal groups")
    if topk_group > n_group:
        raise c.error("topk_group", f"topk_group ({topk_group}) must be at most n_group ({n_group})")
    v3 = model_type == "deepseek_v3"
    fp8 = _check_computable(c, v3)
    tie = c.bool("tie_word_embeddings", default=False)
    if v3:
        scoring, method = "sigmoid", "noaux_tc"   # transformers' DeepseekV3 always routes this way
        norm = c.bool("norm_topk_prob", default=True)
        interleave = c.bool("rope_interleave", default=True)
        rope_pairs, rope_output = ("adjacent", "halves") if interleave else ("halves", "halves")
    else:
        scoring = cfg.get("scoring_func", "softmax")
        method = cfg.get("topk_method", "greedy")
        if scoring != "softmax" or method not in ("greedy", "group_limited_greedy"):
            raise SpecError(f"deepseek_v2 routing {scoring}/{method} is not supported", file=file, path="topk_method")
        norm = False  # transformers' DeepseekV2 ignores norm_topk_prob; we match it
        rope_pairs, rope_output = "adjacent", "interleaved"
    rope = _rope_params(c)
    eps = c.float("rms_norm_eps", default=1e-6, positive=True)
    routed_scaling_factor = c.float("routed_scaling_factor", default=1.0, positive=True)
    dims = {
        "hidden": ("D", ints["hidden_size"]), "heads": ("H", ints["num_attention_heads"]),
        "q_lora_rank": ("Q", q_lora_rank), "kv_lora_rank": ("C", ints["kv_lora_rank"]),
        "qk_nope_head_dim": ("N", ints["qk_nope_head_dim"]), "qk_rope_head_dim": ("R", ints["qk_rope_head_dim"]),
        "v_head_dim": ("V", ints["v_head_dim"]), "intermediate": ("I", ints["intermediate_size"]),
        "moe_intermediate": ("M", ints["moe_intermediate_size"]), "experts": ("E", E),
        "shared_experts": ("", shared), "top_k": ("K", K),
        "groups": ("", n_group), "topk_groups": ("", topk_group), "vocab": ("", ints["vocab_size"]),
        "layers": ("", ints["num_hidden_layers"]), "max_positions": ("", ints["max_position_embeddings"]),
    }
    if not shared:
        raise SpecError("models without shared experts are not supported yet", file=file, path="n_shared_experts")
    if not name:
        name = c.str("_name_or_path", default="").split("/")[-1].lower().replace("-", "_") or model_type
    title = (title or f"{name} ({model_type})").replace("\r", " ").replace("\n", " ")   # one comment line
    lines = [HEADER.format(title=title), "schema: 1", f"name: {_yaml_str(name)}",
             f"model_type: {model_type}", "", "dims:"]
    for key, (letter, value) in dims.items():
        text = "null" if value is None else str(value)
        # ljust(27) + " ": the comment column of the shipped specs, and always a space before "#"
        # (YAML reads "1000000000000# R" as one string).
        lines.append((f"  {key}: {text}".ljust(27) + " " + (f"# {letter}" if letter else "")).rstrip())
    lines += ["", "config:", f"  rms_norm_eps: {_num(eps)}",
              f"  tie_word_embeddings: {'true' if tie else 'false'}", "  rope:"]
    for key, value in rope.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = value
        elif key == "original_max_position_embeddings":
            text = str(int(value))
        else:
            text = _num(value)
        lines.append(f"    {key}: {text}")
    lines.append("")
    bias = ' bias: "model.layers.{layer}.mlp.gate.e_score_correction_bias",' if v3 else ""
    lm_head = "model.embed_tokens.weight" if tie else "lm_head.weight"
    body = BODY.format(
        first_k_dense_replace=first_dense, moe_layer_freq=moe_freq,
        q_ops=Q_LORA if q_lora_rank else Q_DIRECT, rope_pairs=rope_pairs, rope_output=rope_output,
        scoring=scoring, method=method, norm_topk_prob="true" if norm else "false",
        routed_scaling_factor=_num(routed_scaling_factor), bias=bias, lm_head=lm_head)
    has_moe = any(layer >= first_dense and layer % moe_freq == 0 for layer in range(ints["num_hidden_layers"]))
    formats = _msmodelslim_formats(c, has_moe)
    if fp8:
        formats = weight_formats_yaml(FP8_CHECKPOINT_GLOBS, FP8)
    return "\n".join(lines) + "\n" + body + (formats if weight_formats else "")


def spec_from_config_file(path: str, name: str | None = None) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except IsADirectoryError:
        raise SpecError("is a folder; give its config.json", file=str(path)) from None
    except OSError as exc:
        raise SpecError(f"cannot read config: {exc.strerror}", file=str(path)) from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"not UTF-8 text: {exc.reason} at byte {exc.start}", file=str(path)) from None
    if not text.strip() and os.path.isfile(path):   # an empty file said as such, not as JSON's error
        raise SpecError("is empty; expected a Hugging Face config.json", file=str(path))
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"not valid JSON: {exc.msg}", file=str(path), line=exc.lineno) from None
    return spec_from_config(cfg, name=name, file=str(path))
