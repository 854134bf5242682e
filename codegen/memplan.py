"""The step's memory plan: values whose lifetimes do not overlap share one arena.

Lowering gives a phase's steps in launch order; every value a step allocates (the buffer
plan's own buffers, routing's two int32 parts, each kernel's workspaces) becomes a slot with
a lifetime in node positions (a node's launches and library call are one position):

    first  the node that makes it (its outputs are materialized before its launches run)
    last   the last node that reads or writes it; a split's views extend their base's lifetime

The step's inputs, its outputs (the logits, which outlive the step) and the KV cache are not
in the arena.  A workspace lives at its node alone (the node's launches share it by name).

Sizes are symbolic (T, NP, MAXCTX, SMS: codegen/sizes.py), so the manifest records the slots
(shape expression, dtype, lifetime) and the runtime places them at a step's sizes with `place`,
which is deterministic: greedy by size (largest first, ties by first use then name), each slot
at the best-fitting gap among the already placed slots it is live with (the smallest gap that
holds it, else on top of them), every offset aligned to ALIGN bytes.  Two slots that are live
at the same node never overlap (`overlaps` finds a violation; the property test and the
planted-plan test use it).

    node:      0    1    2    3    4
    a [0,1]:  ████ ████                     offset 0
    b [1,3]:       ████ ████ ████           offset size(a): live with a
    c [2,4]:            ████ ████ ████      offset 0: a is dead by then
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from . import sizes as size_exprs
from .kernel import KernelLaunch, LibraryCall, StrideRef, ValueRef

ALIGN = 256          # bytes: 16-byte vectors, TMA boxes and cuBLAS all want far less
ITEMSIZE = {"f32": 4, "i32": 4, "i64": 8}   # "act" is the step's activation dtype, given at run time


@dataclass(frozen=True)
class Slot:
    name: str                        # a value, a routing part, or "<node>/<workspace>"
    shape: tuple[int | str, ...]     # elements, symbolic dims as in the buffer plan
    dtype: str                       # act | f32 | i32 | i64
    first: int                       # node position that makes it
    last: int                        # node position that last uses it

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "live": [self.first, self.last]}

    @classmethod
    def from_json(cls, d: dict) -> "Slot":
        first, last = d["live"]
        return cls(d["name"], tuple(d["shape"]), d["dtype"], int(first), int(last))


def workspace_slot(node: str, ws_name: str) -> str:
    return f"{node}/{ws_name}"


def _node_of(step) -> str:
    return step.nodes[0] if isinstance(step, KernelLaunch) else step.node


def node_groups(steps) -> list[tuple[str, list]]:
    """The steps by node, in order: a node's steps are consecutive (lowering emits them so)."""
    return [(node, list(group)) for node, group in itertools.groupby(steps, key=_node_of)]


def arena_slots(plan) -> tuple[Slot, ...]:
    """Every slot of a PhasePlan (codegen.plan) with its lifetime, in order of first use."""
    buffers = plan.buffers
    outside = set(plan.inputs) | set(plan.outputs)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    workspaces: list[Slot] = []

    def storage(name: str) -> tuple[str, ...]:
        """The arena slots behind value `name` (none: an input, an output, the cache)."""
        buf = buffers.get(name)
        if buf is None:
            base, _, part = name.rpartition(".")
            return storage(base) if part in ("order", "offsets") and base in buffers else ()
        if buf.view is not None:
            return storage(buf.view.base)
        if buf.dtype == "routing":
            return tuple(p for part in buf.parts for p in storage(part))
        if buf.dtype == "state" or name in outside:
            return ()
        return (name,)

    def use(name: str, at: int) -> None:
        for s in storage(name):
            first.setdefault(s, at)
            last[s] = max(last.get(s, at), at)

    for at, (node, steps) in enumerate(node_groups(plan.steps)):
        info = plan.nodes.get(node)
        for out in (info.outputs if info is not None else ()):
            use(out, at)
        seen_ws: set[str] = set()
        for step in steps:
            if isinstance(step, LibraryCall):
                for name in (*step.inputs, *step.outputs):
                    use(name, at)
                continue
            for a in step.args:
                if isinstance(a.ref, ValueRef):
                    use(a.ref.name, at)
                elif isinstance(a.ref, StrideRef):
                    use(a.ref.value, at)
            for ws in step.workspace:   # the runner allocates a shared name once, at its first launch
                if ws.name not in seen_ws:
                    seen_ws.add(ws.name)
                    workspaces.append(Slot(workspace_slot(node, ws.name), tuple(ws.shape), ws.dtype, at, at))
    values = [Slot(n, tuple(buffers[n].shape), buffers[n].dtype, first[n], last[n]) for n in first]
    return tuple(sorted(values + workspaces, key=lambda s: (s.first, s.last, s.name)))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def place(slots, nbytes) -> tuple[list[int], int]:
    """(byte offset of each slot, arena bytes) for slots of `nbytes` bytes each (module docstring)."""
    offsets = [0] * len(slots)
    live_at: dict[int, list[int]] = {}         # node -> placed slots live there
    order = sorted(range(len(slots)), key=lambda k: (-nbytes[k], slots[k].first, slots[k].name))
    total = 0
    for k in order:
        size = _align(nbytes[k])
        if size == 0:
            continue
        s = slots[k]
        near = {j for t in range(s.first, s.last + 1) for j in live_at.get(t, ())}
        taken = sorted((offsets[j], offsets[j] + _align(nbytes[j])) for j in near)
        best, top = None, 0
        for lo, hi in taken:
            gap = lo - top
            if gap >= size and (best is None or gap < best[1]):
                best = (top, gap)
            top = max(top, hi)
        offsets[k] = best[0] if best is not None else top
        total = max(total, offsets[k] + size)
        for t in range(s.first, s.last + 1):
            live_at.setdefault(t, []).append(k)
    return offsets, total


def overlaps(slots, nbytes, offsets) -> tuple[str, str] | None:
    """Two slots live at the same node whose bytes overlap, or None: what a plan must never hold."""
    live = [k for k in range(len(slots)) if nbytes[k] > 0]
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            sa, sb = slots[a], slots[b]
            if sa.first <= sb.last and sb.first <= sa.last and \
                    offsets[a] < offsets[b] + nbytes[b] and offsets[b] < offsets[a] + nbytes[a]:
                return sa.name, sb.name
    return None


@dataclass(frozen=True)
class Layout:
    offsets: dict                    # slot name -> byte offset into the arena
    nbytes: dict                     # slot name -> bytes (0: empty at these sizes)
    total: int                       # arena bytes


class ArenaPlan:
    """A phase's slots, placed at a step's sizes; placements are kept per distinct slot sizes (a
    step's sizes decide a handful of distinct shapes; many steps share them)."""

    def __init__(self, slots):
        self.slots = tuple(slots)
        shapes = sorted({(s.shape, s.dtype) for s in self.slots}, key=repr)
        self._shapes = shapes
        index = {sd: i for i, sd in enumerate(shapes)}
        self._slot_shape = [index[(s.shape, s.dtype)] for s in self.slots]
        self._layouts: dict[tuple, Layout] = {}

    def key(self, sizes: dict, act_itemsize: int) -> tuple:
        """The bytes of each distinct (shape, dtype) at these sizes: what decides the placement."""
        out = []
        for shape, dtype in self._shapes:
            n = math.prod(size_exprs.evaluate(d, sizes) if isinstance(d, str) else d for d in shape)
            out.append(max(0, n) * (act_itemsize if dtype == "act" else ITEMSIZE[dtype]))
        return tuple(out)

    def layout(self, sizes: dict, act_itemsize: int, key: tuple | None = None) -> Layout:
        key = key if key is not None else self.key(sizes, act_itemsize)
        got = self._layouts.get(key)
        if got is None:
            nbytes = [key[i] for i in self._slot_shape]
            offsets, total = place(self.slots, nbytes)
            names = [s.name for s in self.slots]
            got = Layout(dict(zip(names, offsets)), dict(zip(names, nbytes)), total)
            if len(self._layouts) >= 256:    # a server's many prompt lengths: start over
                self._layouts.clear()
            self._layouts[key] = got
        return got

    def unplanned_bytes(self, sizes: dict, act_itemsize: int) -> int:
        """What the same slots take with no sharing (each its own buffer): the plan's baseline."""
        key = self.key(sizes, act_itemsize)
        return sum(_align(key[i]) for i in self._slot_shape)


# -- what `dsgraph compile` and `dsgraph plan` report ------------------------------------------

REPORT_SMS = 132               # an H100 SXM's / H200's SM count: the workspaces' split counts read it
PREFILL_TOKENS = (1, 2048, 16384)
DECODE_BATCHES = (1, 32, 128)
DECODE_CONTEXT = 4096


def pairs_per_token(plan) -> int:
    """P of the phase's routing values (shape ("T*P", experts)); 1 where nothing routes."""
    from ir.ops.moe import pairs_per_token as of_dim
    for buf in plan.buffers.values():
        if buf.dtype == "routing" and of_dim(buf.shape[0]) is not None:
            return of_dim(buf.shape[0])
    return 1


def step_sizes(phase: str, tokens: int, plan, *, context: int = DECODE_CONTEXT, sms: int = REPORT_SMS) -> dict:
    """The sizes of one step: a prefill of one `tokens`-token prompt, or a decode step of `tokens`
    sequences at `context` tokens each."""
    P = pairs_per_token(plan)
    if phase == "decode":
        return {"T": tokens, "B": tokens, "NP": P * tokens, "MAXQ": 1, "MAXCTX": context, "W": -(-context // 16),
                "SMS": sms}
    return {"T": tokens, "B": 1, "NP": P * tokens, "MAXQ": tokens, "MAXCTX": tokens, "TK": tokens,
            "W": -(-tokens // 16), "SMS": sms}


def peak_bytes(plans: dict, act_itemsize: int, *, prefill_tokens=PREFILL_TOKENS, decode_batches=DECODE_BATCHES,
               context: int = DECODE_CONTEXT) -> list[tuple[str, int, int, int]]:
    """(phase, tokens or batch, planned arena bytes, bytes with one buffer per value) per step size:
    the step's activations and workspaces; its logits (the step's output) and the library calls'
    temporaries come on top."""
    out = []
    for phase, plan in plans.items():
        arena = ArenaPlan(plan.arena)
        for n in (decode_batches if phase == "decode" else prefill_tokens):
            sizes = step_sizes(phase, n, plan, context=context)
            out.append((phase, n, arena.layout(sizes, act_itemsize).total, arena.unplanned_bytes(sizes, act_itemsize)))
    return out


def describe_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.1f} kB"


def peak_lines(plans: dict, act_itemsize: int, **kw) -> list[str]:
    """The report's lines, one per phase, e.g. `prefill activations: 2048 tok 121.77 MB, 16384 tok
    974.13 MB (one buffer per value: 5.48 GB, 43.42 GB)`."""
    rows = peak_bytes(plans, act_itemsize, **kw)
    lines = []
    for phase in plans:
        mine = [r for r in rows if r[0] == phase]
        if phase == "decode":
            head, size = f"decode activations at context {kw.get('context', DECODE_CONTEXT)}", "batch {}"
        else:
            head, size = f"{phase} activations", "{} tok"
        lines.append(f"{head}: " + ", ".join(f"{size.format(n)} {describe_bytes(b)}" for _, n, b, _ in mine)
                     + " (one buffer per value: " + ", ".join(describe_bytes(u) for *_, u in mine) + ")")
    return lines
