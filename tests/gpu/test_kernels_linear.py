"""Property tests: the decode GEMV (`linear` family) against the linear op's reference, for
T <= 8 tokens, V2-Lite's and odd shapes, strided inputs, bf16/fp16/fp32; above 8 tokens the
GEMV's grid is empty and the library call runs instead."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from codegen import sizes as size_exprs
from kernel_cases import (DTYPES, Recorder, TType, act, empty_out, lower, model, rand, reference, run_kernel,
                          single_op_graph, strided_view)

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
REC = Recorder("linear")
SHAPES = [(3072, 2048), (576, 2048), (2048, 2816), (2048, 10944), (37, 40), (1000, 72), (8, 4104)]


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC.report()


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, 8), shape=st.sampled_from(SHAPES),
       extra=st.sampled_from([0, 0, 8, 3]), offset=st.sampled_from([0, 0, 8, 1]), seed=st.integers(0, 2**31))
def test_gemv_matches_linear(dtype, T, shape, extra, offset, seed):
    N, K = shape
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(model("lite"), "linear", {"out_dim": N}, {"x": act(K)}, {"weight": "w"})
    x = strided_view(T, K, dtype, extra, offset, gen)        # misaligned views take the scalar path
    w = rand((N, K), dtype, scale=K ** -0.5, gen=gen)
    out = empty_out((T, N), dtype)
    run_kernel(G, nid, dtype, values={"x": x, "out": out}, weights={"w": w}, sizes={"T": T})
    (ref,) = reference(G, nid, [x], {"w": w})
    REC.check(out, ref, dtype)
    REC.example()


def test_grid_is_empty_above_eight_tokens():
    G, nid = single_op_graph(model("lite"), "linear", {"out_dim": 64}, {"x": act(128)}, {"weight": "w"})
    (launch,) = lower(G, nid, "bf16")
    assert [size_exprs.evaluate(launch.grid[1], {"T": t}) for t in (1, 8, 9, 64)] == [1, 1, 0, 0]
    out = empty_out((9, 64), "bf16")
    x, w = rand((9, 128), "bf16"), rand((64, 128), "bf16")
    run_kernel(G, nid, "bf16", values={"x": x, "out": out}, weights={"w": w}, sizes={"T": 9})
    assert torch.isnan(out.float()).all(), "the GEMV must not run above 8 tokens (the library does)"
