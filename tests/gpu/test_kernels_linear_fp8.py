"""Property tests: the skinny linear with FP8 weights (linear_skinny at T <= 16 tokens, weights in
fp8_e4m3_block128: float8_e4m3fn bytes and a float32 scale per 128 x 128 block, templates/include/fp8.cuh)
against the ops' reference semantics on the weights dequantised exactly (float64, from the same bytes
and scales) and the kernel's own rounded inputs.

Hypothesis draws the token count (1..16), the activation dtype (bf16, fp16), K (odd ones, ones that
are not a whole number of 128-wide scale blocks: a partial "ceil" K block, ones under a 64-wide step),
one to three stacked weights of odd heights (576: V3's kv_a, whose last row block has 64 rows; tiles
straddling two weights, whose rows carry different scales), x as a strided view, a misaligned x or
weight (the element loads), and the kernel's shape.  Weight bytes span e4m3's whole range (zeros and
subnormals to 448) and scales vary over 16x from block to block, so a scale taken from the wrong
block moves the result far past the tolerance.  Outputs are poisoned (NaN) first.  The planted
mutants of tests/gpu/test_mutants.py (a scale one row block late, the last K block unscaled, a ceil
block dropped, the up rows scaled as their gate) run through these bodies and must fail them."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import TORCH_DTYPES, shifted
from kernel_cases import Recorder, act, empty_out, kernel_test, model, rand, reference, runner, single_op_graph
from test_kernels_linear import silu_reference, x_view

from codegen.families import gemm_fp8, linear_skinny
from codegen.tuning import LinearTuning, Tuning
from codegen.kernel import KernelLaunch, LibraryCall, Options
from ir.formats import FP8, cdiv, companion_names, scale_shape

SETTINGS = kernel_test(40)
REC = Recorder("linear_skinny fp8")
REC_SILU = Recorder("linear_skinny fp8 gate_up_silu")
DTYPES = ("bf16", "fp16")
BLOCK = FP8.block[0]
# (warps, row tiles, unroll, cluster, pipeline): the FP8 defaults (None: the op's) and the shapes
# bench/perf_linear_fp8.py times
VARIANTS = ((LinearTuning().warps, LinearTuning().row_tiles, None, LinearTuning().ksplit, None),
            (8, 1, 4, 1, "rolling"), (8, 1, 1, 1, "batch"), (8, 1, 2, 1, "batch"), (8, 1, 8, 1, "rolling"),
            (4, 1, 2, 1, "rolling"), (16, 1, 2, 1, "batch"), (8, 2, 2, 1, "rolling"), (8, 1, 4, 2, "rolling"),
            (8, 1, 1, 4, "batch"))
WIDTHS = st.one_of(st.sampled_from([1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 144, 256, 720, 2048, 2064, 2816]),
                   st.integers(1, 3000))
HEIGHTS = st.one_of(st.sampled_from([1, 15, 16, 17, 127, 128, 129, 136, 576]), st.integers(1, 400))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC.report()
    REC_SILU.report()



def as_fp8(G) -> None:
    """Every weight of G stored in FP8."""
    for name, info in list(G.graph["weights"].items()):
        G.graph["weights"][name] = dataclasses.replace(info, format=FP8.name)


def quantized(rows: int, K: int, gen, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [rows, K], s float32 [ceil(rows / 128), ceil(K / 128)]) on the GPU, quantised as
    DeepSeek-V3's checkpoints are (s = the block's amax / 448): a weight of about `scale` a element whose
    blocks differ in size by up to 16x, so the bytes span e4m3's range (448 down to subnormals) in
    every block and the scales differ from block to block."""
    sb = scale_shape((rows, K), FP8)
    size = torch.exp2(torch.rand(sb, generator=gen) * 4 - 2) * scale
    w = torch.randn((sb[0] * BLOCK, sb[1] * BLOCK), generator=gen) * size.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    w = w[:rows, :K]
    s = torch.zeros(sb)
    for i in range(sb[0]):
        for j in range(sb[1]):
            s[i, j] = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().max().clamp_min(1e-30) / 448
    q = (w / s.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :K]).to(torch.float8_e4m3fn)
    return q.cuda(), s.cuda()


def dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W = q * s per 128 x 128 block (edge blocks partial), exactly, in float64."""
    rows, K = q.shape
    full = s.double().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :K]
    return q.double() * full


def fp8_weights(names, heights, K, gen, scale) -> tuple[dict, dict]:
    """(the kernel's weights: bytes and scale companions, the reference's float64 weights)."""
    kernel, ref = {}, {}
    for name, n in zip(names, heights):
        q, s = quantized(n, K, gen, scale)
        kernel[name], kernel[companion_names(name, FP8)[0]] = q, s
        ref[name] = dequantized(q, s)
    return kernel, ref


# above 16 tokens gemm_fp8 or the library call (the 16-token chunks: test_kernels_linear_fp8_chunks.py)
GEMM_ABOVE = Tuning(linear=LinearTuning(fp8_chunks_upto=0))


def lower_fp8(G, nid, dtype, variant, K):
    """The skinny FP8 launch; above 16 tokens the node runs gemm_fp8's GEMM where it serves K and the
    dequantising library call only where it does not."""
    warps, rt, unroll, ks, pipeline = variant
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=GEMM_ABOVE), warps=warps, row_tiles=rt, unroll=unroll, ksplit=ks,
                                pipeline=pipeline)
    launches = [s for s in steps if isinstance(s, KernelLaunch) and s.family == linear_skinny.FAMILY]
    calls = [s for s in steps if isinstance(s, LibraryCall)]
    if gemm_fp8.serves(K):
        assert not calls, "above 16 tokens the FP8 GEMM (gemm_fp8) runs"
    else:
        assert [c.attrs.get("weight_format") for c in calls] == [FP8.name], calls
    assert len(launches) == 1 and "wfp8" in launches[0].name and launches[0].params["wfmt"] == FP8.name
    return launches


def run_case(dtype, T, K, rows, extra, offset, shift, variant, seed):
    m = model("lite")
    gen = torch.Generator().manual_seed(seed)
    if len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"})
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
    as_fp8(G)
    outs = G.nodes[nid]["outputs"]
    x = x_view(T, K, dtype, extra, offset, gen)
    ws, ref_ws = fp8_weights([f"w{i}" for i in range(len(rows))], rows, K, gen, K ** -0.5)
    if shift == "x":
        x = shifted(x.contiguous())
    elif shift == "w":
        ws["w0"] = shifted(ws["w0"])
    ys = {o: empty_out((T, n), dtype) for o, n in zip(outs, rows)}
    runner().run_all(lower_fp8(G, nid, dtype, variant, K), values={"x": x, **ys}, weights=ws, sizes={"T": T})
    torch.cuda.synchronize()
    for o, ref in zip(outs, reference(G, nid, [x], ref_ws)):
        REC.check(ys[o], ref, dtype, f"{o} T={T} K={K} rows={list(rows)} variant={variant} shift={shift}")
    REC.example()


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS,
       rows=st.lists(HEIGHTS, min_size=1, max_size=3), extra=st.sampled_from([0, 0, 1, 8, 64]),
       offset=st.integers(0, 64), shift=st.sampled_from(["none", "none", "x", "w"]),
       variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**31))
# V2-Lite's fused q + kv_a (576: a 64-row ceil block) at b=1 and b=16, o_proj off a strided view
@example(dtype="bf16", T=1, K=2048, rows=[3072, 576], extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=1)
@example(dtype="bf16", T=16, K=2048, rows=[3072, 576], extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=2)
@example(dtype="bf16", T=8, K=2048, rows=[2048], extra=64, offset=8, shift="none", variant=VARIANTS[0], seed=3)
# a ceil K block (2064 = 16 x 129) and a ceil row block, a K under one step, odd K (element loads)
@example(dtype="bf16", T=9, K=2064, rows=[576], extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=4)
@example(dtype="fp16", T=3, K=48, rows=[200], extra=0, offset=0, shift="none", variant=VARIANTS[1], seed=5)
@example(dtype="bf16", T=7, K=301, rows=[17, 130, 5], extra=3, offset=1, shift="none", variant=VARIANTS[3], seed=6)
# misaligned x and weight; tiles straddling weights of different scales; clusters of 2 and 4
@example(dtype="bf16", T=16, K=720, rows=[136, 40], extra=0, offset=0, shift="x", variant=VARIANTS[0], seed=7)
@example(dtype="bf16", T=2, K=512, rows=[100], extra=0, offset=0, shift="w", variant=VARIANTS[4], seed=8)
@example(dtype="bf16", T=11, K=2048, rows=[2048], extra=0, offset=0, shift="none", variant=VARIANTS[6], seed=9)
@example(dtype="fp16", T=4, K=2816, rows=[40, 9], extra=8, offset=8, shift="none", variant=VARIANTS[7], seed=10)
def test_linear_skinny_fp8(dtype, T, K, rows, extra, offset, shift, variant, seed):
    run_case(dtype, T, K, rows, extra, offset, shift, variant, seed)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS, n=HEIGHTS,
       extra=st.sampled_from([0, 0, 1, 8]), offset=st.integers(0, 8), shift=st.sampled_from(["none", "none", "x", "w"]),
       variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**31))
# V2-Lite's shared experts (n = 2816) at b=1 and b=16, the dense FFN's (n = 10944), odd widths
@example(dtype="bf16", T=1, K=2048, n=2816, extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=1)
@example(dtype="bf16", T=16, K=2048, n=2816, extra=0, offset=0, shift="none", variant=VARIANTS[1], seed=2)
@example(dtype="bf16", T=9, K=2048, n=10944, extra=0, offset=0, shift="none", variant=VARIANTS[5], seed=3)
@example(dtype="fp16", T=5, K=301, n=200, extra=1, offset=1, shift="none", variant=VARIANTS[1], seed=4)
@example(dtype="bf16", T=12, K=2064, n=136, extra=0, offset=0, shift="w", variant=VARIANTS[6], seed=5)
def test_gate_up_silu_fp8(dtype, T, K, n, extra, offset, shift, variant, seed):
    """The fused gate + up with FP8 weights: a thread's row g is a gate row, its row g + 8 the up row
    of the same column, each with its own tensor's scale."""
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(model("lite"), "gate_up_silu", {"out_dim": n}, {"x": act(K)}, {"gate": "wg", "up": "wu"})
    as_fp8(G)
    x = x_view(T, K, dtype, extra, offset, gen)
    ws, ref_ws = fp8_weights(["wg", "wu"], [n, n], K, gen, K ** -0.5)
    ref_ws["wg"] = ref_ws["wg"] * 2    # gate over a few units (silu's curve), up near one
    ws["wg_scale_inv"] = ws["wg_scale_inv"] * 2
    if shift == "x":
        x = shifted(x.contiguous())
    elif shift == "w":
        ws["wu"] = shifted(ws["wu"])
    out = empty_out((T, n), dtype)
    runner().run_all(lower_fp8(G, nid, dtype, variant, K), values={"x": x, "out": out}, weights=ws, sizes={"T": T})
    torch.cuda.synchronize()
    REC_SILU.check(out, silu_reference(x, ref_ws["wg"], ref_ws["wu"], dtype), dtype,
                   f"T={T} K={K} n={n} variant={variant} shift={shift}")
    REC_SILU.example()


@pytest.mark.parametrize("op", ["linear", "gate_up_silu"])
def test_fallback_above_the_kernels_tokens_dequantises(op):
    """Above 16 tokens, where the FP8 GEMM cannot run (no sm_90a: a bundle for sm_80), the node's library
    call takes the FP8 bytes and scales: dequantised to the activation dtype (where the reference rounds
    them too), then cuBLAS."""
    from runtime.cuda_backend import CudaBackend
    T, K, n, dtype = 40, 720, 200, "bf16"
    gen = torch.Generator().manual_seed(7)
    roles = {"weight": "w0"} if op == "linear" else {"gate": "wg", "up": "wu"}
    attrs = {"out_dim": n}
    G, nid = single_op_graph(model("lite"), op, attrs, {"x": act(K)}, roles)
    as_fp8(G)
    (call,) = [s for s in linear_skinny.lower(nid, G, Options(dtype=dtype, arch="sm_80"))
               if isinstance(s, LibraryCall)]
    assert call.weights == tuple(roles.values()) and cdiv(n, BLOCK) == 2
    x = rand((T, K), dtype, gen=gen, scale=3.0)
    ws, ref_ws = fp8_weights(list(roles.values()), [n] * len(roles), K, gen, K ** -0.5)
    ref_ws = {k: w.to(TORCH_DTYPES[dtype]).double() for k, w in ref_ws.items()}
    backend = CudaBackend.__new__(CudaBackend)
    backend.weights = ws
    env = {"x": x}
    (CudaBackend._linear if op == "linear" else CudaBackend._gate_up_silu)(backend, call, env)
    if op == "linear":
        expected = reference(G, nid, [x], ref_ws)[0]
    else:
        expected = silu_reference(x, ref_ws["wg"], ref_ws["wu"], dtype)
    REC.check(env["out"], expected, dtype, f"fallback {op} T={T}")
