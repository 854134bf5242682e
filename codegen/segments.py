"""Persistent decode segments: each maximal run of consecutive decode launches whose families give a
task body (`segment_body(launch)`: the norms, the MoE combine + norm, the 16-bit skinny linears, the
tensor-core V up-projection) becomes one launch of the `segment` family (codegen/families/segment.py),
whose CTAs take the members' tiles in plan order and wait on counters instead of on kernel boundaries
(templates/include/segment.cuh).  A member's tiles are its launch's CTAs; a 3-D grid's (v_up's) are
numbered as one index, its body decoding them.

    steps:   ... attention | v_up | linear o | fused_add_rms_norm | route ... | combine_norm | linear q | query ...
    after:   ... attention | segment(v_up, o, norm) | route ... | segment(combine_norm, q) | query ...

What may sit inside a run: member launches, views (a split: no work), and library calls that do not
run where the segment does (a linear's cuBLAS call from skinny_upto + 1 tokens on).  A run ends at
anything else, at a member whose block size differs, and at a member binding another layer's KV
cache than an earlier one (a launch binds one cache: the lead node's).

Token range: the segment runs at 1 <= T <= upto, where every member has work and no library call
inside the run does; the members' own launches stay in the plan for the larger T (their grids times
"T > upto"), or leave it where upto is unbounded.

Waits: member j waits for every task of member i < j when j reads or writes storage that i writes,
or writes storage that i reads (a view is its base's storage).  Inside a segment no two values share
arena bytes: the segment's step uses all of them, so the memory plan (codegen/memplan.py) keeps them
apart.  Waits implied by others (i before k, k before j) are dropped.  A wait is whole-member: a
member's tasks all wait for the same counters (codegen/tasks.py's tile-level edges are the check:
tests/codegen/test_segments.py).

The dispatch table `segments` (codegen/dispatch.py) says where segments are made: decode, with
Tuning.persistent.segments on; elsewhere the plan keeps a launch per op (the reference and fallback).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import dispatch, families
from . import sizes as size_exprs
from .kernel import CtxRef, KernelLaunch, LibraryCall, ValueRef
from .memplan import arena_slots

PROBE_MAX = 1 << 20     # token counts a member's range is probed up to (a larger one: unbounded)
PROBE_SMS = 132         # SMS while probing: token ranges are factors of T alone, whatever the device


@dataclass(frozen=True)
class Segment:
    steps: tuple[int, ...]               # plan.steps indices of the members, in order
    waits: tuple[tuple[int, ...], ...]   # per member: the earlier members (indices into steps) it waits for
    lead: int                            # the member whose node leads the launch (binds the kv cache)
    upto: int | None                     # it runs at 1 <= T <= upto (None: every T)


# Tuning.persistent.members: the level from which a body kind is a member
LEVELS = {"rms_norm": 1, "add_rms_norm": 1, "linear": 1, "combine_norm": 2, "v_up": 2}
ALL = max(LEVELS.values())


def body(step, level: int = ALL):
    """The member family's task body of a launch, or None (not a member, or not at this members level).
    A launch with a 2-D or 3-D grid is a member where its body takes the grid's y and z extents (grid_yz)
    as one task index."""
    if not isinstance(step, KernelLaunch) or step.workspace:
        return None
    declare = getattr(families.family_named(step.family), "segment_body", None)
    out = declare(step) if declare is not None else None
    if out is None or LEVELS[out["kind"]] > level or list(step.grid[1:]) != out.get("grid_yz", [1, 1]):
        return None
    return out


def _sizes(T: int) -> dict:
    return {"T": T, "B": T, "NP": T, "MAXQ": 1, "MAXCTX": 1, "TK": T, "W": 1, "SMS": PROBE_SMS}


def runs_upto(step) -> int | None:
    """The largest T up to which the launch has work at every T >= 1 (0: none at T = 1; None: every
    T probed).  Grid factors are token ranges (codegen/sizes.py): work, then none."""
    def works(T):
        return all(size_exprs.evaluate(g, _sizes(T)) > 0 for g in step.grid)
    if not works(1):
        return 0
    if works(PROBE_MAX):
        return None
    lo, hi = 1, PROBE_MAX            # works(lo), not works(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if works(mid) else (lo, mid)
    return lo


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


def _kv_layer(plan, step) -> int | None:
    """The layer whose KV cache the launch binds (None: it binds none)."""
    if any(isinstance(a.ref, CtxRef) and a.ref.field == "kv_cache" for a in step.args):
        return plan.nodes[step.nodes[0]].layer
    return None


@dataclass
class _Run:
    steps: list
    upto: int | None = None
    block: tuple = ()
    layer: int | None = None

    def takes(self, step, layer) -> bool:
        return not self.steps or (step.block == self.block and (None in (layer, self.layer) or layer == self.layer))


def find(plan, level: int = ALL) -> list[Segment]:
    """The plan's segments (runs of two members or more, members at `level`), in order."""
    out, run = [], _Run([])

    def close(r: _Run) -> _Run:
        if len(r.steps) > 1 and (r.upto is None or r.upto >= 1):
            out.append(_segment(plan, tuple(r.steps), r.upto))
        return _Run([])

    for i, step in enumerate(plan.steps):
        if isinstance(step, LibraryCall):
            if step.call == "view":
                continue
            if run.steps and step.from_tokens > 1:      # it does not run where the segment runs
                run.upto = _min(run.upto, step.from_tokens - 1)
                continue
            run = close(run)
            continue
        reach = runs_upto(step) if body(step, level) is not None else 0
        if reach == 0:
            run = close(run)
            continue
        layer = _kv_layer(plan, step)
        if not run.takes(step, layer):
            run = close(run)
        if not run.steps:
            run.block = step.block
        run.steps.append(i)
        run.upto = _min(run.upto, reach)
        run.layer = layer if layer is not None else run.layer
    close(run)
    return out


def storage(plan, name: str) -> set[str]:
    """The buffers behind a value: a view's base, a routing value's parts."""
    buf = plan.buffers.get(name)
    if buf is None:
        return {name}
    if buf.view is not None:
        return storage(plan, buf.view.base)
    if buf.parts:
        return set().union(*(storage(plan, p) for p in buf.parts))
    return {name}


def accesses(plan, step) -> tuple[set, set]:
    """(storage it reads, storage it writes)."""
    reads, writes = set(), set()
    for a in step.args:
        if isinstance(a.ref, ValueRef):
            (reads if a.ctype.startswith("const ") else writes).update(storage(plan, a.ref.name))
        elif isinstance(a.ref, CtxRef) and a.ref.field == "kv_cache":
            (reads if a.ctype.startswith("const ") else writes).add(f"kv_cache.{plan.nodes[step.nodes[0]].layer}")
    return reads, writes


def _segment(plan, steps: tuple[int, ...], upto) -> Segment:
    acc = [accesses(plan, plan.steps[i]) for i in steps]
    after: list[set] = []                 # per member: every member it follows, directly or not
    waits = []
    for j, (rj, wj) in enumerate(acc):
        direct = {i for i, (ri, wi) in enumerate(acc[:j]) if wi & (rj | wj) or ri & wj}
        implied = set().union(*(after[k] for k in direct)) if direct else set()
        waits.append(tuple(sorted(direct - implied)))
        after.append(direct | implied)
    leads = [k for k, i in enumerate(steps) if _kv_layer(plan, plan.steps[i]) is not None]
    return Segment(steps, tuple(waits), leads[0] if leads else 0, upto)


def rows(plan, tuning):
    return dispatch.rows("segments", {"phase": plan.phase, "segments": tuning.persistent.segments}, tuning)


def apply(plan, opts):
    """The plan with its segments (codegen/dispatch.py's segments table: decode, with the knob on; the
    members Tuning.persistent.members names), its arena re-planned; the plan itself where the table says
    a launch per op."""
    if not dispatch.row_range(rows(plan, opts.tuning), "segment"):
        return plan
    segs = find(plan, opts.tuning.persistent.members)
    if not segs:
        return plan
    from .families import segment as family
    first = {s.steps[0]: s for s in segs}
    member = {i: s for s in segs for i in s.steps}
    steps = []
    for i, step in enumerate(plan.steps):
        s = first.get(i)
        if s is not None:
            members = [plan.steps[k] for k in s.steps]
            gate = None if s.upto is None else size_exprs.only_below(s.upto)
            steps.append(family.launch(members, [body(m) for m in members], s.waits, lead=s.lead, gate=gate,
                                       pdl=opts.pdl, ctas=opts.tuning.persistent.ctas_per_sm))
        if i in member:
            if member[i].upto is not None:      # the member's own launch serves the larger T
                above = size_exprs.only_above(member[i].upto)
                steps.append(dataclasses.replace(step, grid=(f"{step.grid[0]} * {above}", *step.grid[1:])))
            continue
        steps.append(step)
    out = dataclasses.replace(plan, steps=steps)
    out.arena = arena_slots(out)
    return out

