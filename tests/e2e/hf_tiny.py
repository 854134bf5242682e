"""Tiny random DeepSeek models built with transformers itself, for parity tests.

Odd sizes on purpose (hidden 42/45, 3 heads, kv_lora_rank 20, rope 8, nope 10, v 12,
8 or 12 experts, top-3) so no power-of-two coincidence hides a layout bug; YaRN with
max_position_embeddings / original_max_position_embeddings == factor (transformers
derives the factor from that ratio) and mscale values that make the softmax factor
and the cos/sin attention factor differ from 1.  ``initializer_range`` is raised so
routing and logits are far from uniform.

Each builder saves with ``save_pretrained`` and returns the directory; the
reference model is loaded back from that directory in fp32 with the eager
attention and experts implementations (the grouped-mm experts kernel needs
16-byte strides, which odd sizes do not have).
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 97          # small and prime: every token id is reachable, no alignment luck
BLOCK_SIZE = 4      # prompts of 3, 4 and 5 tokens sit just under, on and over a block boundary


def _yarn(factor: float, original: int, mscale: float, mscale_all_dim: float) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


def _common(**overrides) -> dict:
    cfg = dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=50, moe_intermediate_size=14,
               num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=20, qk_rope_head_dim=8,
               qk_nope_head_dim=10, v_head_dim=12, max_position_embeddings=256, initializer_range=0.1,
               rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    return cfg


def v2_lite_config():
    """DeepSeek-V2-Lite style: q projected directly, softmax greedy routing, one dense layer."""
    from transformers import DeepseekV2Config
    return DeepseekV2Config(**_common(
        num_hidden_layers=3, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        rope_parameters=_yarn(4.0, 64, 0.707, 0.707)))


def v2_config():
    """DeepSeek-V2 style: q_lora, group-limited greedy over 4 groups, routed_scaling_factor 16,
    mscale != mscale_all_dim so the cos/sin tables carry an attention factor != 1."""
    from transformers import DeepseekV2Config
    return DeepseekV2Config(**_common(
        num_hidden_layers=3, q_lora_rank=18, n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=16.0, rope_parameters=_yarn(4.0, 64, 1.0, 0.707)))


def v3_config():
    """DeepSeek-V3 style: q_lora, sigmoid noaux_tc with a correction bias, norm_topk_prob,
    routed_scaling_factor 2.5, two dense layers first, interleaved rope pairs."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**_common(
        hidden_size=45, num_hidden_layers=4, q_lora_rank=18, n_routed_experts=12, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=2, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_interleave=True, rope_parameters=_yarn(4.0, 64, 1.0, 1.0)))


def v3_odd_config():
    """Every width odd that may be (hidden 39, kv_lora_rank 21, rope 6, nope 11, v 13, q_lora 19,
    intermediates 37 / 15, 7 experts): no row is a whole number of 16-byte vectors and the
    splits of q and of [c | k_pe] start at odd offsets (issue 13: such a config faulted the GPU).
    V3-style, because transformers' V2 rope views pairs as complex numbers and needs even strides."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**_common(
        hidden_size=39, intermediate_size=37, moe_intermediate_size=15, kv_lora_rank=21, qk_rope_head_dim=6,
        qk_nope_head_dim=11, v_head_dim=13, num_hidden_layers=2, q_lora_rank=19, n_routed_experts=7,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.5, rope_interleave=True, rope_parameters=_yarn(4.0, 64, 1.0, 0.707)))


CONFIGS = {"v2_lite": v2_lite_config, "v2": v2_config, "v3": v3_config, "v3_odd": v3_odd_config}


def _splittable(make):
    """The same model with 4 heads (hidden 44: transformers wants it to divide by the heads),
    intermediates dividing by 4 (the 8 or 12 experts already do),
    so it runs on 2 and 4 ranks (tensor / expert parallel tests)."""
    def config():
        config = make()
        for key, value in dict(hidden_size=44, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                               moe_intermediate_size=12).items():
            setattr(config, key, value)
        return config
    return config


# Built by name like CONFIGS, but not part of the single-process parity runs over CONFIGS.
PARALLEL_CONFIGS = {f"{name}_tp": _splittable(CONFIGS[name]) for name in ("v2_lite", "v2", "v3")}


def _model_class(config):
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM if config.model_type == "deepseek_v3" else DeepseekV2ForCausalLM


def build(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny model ``name`` with a fixed seed and save it to ``out_dir``."""
    config = {**CONFIGS, **PARALLEL_CONFIGS}[name]()
    torch.manual_seed(seed)
    model = _model_class(config)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                # Non-zero, partly negative, and large enough to change which experts win.
                bias = torch.randn(gate.e_score_correction_bias.shape, generator=gen) * 0.3
                gate.e_score_correction_bias.copy_(bias)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def load_reference(model_dir: Path):
    """The transformers model saved in ``model_dir``, fp32, eager attention and experts."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_dir)
    cls = _model_class(config)
    try:
        model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                    experts_implementation="eager")
    except TypeError:  # transformers releases before the experts_implementation switch
        model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None  # never stop early: compare fixed-length runs
    return model


@torch.no_grad()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """[len, vocab] logits of one prompt, no padding (on the model's device)."""
    device = next(model.parameters()).device
    return model(torch.tensor([prompt], device=device)).logits[0].float()


@torch.no_grad()
def hf_generate(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits each step chose from ([new, vocab]), through transformers' cache."""
    device = next(model.parameters()).device
    out = model.generate(torch.tensor([prompt], device=device),
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([step[0] for step in out.logits]).float()
