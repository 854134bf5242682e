"""runtime.hf_layout maps every weight our loader reads from a checkpoint onto the tensor
transformers holds for it in memory (fused routed experts, and shared experts stacked behind
them as slices, included), both ways."""
from __future__ import annotations

import pytest
import torch

from hf_tiny import build, load_reference
from ir.ops import WeightSlice
from runtime.hf_layout import (read_transformers, transformers_state, transformers_tensor, transformers_views,
                               write_transformers)
from runtime.model_loader import compile_graphs, load_model_weights, resolve_spec, weight_specs
from runtime.weights import load_config

LAYER = "model.layers.1.mlp"   # v2_lite: layer 0 dense, 8 routed experts, 2 shared, moe_intermediate 14


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory):
    path = build("v2_lite", tmp_path_factory.mktemp("v2_lite"))
    model = load_reference(path)
    return model, transformers_state(model)


def test_every_weight_maps_onto_the_transformers_model(tmp_path):
    path = build("v3", tmp_path / "v3")
    spec = resolve_spec(None, load_config(path))
    specs = weight_specs(compile_graphs(spec).graphs)
    ours = load_model_weights(path, specs, spec, dtype=torch.float32, device="cpu")
    state = transformers_state(load_reference(path))
    for name, t in ours.items():
        torch.testing.assert_close(read_transformers(state, name, specs[name].parts).float(), t.float(),
                                   rtol=0, atol=0, msg=name)


def test_a_plain_expert_stack_is_one_view_of_the_fused_tensor(v2_lite):
    """transformers_tensor (a plain `experts.*` stack, whole) still writes into gate_up_proj."""
    _, state = v2_lite
    fused = state[f"{LAYER}.experts.gate_up_proj"]
    M = fused.shape[1] // 2
    before = fused.detach().clone()
    with torch.no_grad():
        transformers_tensor(state, f"{LAYER}.experts.*.up_proj.weight").zero_()
        assert not fused[:, M:].any()
        fused.copy_(before)


def _shared_stack(state, role: str, S: int):
    """(name, parts) of `role`'s routed experts with the S shared experts stacked behind them as slices
    (ir/passes/fuse_shared_experts.py stacks them ahead; the views follow whatever order the parts say)."""
    shared = state[f"{LAYER}.shared_experts.{role}.weight"]
    E = state[f"{LAYER}.experts.down_proj"].shape[0]
    dim = 1 if role == "down_proj" else 0
    M = shared.shape[dim] // S
    routed = tuple(f"{LAYER}.experts.{e}.{role}.weight" for e in range(E))
    stored = tuple(shared.shape)
    slices = tuple(WeightSlice(f"{LAYER}.shared_experts.{role}.weight", dim, s * M, (s + 1) * M, stored)
                   for s in range(S))
    return f"{LAYER}.experts.*+shared_experts.{role}.weight", routed + slices


def _concatenated(state, role: str, S: int) -> torch.Tensor:
    """The stack built independently of hf_layout: fused routed experts, then the shared MLP cut in S."""
    shared = state[f"{LAYER}.shared_experts.{role}.weight"].detach()
    if role == "down_proj":
        D, SM = shared.shape
        return torch.cat([state[f"{LAYER}.experts.down_proj"].detach(),
                          shared.reshape(D, S, SM // S).permute(1, 0, 2)])
    fused = state[f"{LAYER}.experts.gate_up_proj"].detach()
    M = fused.shape[1] // 2
    routed = fused[:, :M] if role == "gate_proj" else fused[:, M:]
    return torch.cat([routed, shared.reshape(S, M, -1)])


@pytest.mark.parametrize("role", ["gate_proj", "up_proj", "down_proj"])
def test_a_stack_with_shared_expert_slices_reads_as_their_concatenation(v2_lite, role):
    model, state = v2_lite
    S = model.config.n_shared_experts
    name, parts = _shared_stack(state, role, S)
    assert len(transformers_views(state, name, parts)) == len(parts)
    torch.testing.assert_close(read_transformers(state, name, parts), _concatenated(state, role, S), rtol=0, atol=0)


@pytest.mark.parametrize("role", ["gate_proj", "down_proj"])
def test_writing_a_sliced_stack_reaches_the_shared_experts(v2_lite, role):
    model, state = v2_lite
    S = model.config.n_shared_experts
    name, parts = _shared_stack(state, role, S)
    saved = {k: state[k].detach().clone() for k in (f"{LAYER}.experts.gate_up_proj", f"{LAYER}.experts.down_proj",
                                                    f"{LAYER}.shared_experts.{role}.weight")}
    shape = _concatenated(state, role, S).shape
    ours = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape)
    try:
        with torch.no_grad():
            write_transformers(state, name, parts, ours)
        torch.testing.assert_close(_concatenated(state, role, S), ours, rtol=0, atol=0)
        E = len(parts) - S
        shared = state[f"{LAYER}.shared_experts.{role}.weight"]
        want = ours[E:].permute(1, 0, 2).reshape(shared.shape) if role == "down_proj" else ours[E:].reshape(shared.shape)
        torch.testing.assert_close(shared.detach(), want, rtol=0, atol=0)
        if role == "gate_proj":     # the up rows of the fused tensor are not written
            M = shape[1]
            torch.testing.assert_close(state[f"{LAYER}.experts.gate_up_proj"][:, M:].detach(),
                                       saved[f"{LAYER}.experts.gate_up_proj"][:, M:], rtol=0, atol=0)
    finally:
        with torch.no_grad():
            for k, t in saved.items():
                state[k].copy_(t)
