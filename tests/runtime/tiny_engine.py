"""A tiny DeepSeek model with random weights for engine tests that need no checkpoint.

The spec is what ``--from-config`` writes for a small V2-style config.json (odd sizes,
q_lora, group-limited routing, one dense layer); weights are drawn with a std large
enough that logits are well spread, so greedy choices are not near-ties that a
different batch composition could flip.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ir import load_spec
from ir.config_to_spec import spec_from_config
from runtime import Engine
from runtime.model_loader import compile_graphs, random_weights, weight_specs

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 61

CONFIG = {
    "model_type": "deepseek_v2", "vocab_size": VOCAB, "hidden_size": 36, "intermediate_size": 40,
    "moe_intermediate_size": 10, "num_hidden_layers": 2, "num_attention_heads": 3, "kv_lora_rank": 14,
    "q_lora_rank": 12, "qk_rope_head_dim": 6, "qk_nope_head_dim": 10, "v_head_dim": 7, "n_routed_experts": 6,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "group_limited_greedy",
    "n_group": 3, "topk_group": 2, "routed_scaling_factor": 1.5, "max_position_embeddings": 128,
    "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
}

_COMPILED = {}


def compiled():
    if "model" not in _COMPILED:
        spec = load_spec(spec_from_config(CONFIG, name="tiny"), file="tiny.yaml")
        model = compile_graphs(spec)
        weights = random_weights(weight_specs(model.graphs), dtype=torch.float32, device="cpu", seed=7, std=0.3)
        _COMPILED["model"] = (model, weights)
    return _COMPILED["model"]


def make_engine(**kwargs) -> Engine:
    """A fresh engine (own cache and block tables) over the shared tiny model."""
    model, weights = compiled()
    kwargs = {"backend": "reference", "device": "cpu", "dtype": torch.float32, "block_size": 4, **kwargs}
    return Engine(model.spec, model.graphs, weights, **kwargs)


def prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
