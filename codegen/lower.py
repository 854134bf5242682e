"""Post-pass graph -> PhasePlan: the ordered launches of one phase plus its buffer plan.

Every node, in `ir.topo_order`, becomes the kernel launches of the family that
claims its op (codegen/families/), or a library call for the few ops left to a
library:

    linear                      -> torch.nn.functional.linear (cuBLAS)
    split                       -> view (no copy: a strided view of its input)
    mla_q_absorb, mla_v_up      -> torch.einsum (unless a family claims them)

Anything else without a family is a LoweringError naming the node and its op.

The buffer plan says, for every value, what the runtime must allocate (shape
with symbolic first dim "T" / "T*K", dtype) or why it must not: split outputs
are views of their input (base, element offset, strides); "state" values are
the layer's KV cache; a "routing" value lives in two int32 buffers
`<R>.order` [T*K] (token-expert pairs sorted by expert) and `<R>.offsets` [E+1].
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import networkx as nx

from ir.graph import topo_order

from . import families, sizes
from .kernel import Arg, KernelLaunch, LibraryCall, Options

LIBRARY_CALLS = {
    "linear": "torch.nn.functional.linear",
    "split": "view",
    "mla_q_absorb": "torch.einsum",
    "mla_v_up": "torch.einsum",
}

ARG_KINDS = ("ptr", "i32", "i64", "f32")
WORKSPACE_DTYPES = ("f32", "i32", "i64", "act")
_REF_RE = re.compile(r"(value|weight|ctx|workspace|stride|size|const):(.+)")
_CTX_FIELDS = ("positions", "slot_mapping", "block_tables", "context_lens", "query_start", "kv_cache")


class LoweringError(RuntimeError):
    """A node cannot be lowered (no family, no library call) or a family broke the contract."""


@dataclass(frozen=True)
class View:
    base: str                    # the value whose storage this one shares (never itself a view)
    offset: int                  # element offset into base's storage
    strides: tuple[int | str, ...]  # element strides, one per dim (symbolic for dim 0 never needed)


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int | str, ...]  # first dim may be symbolic: "T", "T*6"
    dtype: str                   # act | f32 | i64 | i32 | state | routing
    view: View | None = None
    layer: int | None = None     # state: whose cache
    parts: tuple[str, ...] = ()  # routing: its two int32 buffers

    @property
    def allocated(self) -> bool:
        return self.view is None and self.dtype not in ("state", "routing")


@dataclass
class PhasePlan:
    phase: str
    steps: list = field(default_factory=list)          # KernelLaunch | LibraryCall, in order
    buffers: dict[str, Buffer] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    unlowered: list[tuple[str, str]] = field(default_factory=list)  # (node, op), strict=False only

    @property
    def launches(self) -> list[KernelLaunch]:
        return [s for s in self.steps if isinstance(s, KernelLaunch)]

    @property
    def library_calls(self) -> list[LibraryCall]:
        return [s for s in self.steps if isinstance(s, LibraryCall)]


# -- checks on what families return --------------------------------------------------

def _check_launch(launch, nid: str, family: str) -> None:
    where = f"family {family} lowering node {nid}"
    if not isinstance(launch, KernelLaunch):
        raise LoweringError(f"{where} returned {type(launch).__name__}, not a KernelLaunch")
    try:
        if len(launch.grid) != 3 or len(launch.block) != 3:
            raise LoweringError(f"{where}: kernel {launch.name} needs a 3-entry grid and block")
        for g in (*launch.grid, launch.smem):
            sizes.check(g)
        for ws in launch.workspace:
            for d in ws.shape:
                sizes.check(d)
            if ws.dtype not in WORKSPACE_DTYPES:
                raise LoweringError(f"{where}: workspace {ws.name} has dtype {ws.dtype!r} "
                                    f"(one of {', '.join(WORKSPACE_DTYPES)})")
    except sizes.SizeExprError as e:
        raise LoweringError(f"{where}: kernel {launch.name}: {e}") from None
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in launch.block):
        raise LoweringError(f"{where}: kernel {launch.name} block {launch.block!r} must be positive ints")
    ws_names = {w.name for w in launch.workspace}
    for a in launch.args:
        if not isinstance(a, Arg) or a.kind not in ARG_KINDS:
            raise LoweringError(f"{where}: kernel {launch.name} has a bad argument {a!r}")
        m = _REF_RE.fullmatch(a.ref)
        if m is None:
            raise LoweringError(f"{where}: kernel {launch.name}: bad argument reference {a.ref!r}")
        head, rest = m.groups()
        if head == "workspace" and rest not in ws_names:
            raise LoweringError(f"{where}: kernel {launch.name} reads workspace {rest!r}, "
                                f"which it does not declare")
        if head == "ctx" and rest not in _CTX_FIELDS:
            raise LoweringError(f"{where}: kernel {launch.name}: unknown ctx field {rest!r} "
                                f"(one of {', '.join(_CTX_FIELDS)})")
        if head == "size":
            try:
                sizes.check(rest)
            except sizes.SizeExprError as e:
                raise LoweringError(f"{where}: kernel {launch.name}: {e}") from None
        if (head in ("value", "weight", "ctx", "workspace")) != (a.kind == "ptr"):
            raise LoweringError(f"{where}: kernel {launch.name}: argument {a.ref!r} of kind {a.kind} "
                                f"(pointers are value:/weight:/ctx:/workspace:, scalars the rest)")


def _library_call(nid: str, data: dict) -> LibraryCall:
    return LibraryCall(node=nid, op=data["op"], call=LIBRARY_CALLS[data["op"]],
                       inputs=tuple(data["inputs"]), outputs=tuple(data["outputs"]),
                       weights=tuple(data["weights"][r] for r in sorted(data["weights"])),
                       attrs=dict(data["attrs"]))


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
        if family is not None:
            launches = family.lower(nid, G, opts)
            for launch in launches:
                _check_launch(launch, nid, family.FAMILY)
            plan.steps.extend(launches)
        elif op in LIBRARY_CALLS:
            plan.steps.append(_library_call(nid, data))
        elif strict:
            raise LoweringError(f"node {nid} (op {op!r}) has no kernel family and no library call; "
                                f"families claim: {', '.join(sorted(families.claimed_ops())) or '(none)'}")
        else:
            plan.unlowered.append((nid, op))
    plan.buffers = buffer_plan(G, order)
    return plan
