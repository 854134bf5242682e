"""Where a dsgraph weight lives inside a transformers model in memory.

Checkpoints store one tensor per expert (what our loader stacks into `...experts.*.gate_proj.weight`
[E, M, D]); transformers 5.x fuses them in memory as `experts.gate_up_proj` [E, 2M, D] (gate rows
first) and `experts.down_proj` [E, D, M].  Everything else has the same name in both.
"""
from __future__ import annotations

import torch

EXPERTS = ".experts.*."


def transformers_state(model) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers by name."""
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    return state


def transformers_tensor(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor (or view of a fused expert tensor) holding dsgraph weight `name`."""
    if EXPERTS not in name:
        return state[name]
    prefix, _, role = name.partition(EXPERTS)          # "model.layers.L.mlp", "gate_proj.weight"
    if role.startswith("down_proj"):
        return state[f"{prefix}.experts.down_proj"]
    fused = state[f"{prefix}.experts.gate_up_proj"]
    M = fused.shape[1] // 2
    return fused[:, :M] if role.startswith("gate_proj") else fused[:, M:]
