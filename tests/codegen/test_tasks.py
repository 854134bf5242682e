"""The decode task graph (codegen/tasks.py), checked by codegen/taskcheck.py's own bookkeeping:
acyclic, every read and write ordered after what the launch order puts before it (arena bytes
shared by values included), no stale read in random topological orders, and a dropped wait caught."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from codegen.bundle import plan_spec
from codegen.kernel import Options
from codegen.memplan import step_sizes
from codegen.tasks import Region, Tiling, build_task_graph
from codegen.taskcheck import cycle, problems, simulate, topological_order

from tiny import tiny_spec_text

SPECS = ("model_specs/deepseek_v2_lite.yaml", "tiny")


@functools.lru_cache(maxsize=None)
def decode_plan(spec: str):
    if spec == "tiny":
        import ir
        spec = ir.parse_spec(tiny_spec_text(), "tiny.yaml")
    return plan_spec(spec, Options(), strict=False).plans["decode"]


@functools.lru_cache(maxsize=None)
def graph_of(spec: str, batch: int):
    g = build_task_graph(decode_plan(spec), batch)
    return g, g.tiling


# tiny at 1 token (down's one-token launch), 3 (skinny wgmma experts), 8 (fused experts) and 32 (library
# linears, the separate cache write); V2-Lite at batch 1 for the shipped plan (about 20k tasks: slow
# in Python, so only the ancestry check)
CASES = [("tiny", 1), ("tiny", 3), ("tiny", 8), ("tiny", 32)]


@pytest.mark.parametrize("spec,batch", CASES + [("model_specs/deepseek_v2_lite.yaml", 1)])
def test_graph_is_acyclic_and_orders_every_access(spec, batch):
    g, tiling = graph_of(spec, batch)
    assert g.tasks and cycle(g) is None
    assert all(d < t.id for t in g.tasks for d in t.deps)      # the launch order is one topological order
    assert problems(g, tiling) == []


@pytest.mark.parametrize("spec,batch", CASES)
def test_random_orders_never_read_stale_data(spec, batch):
    g, tiling = graph_of(spec, batch)
    rng = random.Random(batch)
    for order in (topological_order(g, latest_first=True), topological_order(g, rng), topological_order(g, rng)):
        assert simulate(g, tiling, order) == []


def test_a_step_in_plan_order_is_the_reference():
    g, tiling = graph_of("tiny", 3)
    assert simulate(g, tiling, list(range(len(g.tasks)))) == []
    assert simulate(g, tiling, list(range(len(g.tasks) - 1))) != []


def _essential(g):
    """(task, dep) pairs whose edge is the only path from dep to task."""
    for t in g.tasks:
        for d in t.deps:
            others, seen = [x for x in t.deps if x != d], set()
            while others:
                x = others.pop()
                if x in seen or x < d:
                    continue
                seen.add(x)
                others.extend(g.tasks[x].deps)
            if d not in seen:
                yield t.id, d


@pytest.mark.parametrize("spec,batch", [("tiny", 1), ("tiny", 3)])
def test_a_dropped_dependency_is_caught(spec, batch):
    g, tiling = graph_of(spec, batch)
    pairs = list(_essential(g))
    assert pairs
    rng = random.Random(7)
    for t, d in rng.sample(pairs, min(6, len(pairs))):
        saved = g.tasks[t].deps
        g.tasks[t].deps = tuple(x for x in saved if x != d)
        try:
            assert any(f"task {t} " in p and f"task {d} " in p for p in problems(g, tiling)), (t, d)
            assert simulate(g, tiling, topological_order(g, latest_first=True)) != [] or \
                simulate(g, tiling, _run_early(g, t, d)) != []
        finally:
            g.tasks[t].deps = saved


def _run_early(g, t, d):
    """A topological order (without the dropped edge) that runs t before d where the edges allow."""
    order = topological_order(g, latest_first=True)
    pos = {x: i for i, x in enumerate(order)}
    return sorted(order, key=lambda x: (pos[x] if x != d else len(order)))


def test_arena_sharing_is_ordered():
    """Two values of different layers placed at the same arena bytes: the later writer waits for
    the earlier value's last reader (write-after-read through the memory plan)."""
    g, tiling = graph_of("tiny", 1)
    found = 0
    for t in g.tasks:
        for reg in t.writes:
            for space, lo, hi in tiling.intervals(reg):
                if space != "arena":
                    continue
                # an earlier task that read these bytes as another value
                for u in g.tasks[:t.id]:
                    if any(r.value != reg.value and any(s == space and a < hi and lo < b
                                                        for s, a, b in tiling.intervals(r)) for r in u.reads):
                        found += 1
                        break
                break
        if found > 3:
            break
    assert found > 3   # the tiny plan does share bytes; problems() == [] above covers their order


@pytest.mark.parametrize("batch", [1, 5])
def test_intervals_are_the_bytes_a_strided_view_touches(batch):
    """Tiling.intervals against torch's own strides: every value and view of the tiny plan, a box of it."""
    plan = decode_plan("tiny")
    tiling = Tiling(plan, step_sizes("decode", batch, plan, context=64, sms=132))
    rng = random.Random(batch)
    checked = 0
    for name, buf in plan.buffers.items():
        if buf.dtype in ("state", "routing"):
            continue
        shape = tiling.shape(name)
        if 0 in shape:
            continue
        space, base, strides, isz = tiling._storage(name)
        box = tuple(sorted(rng.sample(range(n + 1), 2)) if n > 1 else (0, n) for n in shape)
        span = base + isz * (1 + sum((n - 1) * s for n, s in zip(shape, strides)))
        offs = torch.as_strided(torch.arange(span), shape, strides)   # element offsets from the base
        want = torch.zeros(span, dtype=torch.bool)
        for o in offs[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1).tolist():
            want[base + o * isz: base + (o + 1) * isz] = True
        got = torch.zeros(span, dtype=torch.bool)
        for sp, lo, hi in tiling.intervals(Region(name, box)):
            assert sp == space
            got[lo:hi] = True
        assert torch.equal(got, want), name
        checked += 1
    assert checked > 10


def test_json_is_stable_and_says_what_the_graph_holds():
    import json
    g, _ = graph_of("tiny", 3)
    text = g.to_json()
    assert text == build_task_graph(decode_plan("tiny"), 3).to_json()
    data = json.loads(text)
    assert data["graph"] == {"batch": 3, "context": g.context, "sms": g.sms}
    assert len(data["ops"]) == len(g.ops) and len(data["tasks"]) == len(g.tasks)
    for t, d in zip(g.tasks, data["tasks"]):    # the waits name exactly the dependencies
        named = set()
        for op, tiles in d["waits"]:
            o = g.ops[op]
            named.update(range(o.first, o.first + o.count) if tiles == "all" else (o.first + i for i in tiles))
        assert named == set(t.deps)


def test_explain_tasks_summarises_each_batch(tmp_path, capsys):
    from runtime.cli import main
    from tiny import write_tiny_spec
    assert main(["explain", str(write_tiny_spec(tmp_path / "tiny.yaml")), "--tasks", "--batch", "1,3"]) == 0
    out = capsys.readouterr().out
    g1, g3 = graph_of("tiny", 1)[0].summary(), graph_of("tiny", 3)[0].summary()
    for b, s in ((1, g1), (3, g3)):
        assert (f"decode, batch {b} (context 512, 132 SMs): {s['tasks']} tasks in {s['ops']} launches, "
                f"{s['deps']} dependencies ({s['waits']} counter waits), critical path {s['critical_path']} tasks, "
                f"widest level {s['widest_level']} tasks") in out
    assert "linear_skinny.multi_linear (declared)" in out and "moe_route.fused (coarse)" in out


def test_explain_tasks_refuses_a_bad_batch_in_one_line(capsys):
    from runtime.cli import main
    with pytest.raises(SystemExit):
        main(["explain", "--tasks", "--batch", "0"])
    err = capsys.readouterr().err
    assert "token counts must be whole numbers >= 1" in err and "Traceback" not in err


def _merged(ivs):
    out = []
    for space, lo, hi in sorted(ivs):
        if out and out[-1][0] == space and lo <= out[-1][2]:
            out[-1][2] = max(out[-1][2], hi)
        else:
            out.append([space, lo, hi])
    return [tuple(x) for x in out]


def _within(inner, outer) -> bool:
    outer = _merged(outer)
    return all(any(s == space and a <= lo and hi <= b for s, a, b in outer) for space, lo, hi in _merged(inner))


@pytest.mark.parametrize("spec,batch", CASES + [("model_specs/deepseek_v2_lite.yaml", 1),
                                               ("model_specs/deepseek_v2_lite.yaml", 8)])
def test_declared_tiles_partition_what_the_launch_writes(spec, batch):
    g, tiling = graph_of(spec, batch)
    assert _partition_problems(g, tiling, decode_plan(spec)) == []


def test_a_tile_that_misses_a_column_is_caught(monkeypatch):
    from codegen.families import mla_v_up
    real = mla_v_up.tasks

    def short(launch, tiling):
        tiles = real(launch, tiling)
        t = tiles[-1]
        (reg,) = t.writes
        lo, hi = reg.box[-1]
        return tiles[:-1] + [tiling.tile(t.label, t.reads, [tiling.cols(reg.value, lo, hi - 1)])]
    monkeypatch.setattr(mla_v_up, "tasks", short)
    g = build_task_graph(decode_plan("tiny"), 1)
    assert any("mla_v_up" in p and "unwritten" in p for p in _partition_problems(g, g.tiling, decode_plan("tiny")))


def _partition_problems(g, tiling, plan) -> list:
    """A family's tiles against the whole launch (every pointer read, every non-const one written):
    tiles write disjoint bytes, read and write nothing the launch is not passed, and together write
    all of it -- but the cache, where only the new rows are written, and values a sibling launch of
    the same node writes at these sizes (the query's cache-write row when the cache write runs apart)."""
    from codegen.kernel import KernelLaunch
    from codegen.tasks import coarse_tile
    out = []
    caches = set(tiling.caches.values())

    def ivs(regions):
        return [iv for r in regions for iv in tiling.intervals(r)]

    declared = 0
    for o in g.ops:
        if o.tiling != "declared":
            continue
        step = plan.steps[o.step]
        whole = coarse_tile(step, tiling)
        tasks = g.tasks[o.first:o.first + o.count]
        writes = [ivs(t.writes) for t in tasks]
        flat = sorted(iv for w in writes for iv in _merged(w))
        if not all(a[0] != b[0] or b[1] >= a[2] for a, b in zip(flat, flat[1:])):
            out.append(f"{o.kernel}: tiles overlap")
        if not _within(flat, ivs(whole.writes)):
            out.append(f"{o.kernel}: tiles write what the launch is not passed")
        if not _within([iv for t in tasks for iv in ivs(t.reads)], ivs(whole.reads)):
            out.append(f"{o.kernel}: tiles read what the launch is not passed")
        siblings = {v for p in g.ops if p is not o and p.node == o.node
                    and isinstance(plan.steps[p.step], KernelLaunch)
                    for v, w in tiling.pointers(plan.steps[p.step]) if w}
        must = [r for r in whole.writes if r.value not in caches and r.value not in siblings]
        if not _within(ivs(must), flat):
            out.append(f"{o.kernel}: tiles leave bytes of {[r.value for r in must]} unwritten")
        declared += 1
    return out if declared else ["no declared tiling"]


@functools.lru_cache(maxsize=None)
def _quantised_plan(kind: str):
    """The tiny decode plan with DeepSeek-V3's FP8 weights on sm_90a (FP8 skinny linears, the FP8 GEMM's
    quantiser and wgmma above 16 tokens, FP8 kv_b in the query / v_up, FP8 experts), or with msModelSlim's
    int8 linears (the int8 quantiser's and kernel's launches over their workspaces)."""
    import ir
    if kind == "fp8":
        from ir.formats import FP8, FP8_CHECKPOINT_GLOBS, weight_formats_yaml
        spec = ir.parse_spec(tiny_spec_text() + weight_formats_yaml(FP8_CHECKPOINT_GLOBS, FP8), "tiny_fp8.yaml")
        return plan_spec(spec, Options(arch="sm_90a"), strict=True).plans["decode"]
    from test_linear_int8 import _int8_spec_text
    return plan_spec(ir.parse_spec(_int8_spec_text(), "tiny_int8.yaml"), Options(), strict=True).plans["decode"]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("batch", [1, 32])
def test_quantised_plans_give_ordered_graphs_and_partitioning_tiles(kind, batch):
    plan = _quantised_plan(kind)
    names = [getattr(s, "name", "") for s in plan.steps]
    assert any(("gemm_fp8__" if kind == "fp8" else "_wi8__") in n for n in names)
    g = build_task_graph(plan, batch)
    assert problems(g, g.tiling) == []
    assert _partition_problems(g, g.tiling, plan) == []
