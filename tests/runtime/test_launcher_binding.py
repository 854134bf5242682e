"""KernelRunner's launch path on the CPU (runtime/launcher.py, _Bound): what a step's sizes decide
(grid, shared memory, workspaces, size arguments, argument types) is worked out once per launch and
sizes and reused; what changes between steps (tensors, their strides) is fetched at every launch;
bad bindings keep their one-line errors.  The driver is replaced by a recorder (no GPU here)."""
from __future__ import annotations

import ctypes

import pytest
import torch

import runtime.cuda_driver as cd
from codegen import sizes as size_exprs
from codegen.kernel import (Arg, CtxRef, KernelLaunch, SizeRef, StrideRef, ValueRef, WeightRef, Workspace,
                            WorkspaceRef)
from runtime.launcher import KernelRunner, LaunchError

from test_cuda_driver_pdl import DeviceTensor, _Module


def _launch(**over):
    base = dict(family="f", template="t", name="k", params={}, nodes=("n",), grid=("cdiv(T, 4)", "B", 1),
                block=(128, 1, 1), smem="T * 16",
                workspace=(Workspace("part", ("T", 8), "f32"),),
                args=(Arg("x", "const __nv_bfloat16*", ValueRef("x")),
                      Arg("x_s0", "i64", StrideRef("x", 0)),
                      Arg("w", "const __nv_bfloat16*", WeightRef("w")),
                      Arg("pos", "const i64*", CtxRef("positions")),
                      Arg("part", "float*", WorkspaceRef("part")),
                      Arg("T", "int", SizeRef("T")),
                      Arg("NP", "i64", SizeRef("T * 6")),
                      Arg("inv", "float", SizeRef("B"))))
    base.update(over)
    return KernelLaunch(**base)


@pytest.fixture
def recorded(monkeypatch):
    seen = []
    monkeypatch.setattr(cd, "launch_packed", lambda func, grid, block, smem, params, stream=None, *, pdl=False:
                        seen.append(dict(func=func, grid=grid, block=block, smem=smem, params=params,
                                         stream=stream, pdl=pdl)))
    runner = KernelRunner("sm_90")
    loads = []
    monkeypatch.setattr(runner, "module", lambda launch: loads.append(launch.name) or _Module())
    return runner, seen, loads


def _tables(x_stride=64):
    return (dict(values={"x": DeviceTensor(0x1000, (x_stride, 1))}, weights={"w": DeviceTensor(0x2000)},
                 ctx={"positions": DeviceTensor(0x3000)}),
            {"part": DeviceTensor(0x4000)})


def test_each_argument_is_packed_with_its_width_from_the_step(recorded):
    runner, seen, _ = recorded
    tables, ws = _tables()
    runner.run(_launch(), **tables, sizes={"T": 10, "B": 3, "SMS": 132}, workspaces=ws, stream=7)
    (call,) = seen
    assert call["grid"] == (3, 3, 1) and call["block"] == (128, 1, 1) and call["smem"] == 160 and call["stream"] == 7
    values, types = call["params"]
    assert values == (0x1000, 64, 0x2000, 0x3000, 0x4000, 10, 60, 3.0)
    assert types == (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_longlong, ctypes.c_float)


def test_what_the_sizes_decide_is_worked_out_once_and_tensors_are_fetched_every_launch(recorded, monkeypatch):
    runner, seen, loads = recorded
    evaluated = []
    real = size_exprs.evaluate
    monkeypatch.setattr(size_exprs, "evaluate", lambda e, s: evaluated.append(e) or real(e, s))
    launch = _launch()
    for stride in (64, 96):   # a new tensor (other address, other stride) at the same sizes
        tables, ws = _tables(stride)
        tables["values"]["x"].address += stride
        runner.run_all([launch], **tables, sizes={"T": 10, "B": 3, "SMS": 132}, workspaces=ws, stream=7)
    first = len(evaluated)
    assert [c["params"][0][:2] for c in seen] == [(0x1000 + 64, 64), (0x1000 + 96, 96)]
    assert first == 9 and loads == ["k"]      # grid 3 + smem + workspace 2 + size args 3, on the first run only
    runner.run_all([launch], **_tables()[0], sizes={"T": 20, "B": 3, "SMS": 132}, workspaces=ws, stream=7)
    assert seen[-1]["grid"] == (5, 3, 1) and seen[-1]["params"][0][5:] == (20, 120, 3.0)
    # new sizes: worked out again, the function looked up again (the runner keeps its module loaded)
    assert len(evaluated) == 2 * first and loads == ["k", "k"]


def test_workspaces_follow_the_sizes(recorded):
    runner, _, _ = recorded
    tables, _ = _tables()
    tables["ctx"]["host"] = torch.zeros(1)     # workspaces go where the step's tensors are: here the CPU
    for T in (10, 3):
        ws = runner.workspaces(_launch(), **tables, sizes={"T": T, "B": 3})
        assert ws["part"].shape == (T, 8) and ws["part"].dtype == torch.float32
    with pytest.raises(LaunchError, match="argument part is a cpu tensor; kernels need CUDA tensors"):
        runner.run_all([_launch()], **tables, sizes={"T": 10, "B": 3, "SMS": 132}, stream=7)


def test_an_empty_grid_binds_nothing_and_loads_no_module(recorded):
    runner, seen, loads = recorded
    tables, ws = _tables()
    runner.run(_launch(), **tables, sizes={"T": 10, "B": 0, "SMS": 132}, workspaces=ws)
    runner.run(_launch(args=(Arg("x", "const float*", ValueRef("missing")),)), **tables,
               sizes={"T": 0, "B": 3, "SMS": 132}, workspaces=ws)
    assert seen == [] and loads == []


@pytest.mark.parametrize("where, tables_edit, match", [
    ("value", lambda t: t["values"].pop("x"), "argument value x needs value 'x'"),
    ("weight", lambda t: t["weights"].update(w=None), "argument w .*is not given"),
    ("host tensor", lambda t: t["weights"].update(w=torch.zeros(2)), "argument w is a cpu tensor"),
    ("not a tensor", lambda t: t["ctx"].update(positions=[1, 2]), "argument pos .*is a list, not a tensor"),
])
def test_a_bad_binding_is_one_launch_error_naming_the_argument(recorded, where, tables_edit, match):
    runner, seen, _ = recorded
    tables, ws = _tables()
    runner.run(_launch(), **tables, sizes={"T": 10, "B": 3, "SMS": 132}, workspaces=ws)   # bound once, fine
    tables_edit(tables)
    with pytest.raises(LaunchError, match=match):
        runner.run(_launch(), **tables, sizes={"T": 10, "B": 3, "SMS": 132}, workspaces=ws)


def test_a_size_argument_out_of_its_width_fails_at_binding(recorded):
    runner, _, _ = recorded
    tables, ws = _tables()
    with pytest.raises(OverflowError, match="I32"):
        runner.run(_launch(), **tables, sizes={"T": 1 << 31, "B": 3, "SMS": 132}, workspaces=ws)


def test_a_launch_is_worked_out_again_only_when_a_size_it_reads_changes(recorded, monkeypatch):
    runner, seen, _ = recorded
    made = []
    import runtime.launcher as ln
    real = ln._Bound.make
    monkeypatch.setattr(ln._Bound, "make", classmethod(lambda cls, *a, **k: made.append(1) or real(*a, **k)))
    tables, ws = _tables()
    launch = _launch()           # reads T and B (and not the context, nor the SM count)
    for maxctx in (512, 513, 514):   # an eager decode's context grows every step
        runner.run(launch, **tables, sizes={"T": 10, "B": 3, "MAXCTX": maxctx, "SMS": 132}, workspaces=ws)
    assert len(made) == 1 and len(seen) == 3
    runner.run(launch, **tables, sizes={"T": 10, "B": 4, "MAXCTX": 514, "SMS": 132}, workspaces=ws)
    assert len(made) == 2 and seen[-1]["grid"] == (3, 4, 1)


def test_the_caches_start_over_when_full(recorded, monkeypatch):
    import runtime.launcher as ln
    runner, seen, _ = recorded
    monkeypatch.setattr(ln, "_BOUNDS_KEPT", 2)
    tables, ws = _tables()
    launches = [_launch(name=f"k{i}") for i in range(3)]
    for launch in launches:
        runner.run(launch, **tables, sizes={"T": 10, "B": 3, "SMS": 132}, workspaces=ws)
    # the third record found the cache full: it starts over holding that launch alone
    assert len(runner._bounds) == 1 and list(runner._reads) == [id(launches[2])]
    assert [c["grid"] for c in seen] == [(3, 3, 1)] * 3


def test_a_runner_launches_plain_when_its_pdl_is_off(recorded):
    """KernelRunner.pdl False (the bench's own-device-time profile): a launch the record marks as
    programmatic goes out plain; back on, programmatic again."""
    runner, seen, _ = recorded
    tables, ws = _tables()
    launch = _launch(pdl=True)
    for on in (True, False, True):
        runner.pdl = on
        runner.run(launch, **tables, sizes={"T": 10, "B": 3, "SMS": 132}, workspaces=ws, stream=7)
    assert [c["pdl"] for c in seen] == [True, False, True]
