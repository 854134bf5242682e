"""Where a dsgraph weight lives inside a transformers model in memory.

Checkpoints store one tensor per expert (what our loader stacks into `...experts.*.gate_proj.weight`
[E, M, D]); transformers 5.x fuses them in memory as `experts.gate_up_proj` [E, 2M, D] (gate rows
first) and `experts.down_proj` [E, D, M].  A stack may also hold slices of a checkpoint tensor
(the shared experts stacked ahead of the routed ones: `...experts.*+shared_experts.gate_proj.weight`
[E+S, M, D], whose last S parts are row blocks of `shared_experts.gate_proj.weight` [S*M, D], and
column blocks of `shared_experts.down_proj.weight` [D, S*M] for down_proj); transformers holds
the shared experts as ordinary linears under those names.  Everything else has the same name in
both.

`transformers_views` gives one view a stacked part, read or written through; `read_transformers`
and `write_transformers` do either for a whole dsgraph weight.
"""
from __future__ import annotations

import re

import torch

from ir.ops.base import WeightSlice

EXPERTS = ".experts.*."
# A routed expert's tensor as the checkpoint names it: prefix, expert, role.
_ROUTED = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def transformers_state(model) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers by name."""
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    return state


def transformers_tensor(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor (or view of a fused expert tensor) holding dsgraph weight `name` (a plain
    `experts.*` stack whole; a stack with slices in it needs transformers_views)."""
    if EXPERTS not in name:
        return state[name]
    prefix, _, role = name.partition(EXPERTS)          # "model.layers.L.mlp", "gate_proj.weight"
    if role.startswith("down_proj"):
        return state[f"{prefix}.experts.down_proj"]
    fused = state[f"{prefix}.experts.gate_up_proj"]
    M = fused.shape[1] // 2
    return fused[:, :M] if role.startswith("gate_proj") else fused[:, M:]


def transformers_views(state: dict[str, torch.Tensor], name: str, parts=None) -> list[torch.Tensor]:
    """The transformers-side views of dsgraph weight `name`: one a stacked part, in stack order
    (`parts`: WeightSpec.parts or WeightInfo.parts, names and WeightSlices), or the one whole tensor of
    an unstacked weight (`parts` None).  Views, not copies: ``torch.stack`` of them reads the
    weight, ``view.copy_(ours[i])`` writes slot i into the model."""
    if parts is None:
        return [transformers_tensor(state, name)]
    return [_part_view(state, p) for p in parts]


def read_transformers(state: dict[str, torch.Tensor], name: str, parts=None) -> torch.Tensor:
    """Dsgraph weight `name` as the transformers model holds it (a new tensor for a stack)."""
    views = transformers_views(state, name, parts)
    return views[0] if parts is None else torch.stack(views)


def write_transformers(state: dict[str, torch.Tensor], name: str, parts, tensor: torch.Tensor) -> None:
    """Copy dsgraph weight `name` (`tensor`, stacked along dim 0 when `parts` is given) into the model."""
    views = transformers_views(state, name, parts)
    if parts is None:
        views[0].copy_(tensor)
        return
    for i, view in enumerate(views):
        view.copy_(tensor[i])


def _part_view(state: dict[str, torch.Tensor], part: str | WeightSlice) -> torch.Tensor:
    """One stacked part's view: a checkpoint tensor's, or its slice."""
    if isinstance(part, str):
        return _checkpoint_tensor(state, part)
    return _checkpoint_tensor(state, part.name).narrow(part.dim, part.start, part.stop - part.start)


def _checkpoint_tensor(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor (or view) holding checkpoint tensor `name`: under its own name, or a routed
    expert's slot of the fused expert tensors."""
    if name in state:
        return state[name]
    m = _ROUTED.match(name)
    if m is None:
        raise KeyError(f"{name} is neither a tensor of the transformers model nor a routed expert's")
    prefix, e, role = m.group(1), int(m.group(2)), m.group(3)
    if role == "down_proj":
        return state[f"{prefix}.experts.down_proj"][e]
    fused = state[f"{prefix}.experts.gate_up_proj"]
    M = fused.shape[1] // 2
    return fused[e, :M] if role == "gate_proj" else fused[e, M:]
