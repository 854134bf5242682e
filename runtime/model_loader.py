"""From a model directory (or a spec alone) to the weights a model binds.

The spec comes from the user (a path or a Spec) or is written from the checkpoint's
config.json by ``ir.config_to_spec``.  What weights to read comes either from the
graphs (the reference backend) or from a bundle's manifest (the cuda backend: no graph
is built); either way they are checked against the checkpoint before any tensor data
is read.  The compiler (graph building, passes) is imported only by compile_graphs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ir.spec import Spec, load_spec

from .weights import Checkpoint, WeightSpec, load_config, load_weights

# Checkpoint tensors we know and deliberately do not use.
_ROTARY_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class CompiledModel:
    spec: Spec
    graphs: dict                       # phase -> networkx graph after the pass pipeline


def resolve_spec(spec, config: dict | None) -> Spec:
    if isinstance(spec, Spec):
        return spec
    if spec is not None:
        return load_spec(str(spec))
    if config is None:
        raise ValueError("no spec given and no config.json to write one from")
    from ir.config_to_spec import spec_from_config
    return load_spec(spec_from_config(config), file="config.json (generated spec)")


def compile_graphs(spec: Spec, passes: bool = True) -> CompiledModel:
    from ir import build_graph, verify
    from ir.passes import run_pipeline
    graphs = {}
    for phase in ("prefill", "decode"):
        G = build_graph(spec, phase)
        verify(G)
        graphs[phase] = run_pipeline(G) if passes else G
    return CompiledModel(spec, graphs)


def weight_specs(graphs: dict) -> dict[str, WeightSpec]:
    """What the graphs bind (the reference backend's weights)."""
    specs: dict[str, WeightSpec] = {}
    for G in graphs.values():
        for name, info in G.graph["weights"].items():
            specs[name] = WeightSpec(shape=tuple(info.shape), keep_fp32=info.keep_fp32, parts=info.parts)
    return specs


def manifest_weight_specs(table: dict) -> dict[str, WeightSpec]:
    """What a bundle binds, from its manifest's weights table (codegen.manifest.weights_to_json)."""
    return {name: WeightSpec(shape=tuple(w["shape"]), keep_fp32=bool(w["keep_fp32"]),
                             parts=tuple(w["parts"]) if w["parts"] is not None else None)
            for name, w in table.items()}


def unused_checkpoint_tensors(num_layers: int):
    """What a DeepSeek checkpoint may hold that inference does not read: rotary buffers and
    multi-token-prediction layers (DeepSeek-V3 ships layer 61 for MTP)."""
    def ignore(name: str) -> bool:
        if _ROTARY_BUFFER.search(name):
            return True
        m = _LAYER.match(name)
        return bool(m) and int(m.group(1)) >= num_layers
    return ignore


def load_model_weights(model_dir, specs: dict[str, WeightSpec], spec: Spec, *, dtype, device,
                       progress=None) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint.open(model_dir)
    return load_weights(ckpt, specs, dtype=dtype, device=device,
                        ignore=unused_checkpoint_tensors(spec.dims["layers"]), progress=progress)


def random_weights(specs: dict[str, WeightSpec], *, dtype, device, seed: int = 0,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights for a spec with no checkpoint (benchmarks, smoke runs); norms start at 1.

    Drawn on the target device with its own generator (a full-size model has billions of
    parameters); the same seed and device give the same weights.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, spec in sorted(specs.items()):
        wdtype = torch.float32 if spec.keep_fp32 else dtype
        if len(spec.shape) == 1 and "norm" in name:
            out[name] = torch.ones(spec.shape, dtype=wdtype, device=device)
        elif name.endswith("e_score_correction_bias"):
            out[name] = (torch.rand(spec.shape, generator=gen, device=device) * 0.1).to(wdtype)
        else:
            out[name] = (torch.randn(spec.shape, generator=gen, device=device, dtype=wdtype) * std)
    return out


__all__ = ["CompiledModel", "compile_graphs", "load_config", "load_model_weights", "manifest_weight_specs",
           "random_weights", "resolve_spec", "weight_specs"]
