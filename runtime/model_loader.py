"""From a model directory (or a spec alone) to the weights a model binds.

The spec comes from the user (a path or a Spec) or is written from the checkpoint's
config.json by ``ir.config_to_spec``.  What weights to read comes either from the
graphs (the reference backend) or from a bundle's manifest (the cuda backend: no graph
is built); either way they are checked against the checkpoint before any tensor data
is read.  The compiler (graph building, passes) is imported only by compile_graphs.
"""
from __future__ import annotations

import hashlib

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ir.formats import FORMATS, companion_names, quantize
from ir.spec import Spec, load_spec

from .errors import WeightError
from ir.ops.base import WeightSlice

from .weights import Checkpoint, WeightSpec, load_config, load_weights, read_json_object

GENERATION_CONFIG = "generation_config.json"

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
        from codegen.paths import spec_path
        return load_spec(str(spec_path(spec)))      # a file, or a shipped spec's name
    if config is None:
        raise WeightError("no spec given and no config.json to write one from")
    from ir.config_to_spec import spec_from_config
    return load_spec(spec_from_config(config), file="config.json (generated spec)")


def compile_graphs(spec: Spec, passes: bool = True, *, world: int = 1, rank: int = 0) -> CompiledModel:
    """The phase graphs after the pipeline; with world > 1, rank `rank`'s part of them
    (ir/passes/shard_for_rank.py), after ir.parallel.check_parallel said the model splits."""
    from ir import build_graph, verify
    from ir.parallel import check_parallel
    from ir.passes import run_pipeline
    check_parallel(spec, world)
    graphs = {}
    for phase in ("prefill", "decode"):
        G = build_graph(spec, phase)
        verify(G)
        if world > 1:
            G.graph["parallel"] = {"world": world, "rank": rank}
        graphs[phase] = run_pipeline(G) if passes else G
    return CompiledModel(spec, graphs)


def weight_specs(graphs: dict) -> dict[str, WeightSpec]:
    """What the graphs bind (the reference backend's weights); in a rank's graphs, the slice
    of each split weight the rank reads (the Shards shard_for_rank recorded).  This is the
    table a bundle's manifest carries, read back the same way, so the two cannot disagree."""
    from codegen.manifest import weights_to_json
    return manifest_weight_specs(weights_to_json(graphs.values()))


def manifest_weight_specs(table: dict) -> dict[str, WeightSpec]:
    """What a bundle binds, from its manifest's weights table (codegen.manifest.weights_to_json).
    In a rank's table: ``part`` / ``stored`` of a split weight and, for a per-expert weight, the
    other ranks' expert tensors (``others``: known to the checkpoint check, never read).
    A stacked part is a name or a slice of a checkpoint tensor (a WeightSlice, see parse_part)."""
    specs: dict[str, WeightSpec] = {}
    for name, w in table.items():
        parts = tuple(parse_part(name, p) for p in w["parts"]) if w["parts"] is not None else None
        extra = {}
        if w.get("part") is not None:
            extra = {"part": tuple(w["part"]), "stored": tuple(w["stored"])}
        elif w.get("experts") is not None:
            held = {p for p in parts if isinstance(p, str)}
            every = (name.replace("*", str(e)) for e in range(w["experts"][2]))
            extra = {"others": tuple(n for n in every if n not in held)}
        fmt = w.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise WeightError(f"weight {name}: unknown format {fmt!r} in the manifest (known: {', '.join(FORMATS)})")
        specs[name] = WeightSpec(shape=tuple(w["shape"]), keep_fp32=bool(w["keep_fp32"]), parts=parts, format=fmt,
                                 **extra)
    return specs


def parse_part(weight: str, part) -> str | WeightSlice:
    """A manifest's stacked part (codegen.manifest.part_to_json): a checkpoint tensor's name, or
    {name, part: [dim, start, stop], stored} for a slice of one; a WeightError naming `weight` if
    it is neither."""
    if isinstance(part, str):
        return part
    try:
        dim, start, stop = part["part"]
        return WeightSlice(str(part["name"]), dim, start, stop, tuple(part["stored"]))
    except (KeyError, TypeError, ValueError):
        raise WeightError(f"weight {weight}: a stacked part must be a tensor name or "
                          f"{{name, part: [dim, start, stop], stored}}, got {part!r}") from None


def unused_checkpoint_tensors(num_layers: int):
    """What a DeepSeek checkpoint may hold that inference does not read: rotary buffers and
    multi-token-prediction layers (DeepSeek-V3 ships layer 61 for MTP)."""
    def ignore(name: str) -> bool:
        if _ROTARY_BUFFER.search(name):
            return True
        m = _LAYER.match(name)
        return bool(m) and int(m.group(1)) >= num_layers
    return ignore


def eos_token_ids(model_dir, config: dict):
    """The model's end-of-sequence id(s) (an int, a list, or None), where transformers' ``generate``
    finds them: generation_config.json when the checkpoint has one, else config.json."""
    path = Path(model_dir) / GENERATION_CONFIG
    if path.is_file():
        return read_json_object(path, "generation config").get("eos_token_id")
    return config.get("eos_token_id")


def progress_bar(desc: str = "loading weights"):
    """A ``progress(done, total)`` callback that draws a tqdm bar on stderr, as transformers does
    while loading; tqdm leaves it out when stderr is not a terminal, so logs get no \\r runs."""
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=None, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def load_model_weights(model_dir, specs: dict[str, WeightSpec], spec: Spec, *, dtype, device,
                       progress=None, weight_format: str | None = None) -> dict[str, torch.Tensor]:
    """``progress``: None or False (quiet), True (a tqdm bar, see progress_bar) or a
    ``progress(done, total)`` callable.  ``weight_format`` ("fp8" / "dtype"): read the checkpoint
    converted to that format (runtime/convert.py) rather than as stored."""
    from .msmodelslim import is_msmodelslim, open_checked
    if is_msmodelslim(model_dir):
        ckpt = open_checked(model_dir, weight_format)
    else:
        ckpt = Checkpoint.open(model_dir)
        if weight_format is not None:
            from .convert import Converted
            ckpt = Converted(ckpt, weight_format)
    return load_weights(ckpt, specs, dtype=dtype, device=device,
                        ignore=unused_checkpoint_tensors(spec.dims["layers"]),
                        progress=progress_bar() if progress is True else None if progress is False else progress)


def random_weights(specs: dict[str, WeightSpec], *, dtype, device, seed: int = 0,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights for a spec with no checkpoint (benchmarks, smoke runs); norms start at 1.

    Each checkpoint tensor is drawn from its own generator, seeded by (seed, its name), on the
    target device (a full-size model has billions of parameters).  So the same seed gives the
    same model however it is spread: a rank of a tensor-parallel run draws the whole tensor and
    keeps its slice (`part`), and draws only its own experts; every rank holds the same
    replicated weights, as it would reading one checkpoint.  Likewise a stacked slice (the
    shared experts stacked ahead of the routed ones) is cut from its whole tensor's draw, so a
    compiled model with its shared experts stacked and one without are the same model.
    """
    out = {}
    # a quantised weight's companions (its scales) come from quantising it, not from a draw
    made = {c for n, s in specs.items() if s.format is not None for c in companion_names(n, FORMATS[s.format])}
    for name, spec in sorted(specs.items()):
        if name in made:
            continue
        # a quantised weight is drawn in float32 and quantised at once, as a checkpoint would store it (at
        # once: a full-size model's weights all in float32 before quantising would not fit the GPU)
        wdtype = torch.float32 if spec.keep_fp32 or spec.format else dtype
        fmt = FORMATS[spec.format] if spec.format is not None else None
        if spec.parts is not None:      # per-expert tensors, stacked: each drawn by its own name
            whole: dict = {}            # the tensors this stack's slices are cut from, dropped after it
            # a quantised stack is quantised part by part (a format's scales never span experts, so the
            # result is the whole stack's): one expert in float32 at a time, not the stack (V3's are 15 GB)
            t, scales = _stack_parts([_quantized(_draw_part(p, spec.shape[1:], wdtype, device, seed, std, whole), fmt)
                                      for p in spec.parts])
        else:
            t = _draw(name, spec.stored or spec.shape, wdtype, device, seed, std)
            if spec.part is not None:
                dim, start, stop = spec.part
                t = t.narrow(dim, start, stop - start).contiguous()
            # each block's scale from its own values: a rank's block-aligned slice quantises as its whole
            # checkpoint tensor would
            t, scales = _quantized(t, fmt)
        if fmt is not None:
            for cname, scale in zip(companion_names(name, fmt), scales):
                out[cname] = scale.to(device)
        out[name] = t
    return out


def _quantized(t: torch.Tensor, fmt) -> tuple[torch.Tensor, tuple]:
    """(stored, companions) of float `t` in `fmt` (ir.formats.quantize), or (t, ()) where fmt is None."""
    return (t, ()) if fmt is None else quantize(t, fmt)


def _stack_parts(parts: list) -> tuple[torch.Tensor, tuple]:
    """[(stored, companions)] of the parts -> (the stored stack, each companion stacked)."""
    return torch.stack([p[0] for p in parts]), tuple(torch.stack(c) for c in zip(*(p[1] for p in parts)))


def _draw_part(part, shape, dtype, device, seed: int, std: float, whole: dict) -> torch.Tensor:
    """One stacked part: drawn under its name, or, for a slice, the whole checkpoint tensor drawn
    under its own name (what a model that reads it unsliced draws) and narrowed.  `whole` keeps
    the whole tensors for one stack, so the S slices of a shared tensor cost one draw, not S,
    and no whole tensor outlives its stack (a full-size model's would be gigabytes on the GPU)."""
    if isinstance(part, str):
        return _draw(part, shape, dtype, device, seed, std)
    if part.name not in whole:
        whole[part.name] = _draw(part.name, part.stored, dtype, device, seed, std)
    dim, start, stop = part.part
    return whole[part.name].narrow(dim, start, stop - start)


def _draw(name: str, shape, dtype, device, seed: int, std: float) -> torch.Tensor:
    shape = tuple(shape)
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape, dtype=dtype, device=device)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    if name.endswith("e_score_correction_bias"):
        return (torch.rand(shape, generator=gen, device=device) * 0.1).to(dtype)
    return torch.randn(shape, generator=gen, device=device, dtype=dtype) * std


def checkpoint_tensors(specs: dict[str, WeightSpec], weights: dict) -> dict:
    """The checkpoint tensors (name -> tensor) that `weights`, bound as `specs` say, hold: a
    stack's parts one by one, the slices of one tensor (a shared MLP's: WeightSlice) joined back.
    A split weight (`part`) is only a slice of its tensor: refused.  For tests and tools that
    move one model between layouts (one process, a rank's graphs, a checkpoint file)."""
    out, pieces = {}, {}
    for name, spec in specs.items():
        if spec.part is not None:
            raise WeightError(f"{name} holds a slice {spec.part} of its checkpoint tensor, not all of it")
        if spec.parts is None:
            out[name] = weights[name]
            continue
        for i, part in enumerate(spec.parts):
            if isinstance(part, WeightSlice):
                pieces.setdefault(part.name, []).append((part.part, weights[name][i]))
            else:
                out[part] = weights[name][i]
    for name, got in pieces.items():
        dim = got[0][0][0]
        out[name] = torch.cat([t for _, t in sorted(got, key=lambda p: p[0][1])], dim=dim)
    return out


def bind_checkpoint(specs: dict[str, WeightSpec], tensors: dict) -> dict:
    """What load_weights gives for `specs` from checkpoint tensors held in memory (name ->
    tensor, e.g. checkpoint_tensors'), without casting or moving them."""
    def read(name, part=None):
        t = tensors[name]
        return t if part is None else t.narrow(part[0], part[1], part[2] - part[1])
    out = {}
    for name, spec in specs.items():
        if spec.parts is None:
            out[name] = read(name, spec.part).contiguous()
        else:
            out[name] = torch.stack([read(p.name, p.part) if isinstance(p, WeightSlice) else read(p)
                                     for p in spec.parts])
    return out


__all__ = ["CompiledModel", "bind_checkpoint", "checkpoint_tensors", "compile_graphs", "eos_token_ids", "load_config",
           "load_model_weights", "manifest_weight_specs", "parse_part", "progress_bar",
           "random_weights", "resolve_spec", "weight_specs"]
