"""Model-level constants the ops read: dims, norm epsilon, rotary scaling, softmax scale."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .rope import yarn_mscale

# Dims every spec must name (q_lora_rank may be null).
REQUIRED_DIMS = (
    "hidden", "heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "intermediate", "moe_intermediate", "experts", "shared_experts", "top_k", "groups", "topk_groups",
    "vocab", "layers", "max_positions",
)
NULLABLE_DIMS = ("q_lora_rank",)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling: str = "none"                  # none | yarn
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0                    # 0 = unset: cos/sin then scale by mscale(factor), as in transformers
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    name: str
    model_type: str
    dims_items: tuple                       # sorted (name, value) pairs; frozen so the config hashes
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig

    @property
    def dims(self) -> dict:
        return dict(self.dims_items)

    @property
    def qk_head_dim(self) -> int:
        d = self.dims
        return d["qk_nope_head_dim"] + d["qk_rope_head_dim"]

    @property
    def cache_width(self) -> int:
        d = self.dims
        return d["kv_lora_rank"] + d["qk_rope_head_dim"]

    @property
    def softmax_scale(self) -> float:
        # transformers: qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN.
        scale = self.qk_head_dim ** -0.5
        if self.rope.scaling == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, plan, layer: int) -> bool:
        return layer >= plan.first_k_dense_replace and layer % plan.moe_layer_freq == 0


def check_finite(x: float) -> bool:
    return math.isfinite(x)
