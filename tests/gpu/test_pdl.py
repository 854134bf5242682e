"""Programmatic dependent launch on the GPU: generated kernels that read each other's outputs,
launched back to back as PDL launches (eagerly, and replayed from a captured CUDA graph), give
exactly what the same kernels give launched one at a time with a host sync between them.

The chain is a MoE layer's decode path, the part of a step where PDL kernels follow each other:

    x -> rms_norm -> h -> moe_route (router GEMV, top-k, align) -> ids, rw, R
      -> moe_gate_up_silu (h, R) -> a -> moe_down (a, R) -> eo -> moe_combine_residual (eo, rw, x, h) -> y

Every kernel reads its predecessor's output, and some read outputs of kernels further back (the
experts read R from align, the combine reads h and rw): each CTA's pdl_wait() must cover those too
(the predecessor completed only after it waited itself).  At T <= 8 the experts run as GEMVs and
above as tensor-core tiles (the other launch has an empty grid and is skipped: the next PDL launch
then follows the one before it).  Outputs are poisoned before every run; ids, offsets, h, rw, a,
eo and y must be bitwise equal to the serial run's (pair order inside an expert's segment follows
atomics and is free; no value depends on it).  The serial run itself is checked against the ops'
references on its own intermediates (the per-family tests check each kernel thoroughly).
The captured graph must hold one programmatic edge per PDL launch after the first.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import GPU_MARKS, TORCH_DTYPES, assert_close, assert_strict, kernel_test, poison, single_op_graph, tiny_model  # noqa: E402,E501

from codegen import families  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from ir.graph import node_view  # noqa: E402
from ir.ops import OPS, TType  # noqa: E402
from ir.ops.moe import align_ref  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = GPU_MARKS
DEV = "cuda"
D, E, K, M = 1024, 32, 6, 352          # hidden, experts, top-k, expert width (V2-Lite-like ratios)
LITE = {"D": 2048, "E": 64, "K": 6, "M": 1408}   # DeepSeek-V2-Lite's (bench/perf_pdl.py times these)
TOKENS = (1, 2, 8, 9, 33, 300, 2048)


@pytest.fixture(scope="module")
def runner():
    from runtime.launcher import KernelRunner
    r = KernelRunner()
    yield r
    r.close()


def _graphs(D=D, E=E, K=K, M=M):
    """The chain's one-op graphs, wired by value name: [(G, nid), ...] in launch order."""
    m = tiny_model()
    act = lambda *s: TType(s, "act")     # noqa: E731
    r = TType((f"T*{K}", E), "routing")
    route_attrs = {"num_experts": E, "top_k": K, "scoring": "softmax", "method": "greedy", "groups": 1,
                   "topk_groups": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}
    return [
        single_op_graph(m, "rms_norm", {}, {"x": act("T", D)}, {"weight": "norm.w"}, outputs=["h"]),
        single_op_graph(m, "moe_route", route_attrs, {"h": act("T", D)}, {"gate": "router.w"},
                        outputs=["ids", "rw", "R"]),
        single_op_graph(m, "moe_gate_up_silu", {"num_experts": E, "out_dim": M}, {"h": act("T", D), "R": r},
                        {"gate": "e.{expert}.gate", "up": "e.{expert}.up"}, outputs=["a"]),
        single_op_graph(m, "moe_down", {"num_experts": E, "out_dim": D}, {"a": act(f"T*{K}", M), "R": r},
                        {"weight": "e.{expert}.down"}, outputs=["eo"]),
        single_op_graph(m, "moe_combine_residual", {},
                        {"eo": act(f"T*{K}", D), "rw": TType(("T", K), "f32"), "x": act("T", D), "h": act("T", D)},
                        {}, outputs=["y"]),
    ]


def _launches(dtype: str, pdl: bool, **dims) -> list:
    """Every launch of the chain, marked as lowering marks them (the family's PDL) or all plain."""
    out = []
    for G, nid in _graphs(**dims):
        fam = families.family_for_op(G.nodes[nid]["op"])
        assert families.uses_pdl(fam), f"{fam.FAMILY} should be a PDL family"
        out += [dataclasses.replace(la, pdl=pdl) for la in fam.lower(nid, G, Options(dtype=dtype))]
    return out


def _weights(dtype: str, g: torch.Generator, D=D, E=E, K=K, M=M) -> dict:
    tdt = TORCH_DTYPES[dtype]
    return {"norm.w": (1 + 0.1 * torch.randn(D, generator=g)).to(DEV, tdt),
            "router.w": (torch.randn(E, D, generator=g) / D ** 0.5 * 2).to(DEV),     # fp32, picks well apart
            "e.*.gate": (torch.randn(E, M, D, generator=g) / D ** 0.5).to(DEV, tdt),
            "e.*.up": (torch.randn(E, M, D, generator=g) / D ** 0.5).to(DEV, tdt),
            "e.*.down": (torch.randn(E, D, M, generator=g) / M ** 0.5).to(DEV, tdt)}


def _outputs(T: int, dtype: str, D=D, E=E, K=K, M=M) -> dict:
    tdt = TORCH_DTYPES[dtype]
    return {"h": torch.empty(T, D, dtype=tdt, device=DEV),
            "ids": torch.empty(T, K, dtype=torch.int64, device=DEV),
            "rw": torch.empty(T, K, dtype=torch.float32, device=DEV),
            "R.order": torch.empty(T * K, dtype=torch.int32, device=DEV),
            "R.offsets": torch.empty(E + 1, dtype=torch.int32, device=DEV),
            "a": torch.empty(T * K, M, dtype=tdt, device=DEV),
            "eo": torch.empty(T * K, D, dtype=tdt, device=DEV),
            "y": torch.empty(T, D, dtype=tdt, device=DEV)}


def _poison(values: dict) -> None:
    for name, t in values.items():
        if name != "x":
            poison(t)


def _run(runner, launches, values, weights, T, *, sync_each: bool = False, K=K) -> None:
    sizes = {"T": T, "NP": T * K}
    shared: dict = {}
    for la in launches:
        shared.update(runner.run_all([la], values=values, weights=weights, sizes=sizes, workspaces=shared))
        if sync_each:
            torch.cuda.synchronize()


def _assert_same(got: dict, want: dict, label: str) -> None:
    for name in ("h", "ids", "rw", "R.offsets", "a", "eo", "y"):
        assert torch.equal(got[name], want[name]), f"{label}: {name} differs from the serial run"
    # the pairs of each expert's segment, as sets (their order follows atomics)
    off = want["R.offsets"].cpu()
    for e in range(E):
        seg = slice(int(off[e]), int(off[e + 1]))
        assert sorted(got["R.order"][seg].tolist()) == sorted(want["R.order"][seg].tolist()), f"{label}: expert {e}"


def _check_reference(values: dict, weights: dict, x: torch.Tensor, dtype: str) -> None:
    """The serial run against the ops' references, each on the kernels' own inputs."""
    graphs = _graphs()
    tdt = TORCH_DTYPES[dtype]

    def ref(i, ins, w):
        G, nid = graphs[i]
        return OPS[G.nodes[nid]["op"]].run(node_view(G, nid), ins, w, None)

    c = {k: v.cpu() for k, v in values.items()}
    w = {k: v.double().cpu() for k, v in weights.items()}
    (h,) = ref(0, [x.double().cpu()], {"weight": w["norm.w"]})
    assert_close(c["h"], h, dtype, "h")
    assert_strict(c["h"], h, dtype, "h")
    routing = align_ref(c["ids"], E)
    assert torch.equal(c["R.offsets"].long(), routing["offsets"]), "offsets of the kernel's own ids"
    routing["top_k"] = K
    g, u = OPS["moe_gate_up"].run(node_view(*graphs[2]), [c["h"].double(), routing],
                                  {"gate": w["e.*.gate"], "up": w["e.*.up"]}, None)
    rnd = (lambda t: t.to(tdt).double()) if dtype != "fp32" else (lambda t: t)    # noqa: E731
    a = rnd(torch.nn.functional.silu(rnd(g))) * rnd(u)
    assert_strict(c["a"], a, dtype, "a")
    (eo,) = ref(3, [c["a"].double(), routing], {"weight": w["e.*.down"]})
    assert_strict(c["eo"], eo, dtype, "eo")
    (y,) = ref(4, [c["eo"].to(tdt), c["rw"], x.cpu(), c["h"]], {})
    assert_close(c["y"], y.double(), dtype, "y")
    assert_strict(c["y"], y.double(), dtype, "y")


def _case(T, dtype="bf16", seed=7):
    return {"T": T, "dtype": dtype, "seed": seed}


@st.composite
def cases(draw):
    return _case(draw(st.sampled_from(TOKENS)), draw(st.sampled_from(("bf16", "fp16"))), draw(st.integers(0, 2**31 - 1)))


@given(case=cases())
@example(case=_case(1))
@example(case=_case(9, "fp16"))
@example(case=_case(2048))
@kernel_test(8)
def test_a_chain_of_pdl_kernels_equals_the_serial_run_eagerly_and_in_a_graph(runner, case):
    T, dtype = case["T"], case["dtype"]
    g = torch.Generator().manual_seed(case["seed"])
    weights = _weights(dtype, g)
    x = torch.randn(T, D, generator=g).to(DEV, TORCH_DTYPES[dtype])
    serial, eager, graphed = ({"x": x, **_outputs(T, dtype)} for _ in range(3))
    plain, pdl = _launches(dtype, False), _launches(dtype, True)

    _poison(serial)
    _run(runner, plain, serial, weights, T, sync_each=True)
    _check_reference(serial, weights, x, dtype)

    for _ in range(2):                   # the second time with every module loaded: nothing in between
        _poison(eager)
        _run(runner, pdl, eager, weights, T)
        torch.cuda.synchronize()
        _assert_same(eager, serial, "PDL, eager")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(runner, pdl, graphed, weights, T)
    for step in range(2):                # replays on new data read what the kernels before wrote
        if step:
            x.copy_(torch.randn(T, D, generator=g).to(DEV, x.dtype))
            _poison(serial)
            _run(runner, plain, serial, weights, T, sync_each=True)
        _poison(graphed)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(graphed, serial, f"PDL, graph replay {step}")


@pytest.mark.parametrize("T", [1, 2, 9])
def test_every_replay_of_a_captured_chain_reads_its_own_routing(runner, T):
    """Twenty replays of the captured chain, each on a new x (so a new routing), each bitwise equal
    to the serial run on the same x.  Between replays the outputs are poisoned every other time and
    left as the replay before wrote them the rest: a kernel that took the routing before the route
    had written it (an early read of a total or an order: down reads the offsets before its wait)
    sees poison or the previous replay's experts."""
    dtype = "bf16"
    g = torch.Generator().manual_seed(11 + T)
    weights = _weights(dtype, g)
    x = torch.randn(T, D, generator=g).to(DEV, TORCH_DTYPES[dtype])
    serial, graphed = ({"x": x, **_outputs(T, dtype)} for _ in range(2))
    plain, pdl = _launches(dtype, False), _launches(dtype, True)
    _run(runner, pdl, graphed, weights, T)      # every module loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(runner, pdl, graphed, weights, T)
    for step in range(20):
        x.copy_(torch.randn(T, D, generator=g).to(DEV, x.dtype))
        _poison(serial)
        _run(runner, plain, serial, weights, T, sync_each=True)
        if step % 2:
            _poison(graphed)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(graphed, serial, f"graph replay {step}")


def test_a_captured_chain_holds_programmatic_edges(runner):
    """Stream capture keeps each PDL launch as a programmatic edge from the kernel before it (CUDA
    >= 12.3); without PDL the same chain has none.  At T = 1 only the launches with a non-empty grid
    run (the route's fused launch, the experts' GEMVs): n kernels, n - 1 programmatic edges."""
    from codegen import sizes as size_exprs
    from cuda.bindings import driver
    T, dtype = 1, "bf16"
    g = torch.Generator().manual_seed(3)
    weights = _weights(dtype, g)
    x = torch.randn(T, D, generator=g).to(DEV, TORCH_DTYPES[dtype])
    counts = {}
    for pdl in (True, False):
        values = {"x": x, **_outputs(T, dtype)}
        launches = _launches(dtype, pdl)
        _run(runner, launches, values, weights, T)      # load the modules before capturing
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:
            pytest.skip("this torch cannot keep the captured cudaGraph_t (CUDAGraph(keep_graph=True))")
        with torch.cuda.graph(graph):
            _run(runner, launches, values, weights, T)
        raw = driver.CUgraph(graph.raw_cuda_graph())
        err, _, _, _, n = driver.cuGraphGetEdges(raw, 0)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        err, frm, to, data, n = driver.cuGraphGetEdges(raw, n)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        err, nodes, n_nodes = driver.cuGraphGetNodes(raw, 0)
        counts[pdl] = (int(n_nodes), sum(int(d.type) == int(driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
                                         for d in data))
        graph.replay()
        torch.cuda.synchronize()
    full = runner.step_sizes({"T": T, "NP": T * K}, {})
    n = sum(0 not in tuple(size_exprs.evaluate(d, full) for d in la.grid) for la in _launches(dtype, True))
    assert n >= 5, n   # norm, route, gate_up_silu, down, combine at least
    assert counts[True] == (n, n - 1), counts
    assert counts[False] == (n, 0), counts
