"""Tiny random DeepSeek models built and saved with transformers itself (odd sizes on purpose).

Three flavours, one per routing/attention variant the runtime must match:
  v2_lite  q projected directly, softmax greedy routing
  v2       q_lora, group_limited_greedy, routed scaling 16
  v3       q_lora, sigmoid noaux_tc with partly negative correction biases, norm_topk_prob,
           scaling 2.5, two dense first layers, V3's half-split rope layout
"""
from __future__ import annotations

import torch

YARN_V2 = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
           "mscale": 0.707, "mscale_all_dim": 0.707}
YARN_V3 = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 1.0}

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=60, moe_intermediate_size=28, num_attention_heads=3,
              num_key_value_heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=10, v_head_dim=12,
              max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False, rms_norm_eps=1e-6)

FLAVOURS = {
    "v2_lite": ("v2", dict(COMMON, num_hidden_layers=3, q_lora_rank=None, n_routed_experts=9, n_shared_experts=2,
                           num_experts_per_tok=3, topk_method="greedy", n_group=1, topk_group=1,
                           first_k_dense_replace=1, routed_scaling_factor=1.0, rope_scaling=YARN_V2)),
    "v2": ("v2", dict(COMMON, num_hidden_layers=3, q_lora_rank=28, n_routed_experts=12, n_shared_experts=1,
                      num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                      first_k_dense_replace=1, routed_scaling_factor=16.0, rope_scaling=YARN_V2)),
    "v3": ("v3", dict(COMMON, num_hidden_layers=4, q_lora_rank=28, n_routed_experts=12, n_shared_experts=1,
                      num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=2,
                      routed_scaling_factor=2.5, norm_topk_prob=True, rope_scaling=YARN_V3)),
}


def build(flavour: str, seed: int = 0):
    """A transformers model (fp32, eval mode) of the given flavour with deterministic random weights."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
    family, kwargs = FLAVOURS[flavour]
    torch.manual_seed(seed)
    if family == "v2":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**kwargs))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs))
        g = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=g) * 0.3)
    return model.eval()


def save(flavour: str, path, seed: int = 0):
    model = build(flavour, seed)
    model.save_pretrained(path)
    return model


def hf_forward_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits for one sequence [len, vocab] in one forward (no cache)."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([ids], device=dev)).logits[0].float()
