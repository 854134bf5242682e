"""Persistent decode segments (codegen/segments.py): which runs of launches become segments, their
token ranges and waits, and that the waits order every access.

The waits are checked against codegen/tasks.py's tile-level graph, built on the step as it runs with
segments: the plan's own launches over the segmented plan's arena (the segment's step makes its
members' values live together, so the memory plan changes).  Every dependency of a member's task
must be before the segment or in a member it waits for, and codegen/taskcheck.py's simulation of any
order the waits allow (Hypothesis draws them) reads no stale byte; a segment with one wait dropped
reads one."""
from __future__ import annotations

import dataclasses
import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen import segments
from codegen import sizes as size_exprs
from codegen.bundle import plan_spec
from codegen.kernel import CtxRef, KernelLaunch, LibraryCall, Options, inp, out, size, weight, Arg
from codegen.memplan import step_sizes
from codegen.plan import NodeInfo, PhasePlan
from codegen.tasks import build_task_graph
from codegen.taskcheck import simulate
from codegen.tuning import parse_tune

from tiny import tiny_spec_text

LITE = "model_specs/deepseek_v2_lite.yaml"
ON = parse_tune(["persistent.segments=true"])


@functools.lru_cache(maxsize=None)
def plans(spec: str, dtype: str = "bf16"):
    """(the decode plan with segments, without); "tiny", "lite_widths": the GPU tests' tiny models."""
    if spec in ("tiny", "lite_widths"):
        import ir
        from test_kernels_persistent import LITE_WIDTHS
        spec = ir.parse_spec(tiny_spec_text(**(LITE_WIDTHS if spec == "lite_widths" else {})), "tiny.yaml")
    return tuple(plan_spec(spec, Options(dtype=dtype, tuning=t), strict=False).plans["decode"] for t in (ON, Options().tuning))


def _launches_at(plan, T: int) -> list:
    sizes = step_sizes("decode", T, plan, context=512, sms=132)
    return [s for s in plan.launches if all(size_exprs.evaluate(g, sizes) > 0 for g in s.grid)]


# -- formation ---------------------------------------------------------------------------------

def test_v2_lite_b1_runs_its_norms_and_skinny_linears_as_segments():
    seg, plain = plans(LITE)
    found = segments.find(plain)
    # layer 0: rms_norm + q; v_up, o, the norm, the dense MLP's two linears, layer 1's norm and q; each
    # MoE layer's v_up, o and norm (its route ends the run); each MoE layer's combine + norm and the next
    # layer's q (the last one's: the lm head)
    assert sorted(len(s.steps) for s in found) == [2] * 27 + [3] * 26 + [7]
    assert all(s.upto == 16 for s in found)      # the skinny linears' range (linear.skinny_upto)
    for s in found:
        assert list(s.steps) == sorted(s.steps) and all(segments.body(plain.steps[i]) for i in s.steps)
        assert all(w < j for j, ws in enumerate(s.waits) for w in ws)
    assert len(_launches_at(plain, 1)) == 272 and len(_launches_at(seg, 1)) == 187
    # above the skinny range every member runs its own launch again, and no segment runs
    assert [s.name for s in _launches_at(seg, 17)] == [s.name for s in _launches_at(plain, 17)]
    assert sum(s.family == "segment" for s in _launches_at(seg, 16)) == 54


def test_a_moe_layers_combine_norm_joins_the_next_layers_q():
    """moe_combine_residual_rms_norm's body: the combine + norm of token t, then the q projection that
    reads its h; the last layer's joins the lm head."""
    _, plain = plans(LITE)
    pairs = [[plain.steps[i] for i in s.steps] for s in segments.find(plain)
             if plain.steps[s.steps[0]].family == "moe_combine_residual_rms_norm"]
    assert len(pairs) == 26
    for combine, reader in pairs:
        assert segments.body(combine) == {"kind": "combine_norm", "D": 2048, "K": 8, "S": 2,
                                          "eps": combine.params["eps"]}
        assert reader.family == "linear_skinny"
        h = next(a.ref.name for a in combine.args if a.name == "h")
        assert any(a.name == "x" and a.ref.name == h for a in reader.args)
    assert [r.nodes for _, r in pairs][-1] == ("head.logits",)
    (s,) = {s.waits for s in segments.find(plain) if plain.steps[s.steps[0]] is pairs[0][0]}
    assert s == ((), (0,))


def test_the_gpu_engine_tests_v2_lite_widths_model_has_the_new_members():
    """tests/gpu/test_kernels_persistent.py's engine test at V2-Lite's widths runs every body V2-Lite's
    decode step does."""
    seg, _ = plans("lite_widths")
    kinds = {m["kind"] for s in seg.launches if s.family == "segment" for m in s.params["members"]}
    lite, _ = plans(LITE)
    assert kinds == {m["kind"] for s in lite.launches if s.family == "segment" for m in s.params["members"]}


def test_v_up_joins_o_projs_run_its_3d_grid_as_one_task_index():
    """mla_v_up's body takes its grid (token chunks, heads, row blocks) as one index: its tasks are the
    grid's CTAs, and o_proj, which reads its output, waits for all of them."""
    from codegen.families import segment as family
    _, plain = plans(LITE)
    found = [s for s in segments.find(plain) if plain.steps[s.steps[0]].family == "mla_v_up"]
    assert len(found) == 27
    for s in found:
        v_up, o = plain.steps[s.steps[0]], plain.steps[s.steps[1]]
        assert segments.body(v_up)["grid_yz"] == [16, 4] and s.waits[1] == (0,)
        assert family.member_tasks(v_up) == f"({v_up.grid[0]}) * 64"
        assert [size_exprs.evaluate(family.member_tasks(v_up), {"T": T}) for T in (1, 32, 33)] == [64, 64, 128]
        out_ = next(a.ref.name for a in v_up.args if a.name == "out")
        assert any(a.name == "x" and a.ref.name == out_ for a in o.args)
    seg, _ = plans(LITE)
    launch = next(x for x in seg.launches if x.family == "segment" and x.params["members"][0]["kind"] == "v_up")
    assert launch.params["smem_floats"] == 34816 // 4        # AbsorbVUp::SMEM at V2-Lite's widths


def test_a_launch_with_a_3d_grid_is_a_member_only_where_its_body_takes_that_grid():
    from codegen.families import mla_v_up
    _, plain = plans(LITE)
    v_up = next(s for s in plain.launches if s.family == "mla_v_up")
    assert segments.body(v_up) is not None
    assert segments.body(dataclasses.replace(v_up, grid=(v_up.grid[0], 16, 8)))["grid_yz"] == [16, 8]
    assert segments.body(dataclasses.replace(v_up, params={**v_up.params, "fp8": True})) is None
    assert mla_v_up.segment_body(dataclasses.replace(v_up, params={**v_up.params, "mma": False})) is None
    norm = next(s for s in plain.launches if s.family == "rms_norm")
    assert segments.body(dataclasses.replace(norm, grid=("T", 2, 1))) is None


def test_a_norm_that_writes_quantised_rows_is_no_member():
    """A norm with int8 or e4m3 rows for its readers (norm_quant.cuh) writes more than its body does."""
    _, plain = plans(LITE)
    for family in ("rms_norm", "fused_add_rms_norm", "moe_combine_residual_rms_norm"):
        norm = next(s for s in plain.launches if s.family == family)
        assert segments.body(norm) is not None
        for key in ("quant_i8", "quant_f8"):
            quant = dataclasses.replace(norm, params={**norm.params, key: {"qrow": 2048}})
            assert segments.body(quant) is None


def test_members_level_1_keeps_the_norms_and_skinny_linears_alone():
    """Tuning.persistent.members=1: the segments PERF_NOTES v43 measured (28 launches at b=1, 272 -> 240),
    for an A/B of the combine and v_up members on the GPU."""
    _, plain = plans(LITE)
    found = segments.find(plain, 1)
    assert sorted(len(s.steps) for s in found) == [2] * 27 + [6]
    kinds = {segments.body(plain.steps[i])["kind"] for s in found for i in s.steps}
    assert kinds == {"rms_norm", "add_rms_norm", "linear"}
    one = segments.apply(plain, Options(tuning=parse_tune(["persistent.segments=true", "persistent.members=1"])))
    assert len(_launches_at(one, 1)) == 240
    assert segments.body(next(s for s in plain.launches if s.family == "mla_v_up"), 1) is None


def test_segments_are_off_by_default_and_at_prefill():
    seg, plain = plans(LITE)
    assert not any(s.family == "segment" for s in plain.launches)
    assert segments.apply(plain, Options()) is plain
    prefill = dataclasses.replace(plain, phase="prefill")
    assert segments.apply(prefill, Options(tuning=ON)) is prefill


def test_a_segment_launch_carries_every_members_arguments_and_nodes():
    seg, plain = plans(LITE)
    launch = next(s for s in seg.launches if s.family == "segment" and len(s.params["members"]) == 7)
    members = [plain.steps[i] for i in next(s for s in segments.find(plain) if len(s.steps) == 7).steps]
    assert [m["kernel"] for m in launch.params["members"]] == [m.name for m in members]
    assert {a.name for a in launch.args} == {f"m{j}_{a.name}" for j, m in enumerate(members) for a in m.args} | \
        {f"m{j}_tasks" for j in range(len(members))}
    assert set(launch.nodes) == {n for m in members for n in m.nodes}
    assert launch.pdl and launch.block == members[0].block


def test_a_segmented_plan_round_trips_through_the_manifest():
    """A bundle records the segment launches as any step (what the runtime runs without the compiler)."""
    import json
    from codegen.manifest import phase_from_json, phase_to_json
    seg, _ = plans(LITE)
    written = json.loads(json.dumps(phase_to_json(seg)))
    assert phase_to_json(phase_from_json("decode", written)) == written
    assert sum(s["family"] == "segment" for s in written["steps"] if s["type"] == "kernel") == 54


def _fake(name: str, node: str, *, kv: bool = False, block: int = 256) -> KernelLaunch:
    args = (inp("x", "float", f"{node}.in"), weight("w", "float", f"{node}.w"), out("out", "float", f"{node}.out"),
            size("T", "T"))
    if kv:
        args += (Arg("cache", "float*", CtxRef("kv_cache")),)
    return KernelLaunch(family="rms_norm", template="rms_norm.cu.j2", name=name, params={"N": 64, "eps": "1e-6f",
                        "act": "float", "threads": block}, nodes=(node,), grid=("T", 1, 1), block=(block, 1, 1),
                        args=args)


def _fake_plan(steps, layers) -> PhasePlan:
    plan = PhasePlan("decode", steps=list(steps))
    plan.nodes = {s.nodes[0] if isinstance(s, KernelLaunch) else s.node: NodeInfo(layers.get(n, 0), ())
                  for s in steps for n in ((s.nodes[0],) if isinstance(s, KernelLaunch) else (s.node,))}
    return plan


def test_the_member_that_binds_a_cache_leads_and_another_layers_cache_ends_the_run():
    a, b, c, d = (_fake("k_a", "a"), _fake("k_b", "b", kv=True), _fake("k_c", "c", kv=True), _fake("k_d", "d"))
    plan = _fake_plan([a, b, c, d], {"a": 3, "b": 3, "c": 4, "d": 4})
    found = segments.find(plan)
    assert [s.steps for s in found] == [(0, 1), (2, 3)]     # c binds layer 4's cache: a new segment
    assert [s.lead for s in found] == [1, 0]
    from codegen.families import segment as family
    s = found[0]
    launch = family.launch([a, b], [segments.body(a), segments.body(b)], s.waits, lead=s.lead, gate=None, pdl=True)
    assert launch.nodes[0] == "b"                           # the runtime binds the lead's layer's cache


def test_runs_end_at_work_and_pass_views_and_calls_that_do_not_run_there():
    a, b, c = _fake("k_a", "a"), _fake("k_b", "b"), _fake("k_c", "c", block=128)
    view = LibraryCall("v", "split", "view", ("a.out",), ("v.out",))
    later = LibraryCall("l", "linear", "torch.nn.functional.linear", ("a.out",), ("l.out",), from_tokens=9)
    always = LibraryCall("m", "linear", "torch.nn.functional.linear", ("a.out",), ("m.out",))
    assert [(s.steps, s.upto) for s in segments.find(_fake_plan([a, view, later, b], {}))] == [((0, 3), 8)]
    assert segments.find(_fake_plan([a, always, b], {})) == []
    assert segments.find(_fake_plan([a, c], {})) == []      # block sizes differ


def test_waits_follow_the_values_and_drop_implied_ones():
    a = _fake("k_a", "a")
    b = dataclasses.replace(_fake("k_b", "b"), args=(inp("x", "float", "a.out"), out("out", "float", "b.out")))
    c = dataclasses.replace(_fake("k_c", "c"), args=(inp("x", "float", "a.out"), inp("y", "float", "b.out"),
                                                     out("out", "float", "c.out")))
    d = dataclasses.replace(_fake("k_d", "d"), args=(inp("x", "float", "z"), out("out", "float", "d.out")))
    (s,) = segments.find(_fake_plan([a, b, c, d], {}))
    assert s.waits == ((), (0,), (1,), ())                  # c's wait on a is implied by b's


# -- the waits against the task graph ----------------------------------------------------------

@functools.lru_cache(maxsize=None)
def graph(spec: str, batch: int):
    """The task graph of the step as it runs with segments, and the segments by graph op."""
    seg, plain = plans(spec)
    g = build_task_graph(dataclasses.replace(plain, arena=seg.arena), batch)
    op_of = {o.step: k for k, o in enumerate(g.ops)}
    by_op = [([op_of[i] for i in s.steps], s.waits) for s in segments.find(plain)
             if s.upto is None or batch <= s.upto]
    return g, by_op


def _closure(waits) -> list[set]:
    after: list[set] = []
    for ws in waits:
        after.append(set(ws).union(*(after[w] for w in ws)) if ws else set())
    return after


@pytest.mark.slow
@pytest.mark.parametrize("spec,batch", [(LITE, 1), ("tiny", 3)])
def test_every_dependency_of_a_member_is_before_the_segment_or_waited_for(spec, batch):
    g, by_op = graph(spec, batch)
    assert by_op
    for ops, waits in by_op:
        after = _closure(waits)
        for j, op in enumerate(ops):
            o = g.ops[op]
            for t in g.tasks[o.first:o.first + o.count]:
                for d in t.deps:
                    dop = g.tasks[d].op
                    assert dop < ops[0] or (dop in ops and ops.index(dop) in after[j]), (o.kernel, g.ops[dop].kernel)


def segment_order(g, by_op, rng: random.Random, drop: tuple | None = None) -> list[int]:
    """The tasks in plan order, each segment's in a random order its waits allow (`drop`: (segment,
    member) whose waits are left out)."""
    first = {ops[0]: k for k, (ops, _) in enumerate(by_op)}
    inside = {op for ops, _ in by_op for op in ops}
    order = []
    for op, o in enumerate(g.ops):
        if op in first:
            k = first[op]
            ops, waits = by_op[k]
            waits = [() if drop == (k, j) else w for j, w in enumerate(waits)]
            left = {j: list(range(g.ops[x].first, g.ops[x].first + g.ops[x].count)) for j, x in enumerate(ops)}
            while any(left.values()):
                ready = [j for j in left if left[j] and not any(left[w] for w in waits[j])]
                j = rng.choice(ready)
                order.append(left[j].pop(rng.randrange(len(left[j]))))
        elif op not in inside:
            order += range(o.first, o.first + o.count)
    return order


@settings(max_examples=8, deadline=None)
@given(batch=st.sampled_from([1, 3, 16]), seed=st.randoms(use_true_random=False))
def test_any_order_the_waits_allow_reads_what_the_kernel_per_op_step_reads(batch, seed):
    g, by_op = graph("tiny", batch)
    assert by_op and any(w for _, waits in by_op for w in waits)
    order = segment_order(g, by_op, seed)
    assert sorted(order) == list(range(len(g.tasks)))
    assert simulate(g, g.tiling, order) == []


def test_a_segment_without_one_wait_reads_stale_data():
    g, by_op = graph("tiny", 3)
    k, j = next((k, j) for k, (_, waits) in enumerate(by_op) for j, w in enumerate(waits) if w)
    rng = random.Random(5)
    assert any(simulate(g, g.tiling, segment_order(g, by_op, rng, drop=(k, j))) for _ in range(8))


def _first_segment_of(g, by_op, family: str) -> int:
    return next(k for k, (ops, _) in enumerate(by_op) if g.ops[ops[0]].kernel.startswith(family))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["moe_combine_residual_rms_norm", "mla_v_up"])
def test_v2_lite_b1_member_orders_read_what_the_per_op_step_reads_and_its_wait_matters(family):
    """The members with V2-Lite-only shapes (the tiny model's rows are too narrow for the block size
    of the skinny linears): any order the waits allow is clean, one without the member's wait is not."""
    g, by_op = graph(LITE, 1)
    k = _first_segment_of(g, by_op, family)
    j = next(j for j, w in enumerate(by_op[k][1]) if w)
    rng = random.Random(3)
    assert all(simulate(g, g.tiling, segment_order(g, by_op, rng)) == [] for _ in range(2))
    assert any(simulate(g, g.tiling, segment_order(g, by_op, rng, drop=(k, j))) for _ in range(8))


@pytest.mark.slow
def test_explain_shows_the_segments_and_the_launches_they_save():
    from runtime.cli_explain import explain_lines
    lines = explain_lines(LITE, tokens=[1, 17], phases=("decode",), tuning=ON)
    found = [line.strip() for line in lines if line.strip().startswith("segments:")]
    assert found == ["segments: 54 persistent launches run 139 members' tiles: 272 launches -> 187"]
    assert any("segment [tokens 1..inf]" in line for line in lines)
    assert not any("segments:" in line for line in explain_lines(LITE, tokens=[1], phases=("decode",)))
