"""The `reference` backend: run the phase graph with each op's torch semantics (CPU or GPU)."""
from __future__ import annotations

import torch

from ir import run_graph
from ir.context import StepContext


class ReferenceBackend:
    name = "reference"
    mixed_steps = True    # decode tokens run as one-token chunks in a prefill step (Engine._mixed_step)

    def __init__(self, graphs: dict, weights: dict[str, torch.Tensor]):
        self.graphs = graphs
        self.weights = weights

    def forward(self, phase: str, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """ids [T] -> logits [T, vocab] (float32)."""
        out = run_graph(self.graphs[phase], {"ids": ids}, self.weights, ctx)
        return out["logits"].float()
