"""Checks of a task graph (codegen/tasks.py) by a bookkeeping of its own, not the builder's edges.

The plan's launch order is the reference semantics: run sequentially, every byte a task reads was
last written by one task (or by nobody: a step input), and every byte it writes was last read by
some tasks and written by one.  A graph is correct when, for every task,

    (a) every task that last wrote a byte it reads is an ancestor (it waits for it, maybe through others)
    (b) every task that last wrote or since read a byte it writes is an ancestor

`problems` checks (a) and (b) for every task and that the graph has no cycle; `simulate` runs the
tasks in a given order (any topological order is one a persistent kernel may take) on stamped
bytes and reports every read that sees another version than the sequential run, and every write
that lands before a reader of the old version ran or before the previous writer.
"""
from __future__ import annotations

import random
from collections import defaultdict


class _Cells:
    """Every space's bytes cut at every boundary a task's region has there."""

    def __init__(self, graph, tiling):
        self.reads, self.writes = [], []
        bounds: dict = defaultdict(set)
        for t in graph.tasks:
            r = [iv for reg in t.reads for iv in tiling.intervals(reg)]
            w = [iv for reg in t.writes for iv in tiling.intervals(reg)]
            self.reads.append(r)
            self.writes.append(w)
            for space, lo, hi in (*r, *w):
                bounds[space].add(lo)
                bounds[space].add(hi)
        self.edges = {s: sorted(b) for s, b in bounds.items()}
        self.pos = {s: {b: k for k, b in enumerate(e)} for s, e in self.edges.items()}

    def of(self, ivs) -> set:
        out = set()
        for space, lo, hi in ivs:
            p = self.pos[space]
            out.update((space, c) for c in range(p[lo], p[hi]))
        return out


def _sequential(graph, cells: _Cells):
    """Per task: the cells it reads with the version each must see, the cells it writes with the
    version each must replace, and how many reads of that version must be done first."""
    version: dict = {}
    nreads: dict = defaultdict(int)
    must_see, must_replace = [], []
    for t in graph.tasks:
        r, w = cells.of(cells.reads[t.id]), cells.of(cells.writes[t.id])
        must_see.append({c: version.get(c, -1) for c in r})
        for c in r:
            nreads[c] += 1
        # a task that reads what it writes counts its own read as done before its write
        must_replace.append({c: (version.get(c, -1), nreads[c]) for c in w})
        for c in w:
            version[c] = t.id
            nreads[c] = 0
    return must_see, must_replace


def _readers_since(graph, cells: _Cells):
    """Per task: the tasks whose accesses it must follow (last writers of what it reads; last writers
    and readers since of what it writes)."""
    last: dict = {}
    since: dict = defaultdict(list)
    need = []
    for t in graph.tasks:
        r, w = cells.of(cells.reads[t.id]), cells.of(cells.writes[t.id])
        req = {last[c] for c in r | w if c in last}
        for c in w:
            req.update(since[c])
        req.discard(t.id)
        need.append(req)
        for c in r:
            since[c].append(t.id)
        for c in w:
            last[c] = t.id
            since[c] = []
    return need


def cycle(graph) -> list[int] | None:
    """Some tasks on a cycle (or depending on a task that does not exist), or None."""
    n = len(graph.tasks)
    indeg = [0] * n
    users = defaultdict(list)
    for t in graph.tasks:
        for d in t.deps:
            if not 0 <= d < n:
                return [t.id, d]
            indeg[t.id] += 1
            users[d].append(t.id)
    ready = [t for t in range(n) if indeg[t] == 0]
    done = 0
    while ready:
        t = ready.pop()
        done += 1
        for u in users[t]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    return None if done == n else [t for t in range(n) if indeg[t] > 0]


def problems(graph, tiling) -> list[str]:
    """What breaks (a) or (b), or a cycle; empty for a correct graph."""
    stuck = cycle(graph)
    if stuck is not None:
        return [f"cycle or dangling dependency among tasks {stuck[:8]}"]
    cells = _Cells(graph, tiling)
    need = _readers_since(graph, cells)
    out = []
    for t in graph.tasks:
        req = need[t.id]
        if not req:
            continue
        floor = min(req)
        seen, stack = set(), list(t.deps)
        while stack:                     # ancestors of t no earlier than the earliest one it needs
            d = stack.pop()
            if d in seen or d < floor:
                continue
            seen.add(d)
            stack.extend(graph.tasks[d].deps)
        for m in sorted(req - seen):
            out.append(f"task {t.id} ({_name(graph, t.id)}) does not wait for task {m} ({_name(graph, m)})")
    return out


def _name(graph, tid: int) -> str:
    t = graph.tasks[tid]
    o = graph.ops[t.op]
    return f"{o.kernel} tile {t.label} of {o.node}"


def topological_order(graph, rng: random.Random | None = None, *, latest_first: bool = False) -> list[int]:
    """A topological order: a random ready task each time, or the latest ready one (which runs a
    consumer as early as its waits allow: what exposes a missing wait)."""
    n = len(graph.tasks)
    indeg = [len(t.deps) for t in graph.tasks]
    users = defaultdict(list)
    for t in graph.tasks:
        for d in t.deps:
            users[d].append(t.id)
    ready = [t for t in range(n) if indeg[t] == 0]
    order = []
    while ready:
        if latest_first:
            k = max(range(len(ready)), key=ready.__getitem__)
        else:
            k = rng.randrange(len(ready))
        ready[k], ready[-1] = ready[-1], ready[k]
        t = ready.pop()
        order.append(t)
        for u in users[t]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    return order


def simulate(graph, tiling, order: list[int]) -> list[str]:
    """Run the tasks in `order` on stamped bytes; every stale read or early write, as text."""
    cells = _Cells(graph, tiling)
    must_see, must_replace = _sequential(graph, cells)
    version: dict = {}
    nreads: dict = defaultdict(int)
    out = []
    if sorted(order) != list(range(len(graph.tasks))):
        return ["the order does not run every task exactly once"]
    for t in order:
        for c, v in must_see[t].items():
            if version.get(c, -1) != v:
                out.append(f"task {t} ({_name(graph, t)}) reads {c[0]} cell {c[1]} written by "
                           f"{version.get(c, -1)}, not {v}")
                break
        for c in must_see[t]:
            nreads[c] += 1
        for c, (v, n) in must_replace[t].items():
            if version.get(c, -1) != v or nreads[c] != n:
                out.append(f"task {t} ({_name(graph, t)}) writes {c[0]} cell {c[1]} holding version "
                           f"{version.get(c, -1)} after {nreads[c]} reads, not {v} after {n}")
                break
        for c in must_replace[t]:
            version[c] = t
            nreads[c] = 0
    return out
