"""The decode GEMV family: lowers every activation-precision linear to a GEMV launch (empty grid
above 8 tokens) plus a guarded library call; renders deterministically; compiles for every dtype."""
from __future__ import annotations

import pytest

import ir
from codegen import sizes
from codegen.kernel import KernelLaunch, LibraryCall, Options
from codegen.lower import lower_graph
from codegen.nvrtc import compile_cubin
from codegen.render import render
from ir.passes import run_pipeline
from tiny import ROOT


@pytest.fixture(scope="module")
def decode_graph():
    return run_pipeline(ir.build_graph(ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")), "decode"))


def test_each_linear_is_a_gemv_and_a_guarded_library_call(decode_graph):
    plan = lower_graph(decode_graph, Options())
    linears = [n for n, d in decode_graph.nodes(data=True) if d["op"] == "linear"]
    for nid in linears:
        steps = [s for s in plan.steps if (s.nodes[0] if isinstance(s, KernelLaunch) else s.node) == nid]
        gemv, lib = steps
        assert isinstance(gemv, KernelLaunch) and gemv.family == "linear"
        assert isinstance(lib, LibraryCall) and lib.call == "torch.nn.functional.linear"
        for T in (1, 2, 8, 9, 16, 512):
            runs_gemv = sizes.evaluate(gemv.grid[1], {"T": T}) > 0
            runs_lib = sizes.evaluate(lib.when, {"T": T}) > 0
            assert runs_gemv != runs_lib and runs_gemv == (T <= 8)


def test_fp32_linear_stays_on_the_library():
    from harness import single_op_graph, tiny_model
    from ir.ops import TType
    G, nid = single_op_graph(tiny_model(), "linear", {"out_dim": 12, "precision": "fp32"},
                             {"x": TType(("T", 40), "act")}, {"weight": "router"})
    plan = lower_graph(G, Options())
    assert not plan.launches
    (lib,) = plan.library_calls
    assert lib.when is None and lib.attrs["precision"] == "fp32"


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_renders_deterministically_and_compiles(decode_graph, dtype):
    plan = lower_graph(decode_graph, Options(dtype=dtype))
    seen = {}
    for launch in plan.launches:
        if launch.family == "linear":
            seen[launch.name] = launch
    assert len(seen) >= 6
    for launch in seen.values():
        src = render(launch.template, launch.params, launch.nodes, launch.name)
        assert src == render(launch.template, launch.params, launch.nodes, launch.name)
        assert compile_cubin(src, launch.name, arch="sm_90").cubin[:4] == b"\x7fELF"
