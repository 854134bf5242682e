"""Post-pass graph -> PhasePlan: the ordered launches of one phase plus its buffer plan.

Every node, in `ir.topo_order`, becomes the kernel launches of the family that
claims its op (codegen/families/), or a library call for the few ops left to a
library:

    linear, multi_linear        -> torch.nn.functional.linear (cuBLAS; one GEMM per weight)
    gate_up_silu                -> ir.ops.core.gate_up_silu_ref (two cuBLAS GEMMs, silu(gate) * up)
    split                       -> view (no copy: a strided view of its input)
    all_reduce                  -> torch.distributed.all_reduce (NCCL, on the current stream)
    moe_local_experts           -> ir.ops.moe.local_experts_ref (two torch.where: ids and weights)

Anything else without a family is a LoweringError naming the node and its op; so is a node
binding a weight in a storage format its family's kernels do not take (weight_format_problem).  A family
may also hand a node back to its library call, whole (the router's fp32 linear) or from a
number of tokens on (LibraryCall.from_tokens: linear_skinny's kernel runs below it, cuBLAS
from it on; the runtime runs one of the two per step).
The launches of a family that declares ``PDL = True`` are marked ``pdl`` (programmatic
dependent launch; none are when ``Options.pdl`` is off).

The buffer plan says, for every value, what the runtime must allocate (shape
with symbolic first dim "T" / "T*K", dtype) or why it must not: split outputs
are views of their input (base, element offset, strides); "state" values are
the layer's KV cache; a "routing" value lives in two int32 buffers
`<R>.order` [T*K] (token-expert pairs sorted by expert) and `<R>.offsets` [E+1].
The allocated buffers and the kernels' workspaces then share one arena by
liveness (codegen/memplan.py: `plan.arena`, their lifetimes in launch order).
Last, where codegen/dispatch.py's segments table says so (decode, Tuning.persistent.segments),
runs of launches become persistent segment launches (codegen/segments.py) and the arena is
planned again for them.
"""
from __future__ import annotations

import dataclasses
import re

import networkx as nx

from ir.formats import UNSCALED, weight_format
from ir.graph import topo_order

from . import families, segments, sizes
from .errors import LoweringError
from .kernel import (CTX_FIELDS, POINTER_REFS, SCALAR_KINDS, Arg, CtxRef, KernelLaunch, LibraryCall, Options,
                     SizeRef, StrideRef, TensorMapRef, WorkspaceRef)
from .memplan import arena_slots
from .plan import Buffer, NodeInfo, PhasePlan, View
from .provenance import node_origins

# The runtime runs these from the manifest alone (no graph, no op semantics at load).
LIBRARY_CALLS = {
    "linear": "torch.nn.functional.linear",
    "multi_linear": "torch.nn.functional.linear",   # one GEMM per weight
    "gate_up_silu": "ir.ops.core.gate_up_silu_ref",  # two GEMMs, then silu(gate) * up
    "split": "view",
    # Only in a rank's graph (tensor / expert parallel; ir/passes/shard_for_rank.py).
    "all_reduce": "torch.distributed.all_reduce",
    "moe_local_experts": "ir.ops.moe.local_experts_ref",
}

WORKSPACE_DTYPES = ("f32", "i32", "i64", "act")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# -- checks on what families return --------------------------------------------------

def _check_arg(a, names: set, ws_names: set) -> str | None:
    """Why argument `a` breaks the contract, or None."""
    if not isinstance(a, Arg):
        return f"has a bad argument {a!r}"
    if not _IDENT_RE.fullmatch(a.name) or a.name in names:
        return f"argument name {a.name!r} is not a C identifier or is used twice"
    names.add(a.name)
    ref = a.ref
    if isinstance(ref, POINTER_REFS) != a.is_pointer:
        return f"argument {a.name} ({a.ctype}) binds {ref!r}: pointers bind values, weights, ctx and workspaces"
    if isinstance(ref, TensorMapRef) != a.is_tensor_map:
        return f"argument {a.name} ({a.ctype}) binds {ref!r}: tensor maps, and only they, bind TensorMapRef"
    if isinstance(ref, TensorMapRef) and (not ref.box or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                                             for b in ref.box)):
        return f"argument {a.name}: a tensor map's box is positive ints, got {ref.box!r}"
    if not a.is_pointer and not a.is_tensor_map and a.ctype not in SCALAR_KINDS:
        return f"argument {a.name} has C type {a.ctype!r} (scalars are {', '.join(SCALAR_KINDS)})"
    if isinstance(ref, WorkspaceRef) and ref.name not in ws_names:
        return f"reads workspace {ref.name!r}, which it does not declare"
    if isinstance(ref, CtxRef) and ref.field not in CTX_FIELDS:
        return f"unknown ctx field {ref.field!r} (one of {', '.join(CTX_FIELDS)})"
    if isinstance(ref, StrideRef) and a.ctype != "i64":
        return f"argument {a.name}: strides are i64"
    if isinstance(ref, SizeRef):
        try:
            sizes.check(ref.expr)
        except sizes.SizeExprError as e:
            return str(e)
    return None


def _check_launch(launch, nid: str, family: str, opts: Options) -> None:
    from .arch import features
    where = f"family {family} lowering node {nid}"
    if not isinstance(launch, KernelLaunch):
        raise TypeError(f"{where} returned {type(launch).__name__}, not a KernelLaunch")
    problem = None
    try:
        if len(launch.grid) != 3 or len(launch.block) != 3:
            problem = "needs a 3-entry grid and block"
        for g in (*launch.grid, launch.smem):
            sizes.check(g)
        for ws in launch.workspace:
            for d in ws.shape:
                sizes.check(d)
            if ws.dtype not in WORKSPACE_DTYPES:
                problem = f"workspace {ws.name} has dtype {ws.dtype!r} (one of {', '.join(WORKSPACE_DTYPES)})"
    except sizes.SizeExprError as e:
        problem = str(e)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in launch.block):
        problem = f"block {launch.block!r} must be positive ints"
    missing = set(launch.requires) - features(opts.arch)
    if missing:
        problem = f"requires {', '.join(sorted(missing))}, which the target {opts.arch} does not offer"
    names: set = set()
    ws_names = {w.name for w in launch.workspace}
    for a in launch.args:
        problem = problem or _check_arg(a, names, ws_names)
    if problem:
        # A family breaking the lowering contract is a compiler bug, not a user error.
        raise TypeError(f"{where}: kernel {launch.name} {problem}")


def node_location(G: nx.DiGraph, nid: str) -> str:
    """"deepseek_v2_lite.yaml:88 at blocks.moe.ops[2]: node L3.mlp.h (moe_gate_up_silu)"."""
    data = G.nodes[nid]
    origins = node_origins(G, nid)
    head = ""
    if origins:
        o = origins[0]
        head = f"{o.file}:{o.line} at {o.path}: " if o.line is not None else f"{o.file} at {o.path}: "
    return f"{head}node {nid} ({data['op']})"


def weight_format_problem(G: nx.DiGraph, nid: str, family, opts: Options) -> str | None:
    """Why node `nid` cannot run on the cuda backend for the storage format of a weight it binds, or None.
    A family module declares the formats its kernels take as ``WEIGHT_FORMATS`` (default: the unscaled
    ones, ir.formats.UNSCALED); the library calls (cuBLAS through torch) take unscaled weights only."""
    takes = getattr(family, "WEIGHT_FORMATS", UNSCALED) if family is not None else UNSCALED
    data = G.nodes[nid]
    for name in data["weights"].values():
        fmt = weight_format(G, name, opts.dtype)
        if fmt.name not in takes:
            return (f"{node_location(G, nid)}: no kernel for weight format {fmt.name} at {data['op']} {nid} on the "
                    f"cuda backend; run it with backend='reference'")
    return None


def library_call(nid: str, data: dict, *, from_tokens: int = 1) -> LibraryCall:
    """The library call of node `nid` (weights in role order: weight0, weight1, ... for a multi_linear)."""
    return LibraryCall(node=nid, op=data["op"], call=LIBRARY_CALLS[data["op"]],
                       inputs=tuple(data["inputs"]), outputs=tuple(data["outputs"]),
                       weights=tuple(data["weights"][r] for r in sorted(data["weights"])),
                       attrs=dict(data["attrs"]), from_tokens=from_tokens)


def _check_library_steps(steps: list, nid: str, family: str) -> None:
    """A family's library call: at most one, of the node's own op, last; one that starts above one
    token needs launches for the steps below it."""
    calls = [s for s in steps if isinstance(s, LibraryCall)]
    where = f"family {family} lowering node {nid}"
    if not calls:
        return
    call = calls[-1]
    if len(calls) > 1 or steps[-1] is not call:
        raise TypeError(f"{where}: at most one library call, after the node's launches")
    if call.node != nid or call.op not in LIBRARY_CALLS or call.call != LIBRARY_CALLS[call.op]:
        raise TypeError(f"{where}: library call {call.call} for {call.node} ({call.op}) is not the node's own")
    if isinstance(call.from_tokens, bool) or not isinstance(call.from_tokens, int) or call.from_tokens < 1:
        raise TypeError(f"{where}: from_tokens must be a positive int, got {call.from_tokens!r}")
    if call.from_tokens > 1 and len(steps) == 1:
        raise TypeError(f"{where}: the library call runs from {call.from_tokens} tokens on, but no launch "
                        f"serves fewer")


# -- buffer plan -------------------------------------------------------------------------

def _contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for d in reversed(shape[1:]):
        strides.append(acc)
        acc *= d
    return (acc, *reversed(strides)) if shape else ()


def _shape(shape) -> tuple:
    return tuple(d if isinstance(d, int) and not isinstance(d, bool) else str(d) for d in shape)


def buffer_plan(G: nx.DiGraph, order: list[str]) -> dict[str, Buffer]:
    values = G.graph["values"]
    plan: dict[str, Buffer] = {}

    def plain(name: str, layer=None) -> Buffer:
        t = values[name]
        shape = _shape(t.shape)
        if t.dtype == "state":
            return Buffer(name, shape, "state", layer=layer)
        if t.dtype == "routing":
            return Buffer(name, shape, "routing", parts=(f"{name}.order", f"{name}.offsets"))
        return Buffer(name, shape, t.dtype)

    for name in G.graph["inputs"]:
        plan[name] = plain(name)
    for nid in order:
        data = G.nodes[nid]
        if data["op"] == "split" and not families.family_for_op("split"):
            src = plan[data["inputs"][0]]
            if src.view is not None:
                base, offset, strides = src.view.base, src.view.offset, src.view.strides
            else:
                base, offset, strides = src.name, 0, _contiguous_strides(src.shape)
            heads, split_sizes = data["attrs"].get("heads"), data["attrs"]["sizes"]
            if heads is not None and len(src.shape) == 2:
                total = sum(split_sizes)
                strides = (strides[0], total * strides[1], strides[1])
            inner = strides[-1]
            start = 0
            for out, s in zip(data["outputs"], split_sizes):
                t = values[out]
                plan[out] = Buffer(out, _shape(t.shape), t.dtype,
                                   view=View(base, offset + start * inner, tuple(strides)))
                start += s
            continue
        for out in data["outputs"]:
            buf = plain(out, data.get("layer"))
            plan[out] = buf
            if buf.parts:
                order_name, offsets_name = buf.parts
                plan[order_name] = Buffer(order_name, (buf.shape[0],), "i32")
                plan[offsets_name] = Buffer(offsets_name, (buf.shape[1] + 1,), "i32")
    return plan


def _lower_node(G: nx.DiGraph, nid: str, family, opts: Options) -> list[KernelLaunch | LibraryCall]:
    try:
        launches = family.lower(nid, G, opts)
    except LoweringError as e:
        if e.located:
            raise
        raise LoweringError(f"{node_location(G, nid)}: {e}", located=True) from None
    origins = node_origins(G, nid)
    _check_library_steps(launches, nid, family.FAMILY)
    # Programmatic dependent launch only where the launched kernel's family keeps pdl.cuh's contract
    # (a lowering may launch another family's kernels: moe_expert_ffn's two-launch path).
    out = []
    for launch in launches:
        if isinstance(launch, LibraryCall):
            out.append(launch)
            continue
        _check_launch(launch, nid, family.FAMILY, opts)
        pdl = opts.pdl and families.uses_pdl(families.family_named(launch.family) or family)
        out.append(dataclasses.replace(launch, origins=origins, pdl=pdl))
    return out


def pipeline_knobs(opts: Options) -> frozenset:
    """The knob-gated passes of ir/passes' PIPELINE that `opts` switches on (their Pass.knob, a boolean
    "section.knob" of the tuning): what the compiler passes run_pipeline as `knobs`."""
    from ir.passes import PIPELINE
    def on(knob: str) -> bool:
        section, name = knob.split(".")
        return getattr(getattr(opts.tuning, section), name) is True
    return frozenset(p.knob for p in PIPELINE if p.knob is not None and on(p.knob))


def lower_graph(G: nx.DiGraph, opts: Options | None = None, *, strict: bool = True) -> PhasePlan:
    """Lower one phase's post-pass graph. strict=False records nodes nobody can lower
    in `plan.unlowered` instead of raising (for tooling while families are written)."""
    opts = opts or Options()
    order = topo_order(G)
    plan = PhasePlan(phase=G.graph.get("phase", "?"), inputs=tuple(G.graph["inputs"]),
                     outputs=tuple(G.graph["outputs"]))
    for nid in order:
        data = G.nodes[nid]
        op = data["op"]
        family = families.family_for_op(op)
        problem = weight_format_problem(G, nid, family, opts)
        if problem and strict:
            raise LoweringError(problem, located=True)
        if problem:
            plan.unlowered.append((nid, op))
            continue
        if family is not None:
            plan.steps.extend(_lower_node(G, nid, family, opts))
        elif op in LIBRARY_CALLS:
            plan.steps.append(library_call(nid, data))
        elif strict:
            raise LoweringError(f"{node_location(G, nid)} has no kernel family and no library call; "
                                f"families claim: {', '.join(sorted(families.claimed_ops())) or '(none)'}",
                                located=True)
        else:
            plan.unlowered.append((nid, op))
            continue
        plan.nodes[nid] = NodeInfo(layer=data.get("layer"), outputs=tuple(data["outputs"]))
    plan.buffers = buffer_plan(G, order)
    plan.arena = arena_slots(plan)
    return segments.apply(plan, opts)
