"""runtime.hf_layout maps every weight our loader reads from a checkpoint onto the tensor
transformers holds for it in memory (fused experts included), both ways."""
from __future__ import annotations

import torch

from hf_tiny import build, load_reference
from runtime.hf_layout import transformers_state, transformers_tensor
from runtime.model_loader import compile_graphs, load_model_weights, resolve_spec, weight_specs
from runtime.weights import load_config


def test_every_weight_maps_onto_the_transformers_model(tmp_path):
    path = build("v3", tmp_path / "v3")
    spec = resolve_spec(None, load_config(path))
    graphs = compile_graphs(spec).graphs
    ours = load_model_weights(path, weight_specs(graphs), spec, dtype=torch.float32, device="cpu")
    model = load_reference(path)
    state = transformers_state(model)
    for name, t in ours.items():
        torch.testing.assert_close(transformers_tensor(state, name).float(), t.float(), rtol=0, atol=0, msg=name)
    # Writing through the views reaches the fused tensors.
    name = next(n for n in ours if n.endswith("experts.*.up_proj.weight"))
    with torch.no_grad():
        transformers_tensor(state, name).zero_()
    prefix = name.split(".experts.*.")[0]
    M = state[f"{prefix}.experts.gate_up_proj"].shape[1] // 2
    assert not state[f"{prefix}.experts.gate_up_proj"][:, M:].any()
