"""The memory plan (codegen/memplan.py): lifetimes read off a lowered phase, and a placement in
which no two slots live at the same node share a byte, for random interval sets and for the
shipped V2-Lite spec, whose peak activation memory it bounds."""
from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.bundle import plan_spec
from codegen.kernel import DEFAULTS, Arg, KernelLaunch, LibraryCall, ValueRef, Workspace
from codegen.memplan import ALIGN, ArenaPlan, Slot, arena_slots, overlaps, place
from codegen.plan import Buffer, NodeInfo, PhasePlan, View
from tiny import ROOT


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@st.composite
def slot_sets(draw):
    n = draw(st.integers(1, 40))
    slots, sizes = [], []
    for i in range(n):
        first = draw(st.integers(0, 30))
        slots.append(Slot(f"v{i}", (1,), "act", first, first + draw(st.integers(0, 12))))
        sizes.append(draw(st.sampled_from([0, 1, 255, 256, 257, 4096, 10_000, 1 << 20])))
    return slots, sizes


@settings(max_examples=300, deadline=None)
@given(slot_sets())
def test_no_two_live_slots_share_a_byte(case):
    slots, sizes = case
    offsets, total = place(slots, sizes)
    assert overlaps(slots, sizes, offsets) is None
    assert all(o % ALIGN == 0 for o in offsets)
    assert all(offsets[k] + _aligned(sizes[k]) <= total for k in range(len(slots)) if sizes[k])
    # at least what is live at the busiest node, at most one buffer each
    busiest = max(sum(_aligned(z) for s, z in zip(slots, sizes) if s.first <= t <= s.last) for t in range(43))
    assert busiest <= total <= sum(_aligned(z) for z in sizes)
    assert place(slots, sizes) == (offsets, total)   # deterministic


def test_overlaps_names_two_live_slots_on_the_same_bytes():
    a, b, c = Slot("a", (1,), "act", 0, 2), Slot("b", (1,), "act", 2, 3), Slot("c", (1,), "act", 3, 4)
    assert overlaps([a, b, c], [512, 512, 512], [0, 256, 0]) == ("a", "b")
    assert overlaps([a, b, c], [512, 512, 512], [0, 512, 0]) is None    # a and c are never live together


def _launch(node: str, values: tuple, workspace=()) -> KernelLaunch:
    return KernelLaunch(family="f", template="f.cu.j2", name=f"k_{node}", params={}, nodes=(node,), grid=(1, 1, 1),
                        block=(32, 1, 1), smem=0, args=tuple(Arg(f"a{i}", "float*", ValueRef(v))
                                                             for i, v in enumerate(values)),
                        workspace=tuple(workspace))


def test_lifetimes_follow_launch_order_views_and_leave_out_inputs_outputs_and_the_cache():
    """ids -> x (n0) -> split views q, k of x (n1) -> attention reads q, k, writes the cache and o,
    with a workspace (n2) -> y (n3) -> logits (n4): x lives until its views' last reader."""
    buffers = {
        "ids": Buffer("ids", ("T",), "i64"), "x": Buffer("x", ("T", 8), "act"),
        "q": Buffer("q", ("T", 4), "act", view=View("x", 0, (8, 1))),
        "k": Buffer("k", ("T", 4), "act", view=View("x", 4, (8, 1))),
        "cache": Buffer("cache", ("cache",), "state", layer=0), "o": Buffer("o", ("T", 4), "act"),
        "y": Buffer("y", ("T", 8), "f32"), "logits": Buffer("logits", ("T", 5), "act"),
    }
    split = LibraryCall(node="n1", op="split", call="view", inputs=("x",), outputs=("q", "k"), weights=(), attrs={})
    steps = [_launch("n0", ("ids", "x")), split,
             _launch("n2", ("q", "k", "o"), [Workspace("part", ("T", 16), "f32")]),
             _launch("n2", ("o",), [Workspace("part", ("T", 16), "f32")]),
             _launch("n3", ("o", "y")), _launch("n4", ("y", "logits"))]
    nodes = {"n0": NodeInfo(None, ("x",)), "n1": NodeInfo(None, ("q", "k")), "n2": NodeInfo(0, ("o",)),
             "n3": NodeInfo(None, ("y",)), "n4": NodeInfo(None, ("logits",))}
    plan = PhasePlan("prefill", steps=steps, buffers=buffers, nodes=nodes, inputs=("ids",), outputs=("logits",))
    got = {s.name: (s.first, s.last, s.shape, s.dtype) for s in arena_slots(plan)}
    assert got == {"x": (0, 2, ("T", 8), "act"), "n2/part": (2, 2, ("T", 16), "f32"),
                   "o": (2, 3, ("T", 4), "act"), "y": (3, 4, ("T", 8), "f32")}
    arena = ArenaPlan(arena_slots(plan))
    placed = arena.layout({"T": 3}, 2)
    assert placed.nbytes == {"x": 48, "n2/part": 192, "o": 24, "y": 96}
    assert placed.offsets["y"] in (placed.offsets["x"], placed.offsets["n2/part"])   # x and the workspace are dead


@functools.lru_cache(maxsize=None)
def _lite():
    return plan_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml"), DEFAULTS)


def _prefill_sizes(T: int) -> dict:
    return {"T": T, "NP": 8 * T, "B": 1, "MAXQ": T, "MAXCTX": T, "TK": T, "W": -(-T // 64), "SMS": 132}


def test_v2_lite_prefill_activations_fit_the_targets():
    """bf16 DeepSeek-V2-Lite: a 2048-token prefill step's planned activations <= 1.2 GB (one buffer
    per value took 5.5 GB) and a 16,384-token step's <= 6 GB; no two live slots overlap."""
    plan = _lite().plans["prefill"]
    arena = ArenaPlan(plan.arena)
    for T, bound in ((2048, 1.2e9), (16384, 6e9)):
        placed = arena.layout(_prefill_sizes(T), 2)
        assert placed.total <= bound, (T, placed.total)
        assert arena.unplanned_bytes(_prefill_sizes(T), 2) > 4 * placed.total
        names = [s.name for s in arena.slots]
        assert overlaps(arena.slots, [placed.nbytes[n] for n in names], [placed.offsets[n] for n in names]) is None


def test_a_chunk_over_a_cached_prefix_plans_its_context_rows_by_TK():
    """Chunked prefill: the context gather's rows [TK, C + R] and their decompressed keys and values
    [TK, H * (N + V)] are arena slots sized by TK (the step's context rows), not T: an 8192-token
    chunk behind a 24,576-token prefix plans the 32,768 rows its attention reads, still no two
    live slots overlap, and the plan stays within the 16k-token step's 6 GB target (at this shape the
    MoE's 8192-token intermediates still set the peak)."""
    plan = _lite().plans["prefill"]
    arena = ArenaPlan(plan.arena)
    rows = [s for s in arena.slots if s.name.endswith("ctx_rows")]
    kv = [s for s in arena.slots if s.name.endswith(".mla.kv")]
    assert len(rows) == len(kv) == 27
    assert {s.shape for s in rows} == {("TK", 576)} and {s.shape for s in kv} == {("TK", 16 * 256)}
    chunk = {**_prefill_sizes(8192), "MAXCTX": 32768, "TK": 32768, "W": 512}
    placed = arena.layout(chunk, 2)
    assert placed.nbytes[rows[0].name] == 32768 * 576 * 2 and placed.nbytes[kv[0].name] == 32768 * 4096 * 2
    assert placed.total <= 6e9, placed.total
    names = [s.name for s in arena.slots]
    assert overlaps(arena.slots, [placed.nbytes[n] for n in names], [placed.offsets[n] for n in names]) is None
