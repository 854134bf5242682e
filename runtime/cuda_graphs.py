"""Steps captured as CUDA graphs and replayed: decode per shape bucket, prefill per shape seen twice.

A decode step is ~20 launches per layer; launched from Python that costs far more
than the kernels.  Captured once per (batch, block-table width, context bucket),
a step is one graph replay.  What changes between steps lives in static device
buffers (token ids, positions, slots, block tables, context lengths; DecodeInputs, one
set per (batch, width) shared by that shape's graphs of every bucket); the kernels read
lengths from those buffers, so a graph captured for a context bucket serves every
context up to it.

The host's part of a decode step is on its critical path: the GPU idles from the previous step's
end until the replay is queued (the caller reads each step's logits before the next).  The H200
measured the refill at 0.1-0.23 ms a step, most of it the per-step upload of the context
lengths; a decode step's context lengths are its positions + 1 (each sequence's one new token is
its last cached one), so the graph computes them on the device from the positions.  The engine
uploads a step's other inputs straight into the graph's buffers (DecodeGraphs.inputs: one packed
int64 copy and one of the block tables, as its other steps upload theirs), and `run` copies only
what is not already there: the host queues those two uploads and the replay, where four
device-to-device copies more cost ~30-35 us of GPU idle a step.  A caller passing tensors of
its own gets them copied in.

A prefill step of a few thousand tokens launches ~565 kernels whose GPU time is about the
host's time to launch them (1x2048: 24 ms of kernels, 18-24 ms of host time
depending on the machine), so a slow host leaves the GPU waiting.  Its launches are decided by
its sizes (T, B, NP, MAXQ, MAXCTX, W) and how many logit rows it keeps; the rest is device data.
PrefillGraphs captures a step the second time its key comes (a shape seen once runs eagerly and
costs no capture) and replays it after, up to PREFILL_GRAPH_MAX_TOKENS tokens (above, the kernels
outlast the host), PREFILL_GRAPHS_KEPT graphs.  A full set gives up its least recently used graph
only when that one has not run for PREFILL_GRAPH_IDLE_STEPS prefill steps: a server cycling
through more shapes than it keeps runs the others eagerly instead of capturing every step.

Memory: a step's values and workspaces live in its phase's arena (codegen/memplan.py: values
whose lifetimes do not overlap share bytes; V2-Lite at 2048 tokens ~0.12 GB), which every graph of
the phase captures: replays never overlap, and each graph writes every value before it reads it.
An arena that must grow for a larger step is allocated anew, and the phase's graphs, which hold
the old one's addresses, are dropped (`forget`) and captured again when their keys come back.  The
graphs' own pool holds only what a step allocates outside the plan: its logits and the library
calls' temporaries.  A capture that runs out of memory leaves its key to eager steps from then on.
"""
from __future__ import annotations

import collections
import itertools

import torch

from ir.context import StepContext

from .h2d import pack, packed_offsets, upload, upload_into

MIN_CONTEXT_BUCKET = 256
PREFILL_GRAPH_MAX_TOKENS = 2048
PREFILL_GRAPHS_KEPT = 4
PREFILL_GRAPH_IDLE_STEPS = 64
_SEEN_KEPT = 1 << 12            # prefill keys remembered (seen once) before the set starts over


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
        self.last_run = 0     # PrefillGraphs: the prefill step it last ran at


class DecodeInputs:
    """The device buffers a decode step of B sequences and block-table width W reads (B tokens):
    ids, positions and slots are views of one int64 tensor laid out as upload_together lays out
    its parts (h2d.packed_offsets), so a step's host values reach them in one copy.  Shared by the
    graphs of every context bucket of that shape: replays never overlap on the stream, and a graph
    reads its inputs only inside its replay."""

    def __init__(self, B: int, W: int, device):
        starts, n = packed_offsets([B, B, B])   # ids, positions, slots: the order write() packs them in
        self.packed = torch.zeros(n, dtype=torch.int64, device=device)
        self.ids, self.positions, self.slot_mapping = (self.packed[at:at + B] for at in starts)
        self.block_tables = torch.zeros(B, W, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=device)   # the graph's first node fills it
        self.query_start = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.named = {"ids": self.ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                      "block_tables": self.block_tables, "context_lens": self.context_lens,
                      "query_start": self.query_start}

    def write(self, ids: list[int], positions: list[int], slots: list[int], tables) -> None:
        """A step's host values into the buffers: two host-to-device copies (`tables`: int32
        [B, W] rows, BlockTables.table_rows), queued behind the previous replay, no sync."""
        upload_into(self.packed, pack([ids, positions, slots])[0])
        upload_into(self.block_tables, tables)


class DecodeGraphs:
    def __init__(self, backend):
        self.backend = backend
        self.graphs: dict[tuple, _Captured] = {}
        self.buffers: dict[tuple, DecodeInputs] = {}   # (B, W, device) -> its graphs' inputs
        self.pool = None

    def forget(self, phase: str) -> None:
        """Drop the graphs of `phase` (its arena moved)."""
        if phase == "decode":
            self.graphs.clear()

    def inputs(self, B: int, W: int, device) -> DecodeInputs:
        """The buffers decode graphs of B sequences and width W read on `device` (made on first use)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # "cuda" and ids.device's "cuda:0": one key
            device = torch.device("cuda", torch.cuda.current_device())
        key = (B, W, device)
        x = self.buffers.get(key)
        if x is None:
            x = self.buffers[key] = DecodeInputs(B, W, device)
        return x

    def run(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        B = len(ctx.query_lens)
        W = int(ctx.block_tables.shape[1])
        x = self.inputs(B, W, ids.device)
        # Before a capture too: its warm-up runs the step on these buffers (it writes the step's
        # cache rows).  context_lens: the graph's first node (_decode_lengths).
        _refill(x.named, ids, ctx)
        bucket = context_bucket(max(ctx.context_lens))
        key = (B, W, bucket, id(ctx.kv_cache[0]))
        cap = self.graphs.get(key)
        if cap is None:
            cap = self.graphs[key] = self._capture(x, ctx, bucket)
        cap.graph.replay()
        return _logits_of(cap)

    def _capture(self, x: DecodeInputs, ctx: StepContext, bucket: int) -> _Captured:
        B = len(ctx.query_lens)
        static_ctx = StepContext(positions=x.positions, query_lens=[1] * B,
                                 context_lens=[bucket] * B, block_tables=x.block_tables,
                                 slot_mapping=x.slot_mapping, kv_cache=ctx.kv_cache,
                                 block_size=ctx.block_size)
        return _record(self.backend, "decode", x.named, static_ctx, lambda: _live_pool(self),
                       prologue=lambda: _decode_lengths(x.named))


class PrefillGraphs:
    """Prefill steps replayed from CUDA graphs once their key has come before (module docstring)."""

    def __init__(self, backend):
        self.backend = backend
        self.graphs: collections.OrderedDict[tuple, _Captured] = collections.OrderedDict()
        self.seen: set[tuple] = set()
        self.refused: set[tuple] = set()       # keys whose capture ran out of memory: eager from then on
        self.steps = 0
        self.pool = None

    def forget(self, phase: str) -> None:
        """Drop the graphs of `phase` (its arena moved)."""
        for key in [k for k in self.graphs if k[0] == phase]:
            del self.graphs[key]

    def key(self, phase: str, ids: torch.Tensor, ctx: StepContext) -> tuple:
        """What decides a step's launches: its sizes and logit rows; the cache and device it writes."""
        rows = None if ctx.logit_rows is None else int(ctx.logit_rows.shape[0])
        return (phase, tuple(sorted(self.backend._sizes(ctx).items())), rows, id(ctx.kv_cache[0]), ids.device)

    def run(self, phase: str, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """The step's logits from its graph, or None: the caller launches it eagerly (too many
        tokens, or the first time its key comes)."""
        self.steps += 1
        if ids.shape[0] > PREFILL_GRAPH_MAX_TOKENS:
            return None
        key = self.key(phase, ids, ctx)
        cap = self.graphs.get(key)
        if cap is None:
            if key in self.refused:
                return None
            if key not in self.seen:
                if len(self.seen) >= _SEEN_KEPT:
                    self.seen.clear()
                self.seen.add(key)
                return None
            if len(self.graphs) >= PREFILL_GRAPHS_KEPT:
                oldest = next(iter(self.graphs))
                if self.steps - self.graphs[oldest].last_run < PREFILL_GRAPH_IDLE_STEPS:
                    return None                  # every kept graph is in use: this shape runs eagerly
                del self.graphs[oldest]
            try:
                cap = self._capture(phase, ids, ctx)
            except torch.OutOfMemoryError:
                self.refused.add(key)
                torch.cuda.empty_cache()
                return None
            self.graphs[key] = cap
        else:
            self.graphs.move_to_end(key)
        cap.last_run = self.steps
        x = cap.inputs
        _refill(x, ids, ctx)
        x["context_lens"].copy_(upload(ctx.context_lens, torch.int32, ids.device), non_blocking=True)
        x["query_start"].copy_(upload(_starts(ctx), torch.int32, ids.device), non_blocking=True)
        x["key_start"].copy_(upload(ctx.key_starts(), torch.int32, ids.device), non_blocking=True)
        if ctx.logit_rows is not None:
            x["logit_rows"].copy_(ctx.logit_rows, non_blocking=True)
        cap.graph.replay()
        return _logits_of(cap)

    def _capture(self, phase: str, ids: torch.Tensor, ctx: StepContext) -> _Captured:
        inputs = _static_inputs(ids, ctx)
        if ctx.logit_rows is not None:
            inputs["logit_rows"] = ctx.logit_rows.clone()
        static_ctx = StepContext(positions=inputs["positions"], query_lens=list(ctx.query_lens),
                                 context_lens=list(ctx.context_lens), block_tables=inputs["block_tables"],
                                 slot_mapping=inputs["slot_mapping"], kv_cache=ctx.kv_cache,
                                 block_size=ctx.block_size, logit_rows=inputs.get("logit_rows"))
        return _record(self.backend, phase, inputs, static_ctx, lambda: _live_pool(self))


def _live_pool(graphs):
    """The pool the next capture of `graphs` (DecodeGraphs / PrefillGraphs) draws on.  torch frees a
    private pool with its last graph, and a handle whose graphs are all gone cannot be captured into
    again: the bench drops them to capture a step anew with PDL off, and an arena that grows during
    a capture's warm-up drops them (CUDABackend._arena).  So it is asked after the warm-up."""
    if graphs.pool is None or not graphs.graphs:
        graphs.pool = torch.cuda.graph_pool_handle()
    return graphs.pool


def _starts(ctx: StepContext) -> list[int]:
    return list(itertools.accumulate(ctx.query_lens, initial=0))


def _static_inputs(ids: torch.Tensor, ctx: StepContext) -> dict:
    """A prefill step's device inputs, copied into buffers of the graph's own (refilled before each replay)."""
    device = ids.device
    return {
        "ids": ids.clone(),
        "positions": ctx.positions.clone(),
        "slot_mapping": ctx.slot_mapping.clone(),
        "block_tables": ctx.block_tables.to(device=device, dtype=torch.int32).clone(),
        "context_lens": torch.tensor(ctx.context_lens, dtype=torch.int32, device=device),
        "query_start": torch.tensor(_starts(ctx), dtype=torch.int32, device=device),
        "key_start": torch.tensor(ctx.key_starts(), dtype=torch.int32, device=device),
    }


def _refill(x: dict, ids: torch.Tensor, ctx: StepContext) -> None:
    """The step's device tensors into the graph's buffers (the context lengths are the caller's:
    a decode graph makes its own, a prefill step uploads them), but for those the caller wrote
    there itself (the engine's decode steps: DecodeInputs.write): a copy onto itself would cost
    its host enqueue (~8 us) and change nothing."""
    for name, src in (("ids", ids), ("positions", ctx.positions), ("slot_mapping", ctx.slot_mapping),
                      ("block_tables", ctx.block_tables)):
        dst = x[name]
        if not _is(src, dst):
            dst.copy_(src, non_blocking=True)


def _is(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same memory seen the same way (a view's data_ptr counts its offset);
    the engine hands over the buffers' own tensor objects, which the first test finds."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype)


def _decode_lengths(x: dict) -> None:
    """A decode step's context lengths from its positions, on the device: each sequence's one new
    token is the last of its cache (StepContext: context_lens[b] = positions[b] + 1)."""
    torch.add(x["positions"], 1, out=x["context_lens"])


def _logits_of(cap: _Captured) -> torch.Tensor:
    """The replay's logits as a float32 tensor of the caller's (the next replay overwrites the
    graph's own): one conversion kernel, where a float() inside the graph and a clone after it
    moved the logits twice (b=128: 52 MB of float32 logits, ~25 us a step)."""
    return cap.output.to(torch.float32, copy=True)


def _record(be, phase: str, inputs: dict, static_ctx: StepContext, pool_of, prologue=None) -> _Captured:
    """One step of `phase` on the static inputs, captured into a graph drawing on the pool
    `pool_of()` gives after the warm-up (which may grow the arena and drop the phase's graphs);
    `prologue` (if any) runs first, inside the graph."""
    meta = {k: inputs[k] for k in ("positions", "slot_mapping", "block_tables", "context_lens", "query_start",
                                   "key_start") if k in inputs}
    sizes = be._sizes(static_ctx)
    device = inputs["ids"].device
    # Warm up on a side stream (loads modules, initialises cuBLAS; a prefill writes its own cache
    # rows, which the replay writes again) before capturing.
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        if prologue is not None:
            prologue()
        be._forward(phase, inputs["ids"], static_ctx, dict(meta), sizes, as_float=False)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool_of()):
        if prologue is not None:
            prologue()
        out = be._forward(phase, inputs["ids"], static_ctx, dict(meta), sizes, as_float=False)
    return _Captured(graph, inputs, out)
