"""The decode step as a task graph: every launch split into tasks (tiles), each with the regions of
the values it reads and writes, and the dependencies those regions imply.

A persistent decode kernel runs the step's tasks on SMs that wait on counters instead of on kernel
boundaries; this pass says which tasks there are and which wait for which.  It takes the lowered
decode plan (codegen/lower.py) at one batch bucket (the sizes fix which launches run and how many
tiles each has) and gives a TaskGraph:

    op     a launch (or library call) that has work at these sizes, in plan order
    task   a tile of an op: reads and writes, each a Region (a value and an index box per dim)
    deps   the earlier tasks it must wait for: the last writer of every byte it reads (RAW), and
           for every byte it writes the last writer (WAW) and the readers since (WAR)

Dependencies are computed on *bytes*, not on value names: the memory plan (codegen/memplan.py)
places values whose lifetimes do not overlap at the same arena bytes, and a split's outputs are
views of their input, so two different values may be the same memory.  The graph is built against
the arena as placed at the bucket's sizes (the persistent kernel runs on that same arena), which
orders a later layer's write after an earlier layer's last read of the same bytes; a non-aliasing
plan would need no such edges but would cost the arena's sharing.

A family declares its tiling with ``tasks(launch, tiling)`` in its module: a list of Tile (label,
reads, writes) from the launch's sizes (``tiling`` evaluates shapes and builds regions).  A family
without one, or one that returns None for a launch (say, a stage that finishes with a grid-wide
ticket), is one task per launch that reads every pointer it is passed and writes every non-const
one, whole: always correct, coarse.  A library call is one coarse task; a view ("split") is none.

The graph is data: `to_json` writes one task per line (stable order, so it diffs); `summary` is what
`dsgraph explain --tasks` prints.  Bundles do not record it: V3's graph is tens of MB, and the persistent
segments (codegen/segments.py) carry what they run, waits per member, which tests/codegen/test_segments.py
checks against this graph.  codegen/taskcheck.py checks a graph with its own region bookkeeping.
"""
from __future__ import annotations

import bisect
import itertools
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from . import families
from . import sizes as size_exprs
from .kernel import CtxRef, KernelLaunch, LibraryCall, StrideRef, ValueRef, WorkspaceRef
from .memplan import ITEMSIZE, ArenaPlan, step_sizes, workspace_slot

TASK_CONTEXT = 512             # each sequence's context: decides the attention's splits
ARENA = "arena"


@dataclass(frozen=True)
class Region:
    value: str                                  # a value, a routing part, "<node>/<workspace>", a cache
    box: tuple[tuple[int, int], ...]            # [lo, hi) per dim of the value's shape at the step's sizes

    def to_json(self) -> list:
        return [self.value, [list(r) for r in self.box]]


@dataclass(frozen=True)
class Tile:
    label: str
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]


@dataclass
class Op:
    step: int                  # index into the plan's steps
    kernel: str                # kernel name, or "library <call>"
    family: str
    stage: str
    node: str
    tiling: str                # declared | coarse | library
    first: int                 # its tasks are first .. first + count - 1
    count: int


@dataclass
class Task:
    id: int
    op: int
    label: str
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    deps: tuple[int, ...] = ()


@dataclass
class TaskGraph:
    batch: int
    context: int
    sms: int
    ops: list[Op] = field(default_factory=list)
    tasks: list[Task] = field(default_factory=list)
    tiling: "Tiling | None" = field(default=None, repr=False, compare=False)   # what its regions mean

    def to_json(self) -> str:
        """One op and one task per line, in plan order: a review diffs it line by line."""
        head = {"batch": self.batch, "context": self.context, "sms": self.sms}
        lines = ["{", f'"graph": {json.dumps(head, sort_keys=True)},', '"ops": [']
        for i, o in enumerate(self.ops):
            d = {"step": o.step, "kernel": o.kernel, "family": o.family, "stage": o.stage, "node": o.node,
                 "tiling": o.tiling, "tasks": [o.first, o.count]}
            lines.append(json.dumps(d, sort_keys=True) + ("," if i + 1 < len(self.ops) else ""))
        lines += ["],", '"tasks": [']
        for i, t in enumerate(self.tasks):
            d = {"id": t.id, "op": t.op, "tile": t.label,
                 "waits": [[op, "all" if tiles is None else list(tiles)] for op, tiles in self.waits(t)],
                 "reads": [r.to_json() for r in t.reads], "writes": [r.to_json() for r in t.writes]}
            lines.append(json.dumps(d, sort_keys=True) + ("," if i + 1 < len(self.tasks) else ""))
        lines += ["]", "}"]
        return "\n".join(lines) + "\n"

    def waits(self, task: Task) -> list[tuple[int, tuple | None]]:
        """Its dependencies by op, as a persistent kernel waits on them: (op, None) for every task of the
        op (one counter reaching the op's task count), else (op, the op's tile indices it needs)."""
        by_op: dict = defaultdict(list)
        for d in task.deps:
            by_op[self.tasks[d].op].append(d)
        out = []
        for op, ds in sorted(by_op.items()):
            o = self.ops[op]
            out.append((op, None if len(ds) == o.count else tuple(d - o.first for d in ds)))
        return out

    def levels(self) -> list[int]:
        """Each task's level: 0 without dependencies, else one more than its deepest dependency."""
        level = [0] * len(self.tasks)
        for t in self.tasks:                     # deps always point to earlier tasks
            level[t.id] = 1 + max((level[d] for d in t.deps), default=-1)
        return level

    def summary(self) -> dict:
        level = self.levels()
        width = defaultdict(int)
        for lv in level:
            width[lv] += 1
        per_family: dict = {}
        for o in self.ops:
            row = per_family.setdefault((o.family, o.stage, o.tiling), [0, 0, 0])
            row[0] += 1
            row[1] += o.count
            row[2] += sum(len(t.deps) for t in self.tasks[o.first:o.first + o.count])
        waits = sum(1 if tiles is None else len(tiles) for t in self.tasks for _, tiles in self.waits(t))
        return {"tasks": len(self.tasks), "ops": len(self.ops), "deps": sum(len(t.deps) for t in self.tasks),
                "waits": waits,
                "critical_path": 1 + max(level, default=-1),
                "widest_level": max(width.values(), default=0),
                "per_family": {f"{f}{'.' + s if s else ''} ({how})": tuple(v)
                               for (f, s, how), v in per_family.items()}}


# -- what a family's tasks() is given ----------------------------------------------------------

class Tiling:
    """Shapes, regions and byte intervals of one phase plan at one step's sizes."""

    def __init__(self, plan, sizes: dict, act_itemsize: int = 2):
        self.plan, self.sizes, self.act_itemsize = plan, dict(sizes), act_itemsize
        self.T, self.B, self.context = sizes["T"], sizes["B"], sizes["MAXCTX"]
        self.layout = ArenaPlan(plan.arena).layout(self.sizes, act_itemsize)
        self._workspaces: dict[str, tuple] = {}    # "<node>/<workspace>" -> (shape, dtype)
        for step in plan.steps:
            for ws in getattr(step, "workspace", ()):
                self._workspaces.setdefault(workspace_slot(step.nodes[0], ws.name),
                                            (tuple(self.eval(d) for d in ws.shape), ws.dtype))
        self.caches = {b.layer: b.name for b in plan.buffers.values() if b.dtype == "state"}

    def eval(self, expr) -> int:
        return size_exprs.evaluate(expr, self.sizes) if isinstance(expr, str) else int(expr)

    # values
    def shape(self, value: str) -> tuple[int, ...]:
        if value in self._workspaces:
            return self._workspaces[value][0]
        buf = self.plan.buffers[value]
        if buf.dtype == "state":      # the cache in token rows: sequence b's rows b*context .. +context
            return (self.B * self.context,)
        return tuple(self.eval(d) for d in buf.shape)

    def value_of(self, launch, arg: str) -> str:
        """The value (workspace slot, cache) bound to the launch's pointer argument `arg`."""
        for a in launch.args:
            if a.name == arg:
                return self._bound(launch, a.ref)
        raise KeyError(f"{launch.name} has no argument {arg}")

    def _bound(self, launch, ref) -> str:
        if isinstance(ref, ValueRef):
            return ref.name
        if isinstance(ref, WorkspaceRef):
            return workspace_slot(launch.nodes[0], ref.name)
        if isinstance(ref, CtxRef) and ref.field == "kv_cache":
            return self.caches[self.plan.nodes[launch.nodes[0]].layer]
        raise KeyError(ref)

    # regions
    def box(self, value: str, *ranges) -> Region:
        """Region of `value`: one (lo, hi) or None (the whole dim) per leading dim; the rest whole."""
        shape = self.shape(value)
        box = tuple((0, n) if r is None else (max(0, r[0]), min(n, r[1]))
                    for r, n in itertools.zip_longest(ranges, shape))
        return Region(value, box)

    def whole(self, value: str) -> Region:
        return self.box(value)

    def rows(self, value: str, lo: int, hi: int) -> Region:
        return self.box(value, (lo, hi))

    def cols(self, value: str, lo: int, hi: int) -> Region:
        """Columns [lo, hi) of the last dim, every row."""
        shape = self.shape(value)
        return self.box(value, *([None] * (len(shape) - 1)), (lo, hi))

    def token_rows(self, value: str, t: int) -> Region:
        """Token t's rows of a value whose first dim is T times some k (a token's pairs: T*P)."""
        n = self.shape(value)[0]
        k = n // self.T if self.T and n % self.T == 0 else None
        return self.rows(value, t * k, (t + 1) * k) if k else self.whole(value)

    def cache_rows(self, launch, b: int, lo: int, hi: int) -> Region:
        """Rows lo..hi of sequence b's context in the cache of the launch's layer."""
        return Region(self._bound(launch, CtxRef("kv_cache")), ((b * self.context + lo, b * self.context + hi),))

    def parts(self, value: str) -> list[str]:
        """A routing value's two int32 buffers; any other value itself."""
        buf = self.plan.buffers.get(value)
        return list(buf.parts) if buf is not None and buf.parts else [value]

    def pointers(self, launch):
        """(value, written) for each pointer a step's tiles track: values, workspaces and the cache (not
        weights, which nothing in a step writes, nor step metadata, which the host writes before it)."""
        for a in launch.args:
            if not a.is_pointer or isinstance(a.ref, StrideRef):
                continue
            if isinstance(a.ref, CtxRef) and a.ref.field != "kv_cache":
                continue
            if not isinstance(a.ref, (ValueRef, WorkspaceRef, CtxRef)):
                continue
            for v in self.parts(self._bound(launch, a.ref)):
                yield v, not a.ctype.startswith("const ")

    # tilings families declare with
    @staticmethod
    def tile(label, reads, writes) -> Tile:
        return Tile(str(label), tuple(reads), tuple(writes))

    def per_token(self, launch) -> list[Tile]:
        """One task per token (decode: per sequence): token t's rows of every value it is passed
        (a value of T*k rows: its k rows; one of no token dim: whole), sequence t's cache rows (read:
        its context; written: its new row)."""
        caches = set(self.caches.values())
        tiles = []
        for t in range(self.T):
            reads, writes = [], []
            for v, written in self.pointers(launch):
                if v in caches:
                    lo = self.context - 1 if written else 0
                    reg = Region(v, ((t * self.context + lo, (t + 1) * self.context),))
                else:
                    reg = self.token_rows(v, t)
                (writes if written else reads).append(reg)
            tiles.append(self.tile(t, reads, writes))
        return tiles

    def column_tiles(self, launch, width: int, *, of: str | None = None) -> list[Tile]:
        """Tasks over the last dim of what the launch writes, `width` columns each: each reads every
        value it is passed whole and writes its columns of every written value (of: of that one only;
        the others whole)."""
        pointers = list(self.pointers(launch))
        written = [v for v, w in pointers if w]
        n = max(self.shape(v)[-1] for v in written if of is None or v == of)
        reads = [self.whole(v) for v, w in pointers if not w]
        return [self.tile(k, reads, [self.cols(v, lo, lo + width) if of is None or v == of else self.whole(v)
                                     for v in written])
                for k, lo in enumerate(range(0, n, width))]

    # bytes
    def _storage(self, value: str):
        """(space, byte offset, element strides, itemsize) of a value's storage."""
        if value in self._workspaces:
            shape, dtype = self._workspaces[value]
            return ARENA, self.layout.offsets.get(value, 0), _contiguous(shape), self._itemsize(dtype)
        buf = self.plan.buffers.get(value)
        if buf is None:
            raise KeyError(f"no buffer {value}")
        if buf.dtype == "state":
            return value, 0, (1,), 1
        itemsize = self._itemsize(buf.dtype)
        if buf.view is not None:
            space, base, _, _ = self._storage(buf.view.base)
            strides = tuple(self.eval(s) for s in buf.view.strides)
            return space, base + buf.view.offset * itemsize, strides, itemsize
        strides = _contiguous(self.shape(value))
        if value in self.layout.offsets:
            return ARENA, self.layout.offsets[value], strides, itemsize
        return value, 0, strides, itemsize       # the step's inputs and its logits

    def _itemsize(self, dtype: str) -> int:
        return self.act_itemsize if dtype == "act" else ITEMSIZE[dtype]

    def intervals(self, region: Region) -> list[tuple[str, int, int]]:
        """The region's bytes as (space, lo, hi) intervals, adjacent ones merged."""
        if any(hi <= lo for lo, hi in region.box):
            return []
        space, base, strides, isz = self._storage(region.value)
        *lead, (c0, c1) = region.box
        *lead_st, last = strides
        out: list[tuple[int, int]] = []
        for idx in itertools.product(*(range(lo, hi) for lo, hi in lead)):
            start = base + (sum(i * s for i, s in zip(idx, lead_st)) + c0 * last) * isz
            if last == 1:
                out.append((start, start + (c1 - c0) * isz))
            else:
                out.extend((start + k * last * isz, start + k * last * isz + isz) for k in range(c1 - c0))
        out.sort()
        merged: list[list[int]] = []
        for lo, hi in out:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return [(space, lo, hi) for lo, hi in merged]


def _contiguous(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


# -- tiles of one step ------------------------------------------------------------------------

def coarse_tile(launch: KernelLaunch, tiling: Tiling) -> Tile:
    """The whole launch as one task: reads every pointer it is passed, writes every non-const one."""
    pointers = list(tiling.pointers(launch))
    return Tile("all", tuple(tiling.whole(v) for v, _ in pointers),
                tuple(tiling.whole(v) for v, w in pointers if w))


def library_tile(call: LibraryCall, tiling: Tiling) -> Tile:
    ins = [tiling.whole(v) for name in call.inputs for v in tiling.parts(name)]
    outs = [tiling.whole(v) for name in call.outputs for v in tiling.parts(name)]
    return Tile("all", tuple(ins), tuple(outs))


def runs(step, sizes: dict) -> bool:
    if isinstance(step, KernelLaunch):
        return all(size_exprs.evaluate(g, sizes) > 0 for g in step.grid)
    return step.runs_at(sizes["T"]) and step.call != "view"


def step_tiles(step, tiling: Tiling) -> tuple[str, list[Tile]]:
    if isinstance(step, LibraryCall):
        return "library", [library_tile(step, tiling)]
    family = families.family_named(step.family)
    declare = getattr(family, "tasks", None)
    tiles = declare(step, tiling) if declare is not None else None
    if tiles is None:
        return "coarse", [coarse_tile(step, tiling)]
    return "declared", tiles


# -- the graph --------------------------------------------------------------------------------

def build_task_graph(plan, batch: int, *, context: int = TASK_CONTEXT, sms: int = 132,
                     act_itemsize: int = 2) -> TaskGraph:
    """The task graph of `plan` (a decode PhasePlan) at `batch` sequences of `context` tokens."""
    sizes = step_sizes("decode", batch, plan, context=context, sms=sms)
    tiling = Tiling(plan, sizes, act_itemsize)
    graph = TaskGraph(batch, context, sms, tiling=tiling)
    for i, step in enumerate(plan.steps):
        if not runs(step, sizes):
            continue
        how, tiles = step_tiles(step, tiling)
        op = len(graph.ops)
        if isinstance(step, KernelLaunch):
            graph.ops.append(Op(i, step.name, step.family, step.stage, step.nodes[0], how, len(graph.tasks),
                                len(tiles)))
        else:
            graph.ops.append(Op(i, f"library {step.call}", step.op, "", step.node, how, len(graph.tasks), 1))
        for t in tiles:
            graph.tasks.append(Task(len(graph.tasks), op, t.label, t.reads, t.writes))
    _add_deps(graph, tiling)
    return graph


def _add_deps(graph: TaskGraph, tiling: Tiling) -> None:
    """RAW, WAW and WAR edges, tracked per cell: the byte ranges between every boundary any task's
    region has in a space, each with its last writer and the readers since.

    The tiles of one op are usually independent (disjoint writes, none reads what a sibling writes):
    then they all see the state before the op, and the many tiles reading one region (every tile of
    a linear reads all of x) are looked up once and recorded as one group.  Otherwise the op's tasks
    go one by one, in order."""
    spans = [([iv for r in t.reads for iv in tiling.intervals(r)], [iv for r in t.writes for iv in tiling.intervals(r)])
             for t in graph.tasks]
    bounds: dict[str, set] = defaultdict(set)
    for reads, writes in spans:
        for space, lo, hi in (*reads, *writes):
            bounds[space].update((lo, hi))
    index = {s: {b: k for k, b in enumerate(sorted(bs))} for s, bs in bounds.items()}
    writer = {s: [-1] * len(bs) for s, bs in bounds.items()}
    readers: dict[str, list] = {s: [[] for _ in bs] for s, bs in bounds.items()}   # groups: tuples of tasks

    def cells(ivs):
        for space, lo, hi in ivs:
            ix = index[space]
            for c in range(ix[lo], ix[hi]):
                yield space, c

    def after_writers(ivs) -> set:
        return {w for space, c in cells(ivs) if (w := writer[space][c]) >= 0}

    def after_accesses(ivs) -> set:
        deps = set()
        for space, c in cells(ivs):
            if writer[space][c] >= 0:
                deps.add(writer[space][c])
            for group in readers[space][c]:
                deps.update(group)
        return deps

    def record(groups, writes) -> None:
        for ivs, ids in groups:
            for space, c in cells(ivs):
                readers[space][c].append(ids)
        for tid, ivs in writes:
            for space, c in cells(ivs):
                writer[space][c] = tid
                readers[space][c] = []

    for op in graph.ops:
        ids = range(op.first, op.first + op.count)
        if _independent([spans[i] for i in ids]):
            groups: dict = defaultdict(list)
            for i in ids:
                groups[tuple(spans[i][0])].append(i)
            raw = {key: after_writers(key) for key in groups}
            for i in ids:
                deps = raw[tuple(spans[i][0])] | after_accesses(spans[i][1])
                deps.discard(i)
                graph.tasks[i].deps = tuple(sorted(deps))
            record([(key, tuple(g)) for key, g in groups.items()], [(i, spans[i][1]) for i in ids])
            continue
        for i in ids:
            deps = after_writers(spans[i][0]) | after_accesses(spans[i][1])
            deps.discard(i)
            graph.tasks[i].deps = tuple(sorted(deps))
            record([(spans[i][0], (i,))], [(i, spans[i][1])])
    _prune(graph)


def _independent(spans) -> bool:
    """No two of these tasks write the same byte, and none reads a byte another writes."""
    writes = sorted((space, lo, hi, k) for k, (_, w) in enumerate(spans) for space, lo, hi in w)
    for (s0, _, h0, _), (s1, l1, _, _) in zip(writes, writes[1:]):
        if s0 == s1 and l1 < h0:
            return False
    if len(spans) < 2:
        return True
    starts = defaultdict(list)
    for space, lo, hi, k in writes:
        starts[space].append((lo, hi, k))
    for k, (reads, _) in enumerate(spans):
        for space, lo, hi in reads:
            ws = starts.get(space, ())
            j = bisect.bisect_left(ws, (hi,)) - 1     # writes are disjoint and sorted: scan back from here
            while j >= 0 and ws[j][1] > lo:
                if ws[j][2] != k:
                    return False
                j -= 1
    return True


def _prune(graph: TaskGraph) -> None:
    """Drop the dependencies the others already imply, where that is cheap to see: a dependency of a
    dependency is implied, and so is any task of an op all of whose tasks are ancestors of another
    dependency (each task keeps those ops as a bitset, from its dependencies and theirs).  Mostly
    these are the write-after-read and write-after-write edges through arena bytes a value shares
    with an earlier one, whose readers and writers all finished before something the task waits for."""
    full = [0] * len(graph.tasks)
    for t in graph.tasks:
        implied: set = set()
        seen = 0
        for d in t.deps:
            implied.update(graph.tasks[d].deps)
            seen |= full[d]
        seen |= _whole_ops(graph, implied)
        kept = tuple(d for d in t.deps if d not in implied and not (seen >> graph.tasks[d].op) & 1)
        full[t.id] = seen | _whole_ops(graph, implied.union(t.deps))
        t.deps = kept


def _whole_ops(graph: TaskGraph, tasks) -> int:
    """Bitset of the ops all of whose tasks are among `tasks`."""
    bits = 0
    for op, n in Counter(graph.tasks[d].op for d in tasks).items():
        if n == graph.ops[op].count:
            bits |= 1 << op
    return bits


def summary_lines(graph: TaskGraph) -> list[str]:
    s = graph.summary()
    lines = [f"decode, batch {graph.batch} (context {graph.context}, {graph.sms} SMs): {s['tasks']} tasks in "
             f"{s['ops']} launches, {s['deps']} dependencies ({s['waits']} counter waits), "
             f"critical path {s['critical_path']} tasks, widest level {s['widest_level']} tasks"]
    for name, (ops, tasks, deps) in sorted(s["per_family"].items(), key=lambda kv: (-kv[1][1], kv[0])):
        lines.append(f"  {name:<48} {ops:>4} launches {tasks:>6} tasks {deps:>7} dependencies")
    return lines
