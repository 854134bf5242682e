"""Decode steps captured as CUDA graphs, one per shape bucket, and replayed.

A decode step is ~20 launches per layer; launched from Python that costs far more
than the kernels.  Captured once per (batch, block-table width, context bucket),
a step is one graph replay.  What changes between steps lives in static device
buffers that are refilled before each replay (token ids, positions, slots, block
tables, context lengths); the kernels read lengths from those buffers, so a
graph captured for a context bucket serves every context up to it.
"""
from __future__ import annotations

import torch

from ir.context import StepContext

from .h2d import upload

MIN_CONTEXT_BUCKET = 256


def context_bucket(n: int) -> int:
    b = MIN_CONTEXT_BUCKET
    while b < n:
        b *= 2
    return b


class _Captured:
    def __init__(self, graph, inputs: dict, output: torch.Tensor):
        self.graph = graph
        self.inputs = inputs
        self.output = output


class DecodeGraphs:
    def __init__(self, backend):
        self.backend = backend
        self.graphs: dict[tuple, _Captured] = {}
        self.pool = None

    def run(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        B = len(ctx.query_lens)
        W = int(ctx.block_tables.shape[1])
        bucket = context_bucket(max(ctx.context_lens))
        key = (B, W, bucket, id(ctx.kv_cache[0]))
        cap = self.graphs.get(key)
        if cap is None:
            cap = self._capture(ids, ctx, bucket)
            self.graphs[key] = cap
        x = cap.inputs
        x["ids"].copy_(ids, non_blocking=True)
        x["positions"].copy_(ctx.positions, non_blocking=True)
        x["slot_mapping"].copy_(ctx.slot_mapping, non_blocking=True)
        x["block_tables"].copy_(ctx.block_tables, non_blocking=True)
        x["context_lens"].copy_(upload(ctx.context_lens, torch.int32, x["context_lens"].device), non_blocking=True)
        cap.graph.replay()
        return cap.output.clone()

    def _capture(self, ids: torch.Tensor, ctx: StepContext, bucket: int) -> _Captured:
        be = self.backend
        device = ids.device
        B = len(ctx.query_lens)
        inputs = {
            "ids": ids.clone(),
            "positions": ctx.positions.clone(),
            "slot_mapping": ctx.slot_mapping.clone(),
            "block_tables": ctx.block_tables.to(device=device, dtype=torch.int32).clone(),
            "context_lens": torch.tensor(ctx.context_lens, dtype=torch.int32, device=device),
            "query_start": torch.arange(B + 1, dtype=torch.int32, device=device),
        }
        static_ctx = StepContext(positions=inputs["positions"], query_lens=[1] * B,
                                 context_lens=[bucket] * B, block_tables=inputs["block_tables"],
                                 slot_mapping=inputs["slot_mapping"], kv_cache=ctx.kv_cache,
                                 block_size=ctx.block_size)
        meta = {k: inputs[k] for k in ("positions", "slot_mapping", "block_tables", "context_lens", "query_start")}
        sizes = be._sizes(static_ctx)
        # Warm up on a side stream (loads modules, initialises cuBLAS) before capturing.
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            be._forward("decode", inputs["ids"], static_ctx, meta, sizes)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = be._forward("decode", inputs["ids"], static_ctx, meta, sizes)
        return _Captured(graph, inputs, out)
