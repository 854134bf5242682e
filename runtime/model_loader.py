"""From a model directory (or a spec alone) to compiled-for-phase graphs and bound weights.

The spec comes from the user (a path or a Spec) or is written from the checkpoint's
config.json by ``ir.config_to_spec``; the weights the graphs bind are checked against
the checkpoint before any tensor data is read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import networkx as nx
import torch

from ir import Spec, build_graph, load_spec, verify
from ir.config_to_spec import spec_from_config
from ir.passes import run_pipeline

from .weights import Checkpoint, WeightSpec, load_config, load_weights

# Checkpoint tensors we know and deliberately do not use.
_ROTARY_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class CompiledModel:
    spec: Spec
    graphs: dict[str, nx.DiGraph]      # phase -> graph after the pass pipeline


def resolve_spec(spec, config: dict | None) -> Spec:
    if isinstance(spec, Spec):
        return spec
    if spec is not None:
        return load_spec(str(spec))
    if config is None:
        raise ValueError("no spec given and no config.json to write one from")
    return load_spec(spec_from_config(config), file="config.json (generated spec)")


def compile_graphs(spec: Spec, passes: bool = True) -> CompiledModel:
    graphs = {}
    for phase in ("prefill", "decode"):
        G = build_graph(spec, phase)
        verify(G)
        graphs[phase] = run_pipeline(G) if passes else G
    return CompiledModel(spec, graphs)


def weight_specs(graphs: dict[str, nx.DiGraph]) -> dict[str, WeightSpec]:
    specs: dict[str, WeightSpec] = {}
    for G in graphs.values():
        for name, info in G.graph["weights"].items():
            specs[name] = WeightSpec(shape=tuple(info.shape), keep_fp32=info.keep_fp32, parts=info.parts)
    return specs


def unused_checkpoint_tensors(num_layers: int):
    """What a DeepSeek checkpoint may hold that inference does not read: rotary buffers and
    multi-token-prediction layers (DeepSeek-V3 ships layer 61 for MTP)."""
    def ignore(name: str) -> bool:
        if _ROTARY_BUFFER.search(name):
            return True
        m = _LAYER.match(name)
        return bool(m) and int(m.group(1)) >= num_layers
    return ignore


def load_model_weights(model_dir, graphs, spec: Spec, *, dtype, device, progress=None) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint.open(model_dir)
    return load_weights(ckpt, weight_specs(graphs), dtype=dtype, device=device,
                        ignore=unused_checkpoint_tensors(spec.dims["layers"]), progress=progress)


def random_weights(graphs, *, dtype, device, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights for a spec with no checkpoint (benchmarks, smoke runs); norms start at 1.

    Drawn on the target device with its own generator (a full-size model has billions of
    parameters); the same seed and device give the same weights.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, spec in sorted(weight_specs(graphs).items()):
        wdtype = torch.float32 if spec.keep_fp32 else dtype
        if len(spec.shape) == 1 and "norm" in name:
            out[name] = torch.ones(spec.shape, dtype=wdtype, device=device)
        elif name.endswith("e_score_correction_bias"):
            out[name] = (torch.rand(spec.shape, generator=gen, device=device) * 0.1).to(wdtype)
        else:
            out[name] = (torch.randn(spec.shape, generator=gen, device=device, dtype=wdtype) * std)
    return out


__all__ = ["CompiledModel", "compile_graphs", "load_config", "load_model_weights", "random_weights", "resolve_spec",
           "weight_specs"]
