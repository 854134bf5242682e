"""Hugging Face DeepSeek-V2/V3 ``config.json`` -> a dsgraph spec (YAML text).

The spec states the math op by op; this module only picks, from the config, which
of DeepSeek's published variants each part is: q projected directly or through
q_lora, the rope pair layout, the router's scoring and top-k method.
"""
from __future__ import annotations

import json

from .errors import SpecError

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


def _rope_params(cfg: dict) -> dict:
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = raw.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = raw.get("type", raw.get("rope_type", "default"))
    if kind in (None, "default"):
        return {"theta": theta, "scaling": "none"}
    if kind != "yarn":
        raise SpecError(f"rope scaling {kind!r} is not supported (DeepSeek models use yarn or none)", file="config.json",
                        path="rope_scaling")
    out = {"theta": theta, "scaling": "yarn"}
    factor = raw.get("factor")
    orig = raw.get("original_max_position_embeddings")
    if orig is None:
        raise SpecError("yarn rope scaling needs original_max_position_embeddings", file="config.json", path="rope_scaling")
    if factor is None:
        factor = cfg["max_position_embeddings"] / orig
    out.update(factor=factor, original_max_position_embeddings=orig, beta_fast=raw.get("beta_fast") or 32,
               beta_slow=raw.get("beta_slow") or 1)
    if raw.get("mscale"):
        # Left out when unset: transformers then scales cos/sin by mscale(factor) even if
        # mscale_all_dim is set, which is what RopeConfig's default (0.0, unset) means.
        out["mscale"] = raw["mscale"]
    out["mscale_all_dim"] = raw.get("mscale_all_dim") or 0.0
    if "truncate" in raw:
        out["truncate"] = bool(raw["truncate"])
    return out


def spec_from_config(cfg: dict, name: str | None = None, title: str | None = None) -> str:
    """Return spec YAML text for a Hugging Face DeepSeek-V2/V3 config dict."""
    model_type = cfg.get("model_type")
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        raise SpecError(f"model_type must be deepseek_v2 or deepseek_v3, got {model_type!r}", file="config.json",
                        path="model_type")
    required = ["hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                "vocab_size", "num_hidden_layers", "max_position_embeddings"]
    for key in required:
        if cfg.get(key) is None:
            raise SpecError(f"config.json lacks {key!r}", file="config.json", path=key)
    v3 = model_type == "deepseek_v3"
    n_group = cfg.get("n_group") or 1
    topk_group = cfg.get("topk_group") or 1
    if v3:
        scoring, method = "sigmoid", "noaux_tc"   # transformers' DeepseekV3 always routes this way
        norm = bool(cfg.get("norm_topk_prob", True))
        interleave = cfg.get("rope_interleave", True)
        rope_pairs, rope_output = ("adjacent", "halves") if interleave else ("halves", "halves")
    else:
        scoring = cfg.get("scoring_func", "softmax")
        method = cfg.get("topk_method", "greedy")
        if scoring != "softmax" or method not in ("greedy", "group_limited_greedy"):
            raise SpecError(f"deepseek_v2 routing {scoring}/{method} is not supported", file="config.json", path="topk_method")
        norm = False  # transformers' DeepseekV2 ignores norm_topk_prob; we match it
        rope_pairs, rope_output = "adjacent", "interleaved"
    rope = _rope_params(cfg)
    dims = {
        "hidden": ("D", cfg["hidden_size"]), "heads": ("H", cfg["num_attention_heads"]),
        "q_lora_rank": ("Q", cfg.get("q_lora_rank")), "kv_lora_rank": ("C", cfg["kv_lora_rank"]),
        "qk_nope_head_dim": ("N", cfg["qk_nope_head_dim"]), "qk_rope_head_dim": ("R", cfg["qk_rope_head_dim"]),
        "v_head_dim": ("V", cfg["v_head_dim"]), "intermediate": ("I", cfg["intermediate_size"]),
        "moe_intermediate": ("M", cfg["moe_intermediate_size"]), "experts": ("E", cfg["n_routed_experts"]),
        "shared_experts": ("", cfg.get("n_shared_experts") or 0), "top_k": ("K", cfg["num_experts_per_tok"]),
        "groups": ("", n_group), "topk_groups": ("", topk_group), "vocab": ("", cfg["vocab_size"]),
        "layers": ("", cfg["num_hidden_layers"]), "max_positions": ("", cfg["max_position_embeddings"]),
    }
    if not dims["shared_experts"][1]:
        raise SpecError("models without shared experts are not supported yet", file="config.json", path="n_shared_experts")
    name = name or cfg.get("_name_or_path", "").split("/")[-1].lower().replace("-", "_") or model_type
    lines = [HEADER.format(title=title or f"{name} ({model_type})"), "schema: 1", f"name: {name}",
             f"model_type: {model_type}", "", "dims:"]
    for key, (letter, value) in dims.items():
        text = "null" if value is None else str(value)
        lines.append((f"  {key}: {text}".ljust(28) + (f"# {letter}" if letter else "")).rstrip())
    lines += ["", "config:", f"  rms_norm_eps: {_num(cfg.get('rms_norm_eps', 1e-6))}",
              f"  tie_word_embeddings: {'true' if cfg.get('tie_word_embeddings', False) else 'false'}", "  rope:"]
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
    lm_head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings", False) else "lm_head.weight"
    body = BODY.format(
        first_k_dense_replace=cfg.get("first_k_dense_replace") or 0, moe_layer_freq=cfg.get("moe_layer_freq") or 1,
        q_ops=Q_LORA if cfg.get("q_lora_rank") else Q_DIRECT, rope_pairs=rope_pairs, rope_output=rope_output,
        scoring=scoring, method=method, norm_topk_prob="true" if norm else "false",
        routed_scaling_factor=_num(cfg.get("routed_scaling_factor", 1.0)), bias=bias, lm_head=lm_head)
    return "\n".join(lines) + "\n" + body


def spec_from_config_file(path: str, name: str | None = None) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except OSError as exc:
        raise SpecError(f"cannot read config: {exc.strerror}", file=str(path)) from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"not valid JSON: {exc.msg}", file=str(path), line=exc.lineno) from None
    return spec_from_config(cfg, name=name)
