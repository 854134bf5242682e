"""The manifest's phases as JSON, and back: one place that writes and one that reads them.

A phase in the manifest (JSON with sorted keys, so it diffs cleanly):

    inputs, outputs, unlowered [[node, op]...],
    steps: [{type: "kernel", kernel, family, stage, template, params, nodes, grid, block, smem, pdl,
             args: [{name, ctype, ref: {value|weight|ctx|workspace|size: x} | {stride: [value, dim]}
                           | {tensor_map: [weight, box, swizzle]}}],
             workspace: [{name, shape, dtype}], [requires: ["sm_90a"]]}
            | {type: "library", node, op, call, inputs, outputs, weights, attrs, from_tokens}],
    buffers: {value: {shape, dtype, [view: {base, offset, strides}], [layer], [parts]}},
    nodes: {node: {layer, outputs}},
    arena: [{name, shape, dtype, live: [first, last]}]   (codegen/memplan.py: placed at run time)

The bound weights (`weights_to_json`, the manifest's ``weights``):

    {name: {shape, keep_fp32, parts: null | [part...], [part, stored] | [experts], [format]}}

A stacked weight's part is a checkpoint tensor's name (the whole tensor is slot i of the stack)
or {name, part: [dim, start, stop], stored}: that slice of the checkpoint tensor `name`, whose
whole shape is `stored` (ir.ops.WeightSlice; the same part / stored pair a rank's split weight
carries, so the runtime reads both with one slicing read).

A kernel step's ``pdl`` (true / false) says whether the runtime launches it with programmatic
dependent launch (runtime/cuda_driver.py: cuLaunchKernelEx with programmatic stream serialization).

`phase_from_json` gives back the PhasePlan lowering made (launch records with typed
arguments; provenance is left in the kernel sources), so the runtime runs exactly what the
manifest says, with no graph, no passes and no lowering.
"""
from __future__ import annotations

from ir.ops import WeightSlice

from .kernel import Arg, KernelLaunch, LibraryCall, Workspace
from .memplan import Slot
from .plan import Buffer, NodeInfo, PhasePlan, View

STEP_TYPES = ("kernel", "library")


def step_to_json(step) -> dict:
    if isinstance(step, KernelLaunch):
        out = {"type": "kernel", "kernel": step.name, "family": step.family, "stage": step.stage,
               "template": step.template, "params": step.params, "nodes": list(step.nodes),
               "grid": list(step.grid), "block": list(step.block), "smem": step.smem, "pdl": step.pdl,
               "args": [a.to_json() for a in step.args],
               "workspace": [{"name": w.name, "shape": list(w.shape), "dtype": w.dtype} for w in step.workspace]}
        if step.requires:   # only where a kernel needs an arch-specific target (codegen/arch.py)
            out["requires"] = list(step.requires)
        return out
    return {"type": "library", "node": step.node, "op": step.op, "call": step.call,
            "inputs": list(step.inputs), "outputs": list(step.outputs),
            "weights": list(step.weights), "attrs": step.attrs, "from_tokens": step.from_tokens}


def step_from_json(d: dict):
    kind = d.get("type")
    if kind == "kernel":
        return KernelLaunch(
            family=d["family"], template=d["template"], name=d["kernel"], params=d["params"],
            nodes=tuple(d["nodes"]), grid=tuple(d["grid"]), block=tuple(d["block"]), smem=d["smem"],
            args=tuple(Arg.from_json(a) for a in d["args"]),
            workspace=tuple(Workspace(w["name"], tuple(w["shape"]), w["dtype"]) for w in d["workspace"]),
            stage=d.get("stage", ""), pdl=bool(d["pdl"]), requires=tuple(d.get("requires", ())))
    if kind == "library":
        return LibraryCall(node=d["node"], op=d["op"], call=d["call"], inputs=tuple(d["inputs"]),
                           outputs=tuple(d["outputs"]), weights=tuple(d["weights"]), attrs=dict(d["attrs"]),
                           from_tokens=int(d.get("from_tokens", 1)))
    raise ValueError(f"unknown step type {kind!r} (one of {', '.join(STEP_TYPES)})")


def buffer_to_json(buf: Buffer) -> dict:
    out = {"shape": list(buf.shape), "dtype": buf.dtype}
    if buf.view is not None:
        out["view"] = {"base": buf.view.base, "offset": buf.view.offset, "strides": list(buf.view.strides)}
    if buf.layer is not None:
        out["layer"] = buf.layer
    if buf.parts:
        out["parts"] = list(buf.parts)
    return out


def buffer_from_json(name: str, d: dict) -> Buffer:
    view = d.get("view")
    return Buffer(name, tuple(d["shape"]), d["dtype"],
                  view=View(view["base"], int(view["offset"]), tuple(view["strides"])) if view else None,
                  layer=d.get("layer"), parts=tuple(d.get("parts", ())))


def phase_to_json(plan: PhasePlan) -> dict:
    return {"inputs": list(plan.inputs), "outputs": list(plan.outputs),
            "steps": [step_to_json(s) for s in plan.steps],
            "buffers": {name: buffer_to_json(b) for name, b in plan.buffers.items()},
            "nodes": {n: {"layer": info.layer, "outputs": list(info.outputs)} for n, info in plan.nodes.items()},
            "unlowered": [list(u) for u in plan.unlowered],
            "arena": [s.to_json() for s in plan.arena]}


def phase_from_json(phase: str, d: dict) -> PhasePlan:
    return PhasePlan(
        phase=phase, steps=[step_from_json(s) for s in d["steps"]],
        buffers={name: buffer_from_json(name, b) for name, b in d["buffers"].items()},
        nodes={n: NodeInfo(layer=i["layer"], outputs=tuple(i["outputs"])) for n, i in d["nodes"].items()},
        inputs=tuple(d["inputs"]), outputs=tuple(d["outputs"]),
        unlowered=[tuple(u) for u in d.get("unlowered", ())],
        arena=tuple(Slot.from_json(s) for s in d["arena"]))


def part_to_json(part: str | WeightSlice) -> str | dict:
    """A stacked weight's part as the manifest holds it: a name stays a string (the manifests
    of plain expert stacks are unchanged); a slice says which rows / columns of which tensor."""
    if isinstance(part, WeightSlice):
        return {"name": part.name, "part": list(part.part), "stored": list(part.stored)}
    return part


def weights_to_json(graphs) -> dict:
    """Every weight the phases bind: {name: {shape, keep_fp32, parts[, format]}} (what loading reads).

    In a rank's graphs (world > 1, ir/passes/shard_for_rank.py) a weight the rank holds a
    slice of also says which: ``part`` [dim, start, stop] of the tensor as stored, whose
    shape is ``stored``; a per-expert weight says ``experts`` [start, stop, of]: the rank
    holds experts start..stop-1 of `of` (``parts`` names them; the others are on other ranks).
    A part is a name or a slice of a checkpoint tensor (part_to_json)."""
    out: dict = {}
    for G in graphs:
        world = int((G.graph.get("parallel") or {}).get("world", 1))
        shards = G.graph.get("shards") or {}
        for name, info in G.graph["weights"].items():
            entry = {"shape": list(info.shape), "keep_fp32": bool(info.keep_fp32),
                     "parts": [part_to_json(p) for p in info.parts] if info.parts is not None else None}
            if info.format is not None:     # stored quantised (ir/formats.py); absent: the activation dtype
                entry["format"] = info.format
            shard = shards.get(name)
            if shard is not None and shard.dim is not None:
                stored = list(info.shape)
                stored[shard.dim] *= world
                entry.update(part=[shard.dim, shard.start, shard.stop], stored=stored)
            elif shard is not None and shard.kind == "experts":
                entry["experts"] = [shard.start, shard.stop, int(G.graph["model"].dims["experts"])]
            out[name] = entry
    return dict(sorted(out.items()))
