"""Property tests: the int8 linears (linear_skinny at T <= 16 tokens with msModelSlim's int8_channel
weights: the quantiser launch, templates/include/quant_int8.cuh, then the int8 kernel,
templates/include/int8.cuh) against ir/formats_int.py's definitions, computed on the CPU (where
`amax / 127` is a true division).  Integer arithmetic is exact, so the comparisons are bitwise:

- the quantiser: its int8 rows (and their zero padding) and float32 scales equal quantize_activation's
  on the kernel's own bf16 / fp16 input, with rows built to hit rounding ties (x / s = k + 0.5), a row
  of zeros, tiny rows (subnormal scales) and huge ones; aligned rows with K % 8 == 0 take its 16-byte
  path, the others (odd K, odd strides, shifted x) its element loads;
- the int8 kernel alone, given the reference's quantised activations in its workspaces: outputs equal
  ((float(acc) * s_w) * s_x) rounded to the activation type, acc the exact int64 sum -- with
  activations and weights near +-127 so the sums pass 2^24 (a float accumulator would lose bits);
- both launches on x: equal to int_linear(x) rounded (the reference backend's linear);
- gate_up_silu: gate and up exact as above, silu(gate) * up within the bf16 / fp16 tolerance (the
  kernel's expf);
- above 16 tokens, the cuda backend's library call (torch._int_mm or float64 sums): equal to int_linear;
- the kernel that quantises x in its own prologue (Tuning.linear.i8_prologue_upto = N, int8_prologue.cuh) at
  T <= N: its outputs bit-equal to the quantiser launch + int8 kernel pair's (same int32 sums, same two scales;
  gate_up_silu's too, the epilogue being the same code), and the linears' to the reference.

Hypothesis draws T (1..16), the dtype, K (odd ones: byte weight loads; ones under a 64-wide step),
one to three stacked weights of odd heights, x as a strided view, misaligned x or weights, the kernel's
shape.  Outputs and workspaces are poisoned first.  Planted mutants (tests/gpu/test_mutants.py): the
next channel's weight scale, the last K step dropped, the up rows scaled as their gate, the quantiser
dividing by a reciprocal multiply, rounding ties away from zero; the prologue's scale x1.01, the prologue
reading row t + 1 for the last row, a weight row missing from the prologue kernel's loads.

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_linear_int8.py
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import GPU_MARKS, TORCH_DTYPES, poison, shifted
from kernel_cases import Recorder, act, empty_out, kernel_test, model, runner, single_op_graph
from test_kernels_linear import x_view

from codegen.families import gemm_int8, linear_skinny
from codegen.kernel import KernelLaunch, LibraryCall, Options
from codegen.tuning import LinearTuning, Tuning
from ir.formats import FORMATS, companion_names
from ir.formats_int import int_linear, quantize_activation

pytestmark = GPU_MARKS
SETTINGS = kernel_test(40)
REC_SILU = Recorder("linear_skinny int8 gate_up_silu")
I8 = FORMATS["int8_channel"]
DTYPES = ("bf16", "fp16")
# (warps, row tiles, unroll): the default and other shapes (the kernel splits K over warps only)
VARIANTS = ((None, None, None), (8, 1, 1), (4, 1, 2), (16, 1, 4), (8, 2, 2), (2, 4, 1), (1, 1, 8))
WIDTHS = st.one_of(st.sampled_from([1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 720, 1001, 2048, 2816, 4096]),
                   st.integers(1, 3000))
HEIGHTS = st.one_of(st.sampled_from([1, 15, 16, 17, 127, 128, 129, 136, 576]), st.integers(1, 400))
ROW_KINDS = ("random", "ties", "zeros", "tiny", "huge")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC_SILU.report()


def as_int8(G) -> None:
    for name, info in list(G.graph["weights"].items()):
        G.graph["weights"][name] = dataclasses.replace(info, format=I8.name)


def lower_int8(G, nid, dtype, variant):
    warps, rt, unroll = variant
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype), warps=warps, row_tiles=rt, unroll=unroll)
    quant, launch = [s for s in steps if isinstance(s, KernelLaunch) and s.family == linear_skinny.FAMILY]
    assert quant.stage == "quant_int8" and "_wi8__" in launch.name and launch.params["wfmt"] == I8.name
    # above the skinny range: gemm_int8's launches where it serves K (tests/gpu/test_kernels_gemm_int8.py),
    # else the exact library call
    calls = [s for s in steps if isinstance(s, LibraryCall)]
    above = [s for s in steps if isinstance(s, KernelLaunch) and s.family == gemm_int8.FAMILY]
    assert bool(calls) != bool(above), (calls, above)
    for call in calls:
        assert call.from_tokens == linear_skinny.SKINNY_MAX_TOKENS + 1 and call.attrs["weight_format"] == I8.name
    return quant, launch


def int8_weight(rows: int, K: int, gen, *, big: bool = False):
    """(stored int8 [rows, K], scale float32 [rows, 1], offset zeros) on the GPU: values over the whole
    int8 range (big: near +-127, one sign a row, so sums pass 2^24), scales differing ~16x between
    neighbouring channels (a scale taken from the wrong channel moves the output far)."""
    if big:
        sign = torch.where(torch.rand((rows, 1), generator=gen) < 0.5, -1, 1)
        q = sign * torch.randint(100, 128, (rows, K), generator=gen)
        q = q.clamp(-128, 127)
    else:
        q = torch.randint(-128, 128, (rows, K), generator=gen)
    s = torch.exp2(torch.rand((rows, 1), generator=gen) * 4 - 2) * (K ** -0.5) / 64
    return q.to(torch.int8).cuda(), s.float().cuda(), torch.zeros((rows, 1)).cuda()


def int8_weights(names, heights, K, gen, *, big=False) -> dict:
    out = {}
    for name, n in zip(names, heights):
        q, s, z = int8_weight(n, K, gen, big=big)
        out[name] = q
        out[companion_names(name, I8)[0]], out[companion_names(name, I8)[1]] = s, z
    return out


def special_rows(x: torch.Tensor, kind: str, gen) -> torch.Tensor:
    """x [T, K] (a view, written in place) with row 0 made `kind`: ties (amax 127 so s = 1 and
    values k + 0.5), zeros, tiny (~1e-38: a subnormal scale), huge (~1e30)."""
    K = x.shape[1]
    if kind == "ties":
        v = torch.randint(-127, 127, (K,), generator=gen).float() + 0.5
        v[torch.randint(0, K, (1,), generator=gen)] = 127.0
        x[0] = v.to(x.dtype).cuda()
    elif kind == "zeros":
        x[0] = 0
    elif kind == "tiny" and x.dtype == torch.bfloat16:
        x[0] = (torch.randn(K, generator=gen) * 1e-38).to(x.dtype).cuda()
    elif kind == "huge" and x.dtype == torch.bfloat16:
        x[0] = (torch.randn(K, generator=gen) * 1e30).to(x.dtype).cuda()
    return x


def _diff(a: torch.Tensor, b: torch.Tensor, msg: str) -> str:
    a, b = a.cpu(), b.cpu()
    bad = (a != b) | (a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool))
    idx = bad.nonzero()[:5].tolist()
    return f"{msg}: {int(bad.sum())} of {a.numel()} differ, first at {idx}: " + \
        ", ".join(f"{a[tuple(i)].item()!r} vs {b[tuple(i)].item()!r}" for i in idx)


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """Bitwise equal (NaN, from a poisoned element never written, is never equal)."""
    a, e = actual.cpu(), expected.cpu()
    assert a.shape == e.shape and a.dtype == e.dtype, f"{msg}: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
    assert torch.equal(a, e) and not (a.is_floating_point() and bool(a.isnan().any())), _diff(a, e, msg)


def workspaces(T: int, K: int) -> dict:
    """Poisoned workspaces of the two launches: x_int8 (0x7f bytes) and x_scale (NaN)."""
    qrow = -(-K // 16) * 16
    q = torch.full((T, qrow // 4), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    return {"x_int8": q, "x_scale": poison(torch.empty(T, device="cuda"))}


def reference_out(qx, sx, ws: dict, name: str, dtype: str) -> torch.Tensor:
    """((float32(acc) * s_w) * s_x) in the activation type, acc the exact int64 sum (CPU)."""
    acc = qx.cpu().long() @ ws[name].cpu().long().T
    y = (acc.float() * ws[companion_names(name, I8)[0]].cpu().reshape(1, -1)) * sx.cpu().reshape(-1, 1)
    return y.to(TORCH_DTYPES[dtype])


def graph(rows, K):
    m = model("lite")
    if len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"})
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
    as_int8(G)
    return G, nid


# -- the quantiser ------------------------------------------------------------------------------

@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS,
       extra=st.sampled_from([0, 0, 1, 8, 64]), offset=st.integers(0, 64), shift=st.booleans(),
       kind=st.sampled_from(ROW_KINDS), seed=st.integers(0, 2**31))
@example(dtype="bf16", T=1, K=2048, extra=0, offset=0, shift=False, kind="random", seed=1)
@example(dtype="bf16", T=16, K=2048, extra=0, offset=0, shift=False, kind="ties", seed=2)
@example(dtype="fp16", T=5, K=1001, extra=3, offset=1, shift=False, kind="ties", seed=3)
@example(dtype="bf16", T=3, K=17, extra=0, offset=0, shift=True, kind="zeros", seed=4)
@example(dtype="bf16", T=2, K=720, extra=8, offset=8, shift=False, kind="tiny", seed=5)
@example(dtype="bf16", T=9, K=10944, extra=0, offset=0, shift=False, kind="huge", seed=6)
def test_quantiser_int8(dtype, T, K, extra, offset, shift, kind, seed):
    """q and s bit-equal to quantize_activation of the kernel's own input; the padding zero."""
    gen = torch.Generator().manual_seed(seed)
    G, nid = graph([64], K)
    quant, _ = lower_int8(G, nid, dtype, VARIANTS[0])
    x = special_rows(x_view(T, K, dtype, extra, offset, gen), kind, gen)
    if shift:
        x = shifted(x.contiguous())
    ws = runner().run_all([quant], values={"x": x}, sizes={"T": T}, workspaces=workspaces(T, K))
    torch.cuda.synchronize()
    q = ws["x_int8"].view(torch.int8)
    want_q, want_s = quantize_activation(x.cpu())
    assert_equal(q[:, :K], want_q, f"q T={T} K={K} {kind}")
    assert_equal(q[:, K:], torch.zeros_like(q[:, K:]), f"q padding T={T} K={K}")
    assert_equal(ws["x_scale"], want_s.reshape(-1), f"s T={T} K={K} {kind}")


# -- the int8 kernel ------------------------------------------------------------------------------

def run_linear(dtype, T, K, rows, variant, big, shift, seed, *, whole: bool, extra=0, offset=0):
    """Outputs of the int8 kernel (whole: after the quantiser, on x; else alone, on the reference's
    quantised x in its workspaces) and the reference's; both bitwise comparable."""
    gen = torch.Generator().manual_seed(seed)
    G, nid = graph(rows, K)
    outs = G.nodes[nid]["outputs"]
    quant, launch = lower_int8(G, nid, dtype, variant)
    names = [f"w{i}" for i in range(len(rows))]
    ws = int8_weights(names, rows, K, gen, big=big)
    if shift == "w":
        ws["w0"] = shifted(ws["w0"])
    x = x_view(T, K, dtype, extra, offset, gen)
    if big:   # one sign a row, magnitudes 0.8..1: quantised to about +-100..127
        sign = torch.where(torch.arange(T) % 2 == 0, 1.0, -1.0).reshape(-1, 1)
        x = ((torch.rand((T, K), generator=gen) * 0.2 + 0.8) * sign).to("cuda", TORCH_DTYPES[dtype])
    if shift == "x":
        x = shifted(x.contiguous())
    qx, sx = quantize_activation(x.cpu())
    work = workspaces(T, K)
    if not whole:
        padded = torch.zeros((T, work["x_int8"].shape[1] * 4), dtype=torch.int8)
        padded[:, :K] = qx
        work["x_int8"].view(torch.int8).copy_(padded)
        work["x_scale"].copy_(sx.reshape(-1))
    ys = {o: empty_out((T, n), dtype) for o, n in zip(outs, rows)}
    runner().run_all([quant, launch] if whole else [launch], values={"x": x, **ys}, weights=ws, sizes={"T": T},
                     workspaces=work)
    torch.cuda.synchronize()
    for o, name in zip(outs, names):
        want = reference_out(qx, sx, ws, name, dtype)
        if whole:   # the reference backend's linear: the same numbers by the module's definition
            stored, comp = ws[name].cpu(), [ws[c].cpu() for c in companion_names(name, I8)]
            assert torch.equal(int_linear(x.cpu(), stored, comp, I8).to(TORCH_DTYPES[dtype]), want)
        assert_equal(ys[o], want, f"{o} T={T} K={K} rows={list(rows)} variant={variant} big={big} shift={shift}")


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS,
       rows=st.lists(HEIGHTS, min_size=1, max_size=3), variant=st.sampled_from(VARIANTS), big=st.booleans(),
       shift=st.sampled_from(["none", "none", "w"]), seed=st.integers(0, 2**31))
# V2-Lite's q + kv_a (3072 + 576) at b=1 and b=16; o_proj; sums past 2^24; odd K (byte loads), K < 64
@example(dtype="bf16", T=1, K=2048, rows=[3072, 576], variant=VARIANTS[0], big=False, shift="none", seed=1)
@example(dtype="bf16", T=16, K=2048, rows=[3072, 576], variant=VARIANTS[0], big=False, shift="none", seed=2)
@example(dtype="bf16", T=8, K=2048, rows=[2048], variant=VARIANTS[0], big=True, shift="none", seed=3)
@example(dtype="fp16", T=7, K=4096, rows=[200], variant=VARIANTS[2], big=True, shift="none", seed=4)
@example(dtype="bf16", T=9, K=1001, rows=[17, 130, 5], variant=VARIANTS[4], big=False, shift="none", seed=5)
@example(dtype="bf16", T=3, K=48, rows=[40], variant=VARIANTS[6], big=False, shift="w", seed=6)
# V3's q_a + kv_a (K = 7168) and a slice of its dense down (K = 18432: sums past 2^24 in one warp's steps)
@example(dtype="bf16", T=16, K=7168, rows=[1536, 576], variant=VARIANTS[0], big=False, shift="none", seed=7)
@example(dtype="bf16", T=5, K=18432, rows=[256], variant=VARIANTS[0], big=True, shift="none", seed=8)
def test_linear_int8_exact_on_the_same_quantised_x(dtype, T, K, rows, variant, big, shift, seed):
    run_linear(dtype, T, K, rows, variant, big, shift, seed, whole=False)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS,
       rows=st.lists(HEIGHTS, min_size=1, max_size=2), variant=st.sampled_from(VARIANTS),
       extra=st.sampled_from([0, 0, 1, 8]), offset=st.integers(0, 8), shift=st.sampled_from(["none", "x", "w"]),
       seed=st.integers(0, 2**31))
@example(dtype="bf16", T=1, K=2048, rows=[3072, 576], variant=VARIANTS[0], extra=0, offset=0, shift="none", seed=1)
@example(dtype="bf16", T=16, K=1408, rows=[2048], variant=VARIANTS[0], extra=64, offset=8, shift="none", seed=2)
@example(dtype="fp16", T=11, K=301, rows=[129], variant=VARIANTS[1], extra=1, offset=1, shift="x", seed=3)
def test_linear_int8_after_the_quantiser(dtype, T, K, rows, variant, extra, offset, shift, seed):
    run_linear(dtype, T, K, rows, variant, False, shift, seed, whole=True, extra=extra, offset=offset)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS, n=HEIGHTS,
       variant=st.sampled_from(VARIANTS), shift=st.sampled_from(["none", "none", "x", "w"]),
       seed=st.integers(0, 2**31))
# V2-Lite's shared experts (n = 2816) at b=1 and b=16, its dense FFN (n = 10944), odd widths
@example(dtype="bf16", T=1, K=2048, n=2816, variant=VARIANTS[0], shift="none", seed=1)
@example(dtype="bf16", T=16, K=2048, n=2816, variant=VARIANTS[1], shift="none", seed=2)
@example(dtype="bf16", T=9, K=2048, n=10944, variant=VARIANTS[0], shift="none", seed=3)
@example(dtype="fp16", T=5, K=301, n=200, variant=VARIANTS[2], shift="x", seed=4)
@example(dtype="bf16", T=4, K=512, n=136, variant=VARIANTS[0], shift="none", seed=5)
def test_gate_up_silu_int8(dtype, T, K, n, variant, shift, seed):
    """Gate and up each exact (scaled by their own channels' scales, rounded), then silu(gate) * up."""
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(model("lite"), "gate_up_silu", {"out_dim": n}, {"x": act(K)}, {"gate": "wg", "up": "wu"})
    as_int8(G)
    quant, launch = lower_int8(G, nid, dtype, variant)
    ws = int8_weights(["wg", "wu"], [n, n], K, gen)
    ws["wu_scale"] = ws["wu_scale"] / 4   # gate over a few units (silu's curve), up near one
    x = x_view(T, K, dtype, 0, 0, gen)
    if shift == "x":
        x = shifted(x.contiguous())
    elif shift == "w":
        ws["wu"] = shifted(ws["wu"])
    out = empty_out((T, n), dtype)
    runner().run_all([quant, launch], values={"x": x, "out": out}, weights=ws, sizes={"T": T},
                     workspaces=workspaces(T, K))
    torch.cuda.synchronize()
    qx, sx = quantize_activation(x.cpu())
    g = reference_out(qx, sx, ws, "wg", dtype).double()
    u = reference_out(qx, sx, ws, "wu", dtype).double()
    expected = (g * torch.sigmoid(g)).to(TORCH_DTYPES[dtype]).double() * u
    REC_SILU.check(out, expected, dtype, f"T={T} K={K} n={n} variant={variant} shift={shift}")
    REC_SILU.example()


@pytest.mark.parametrize("op, K", [("linear", 728), ("linear", 301), ("gate_up_silu", 728)])
def test_fallback_above_the_kernels_tokens_is_exact(op, K):
    """Above 16 tokens, where gemm_int8 does not serve K (K % 16 != 0), the node's library call runs
    int_linear on the GPU (torch._int_mm where K and O are multiples of 8, float64 sums elsewhere):
    bit-equal to the CPU's."""
    from runtime.cuda_backend import CudaBackend
    T, n, dtype = 40, 200, "bf16"
    gen = torch.Generator().manual_seed(7)
    roles = {"weight": "w0"} if op == "linear" else {"gate": "wg", "up": "wu"}
    G, nid = single_op_graph(model("lite"), op, {"out_dim": n}, {"x": act(K)}, roles)
    as_int8(G)
    (call,) = [s for s in linear_skinny.lower(nid, G, Options(dtype=dtype)) if isinstance(s, LibraryCall)]
    ws = int8_weights(list(roles.values()), [n] * len(roles), K, gen)
    x = x_view(T, K, dtype, 0, 0, gen)
    backend = CudaBackend.__new__(CudaBackend)
    backend.weights = ws
    env = {"x": x}
    (CudaBackend._linear if op == "linear" else CudaBackend._gate_up_silu)(backend, call, env)
    qx, sx = quantize_activation(x.cpu())
    if op == "linear":
        assert_equal(env["out"], reference_out(qx, sx, ws, "w0", dtype), f"fallback T={T} K={K}")
    else:
        # gate and up from the CPU's exact reference; silu and the product on the GPU as the call does
        g, u = (reference_out(qx, sx, ws, w, dtype).cuda() for w in ("wg", "wu"))
        want = torch.nn.functional.silu(g).mul_(u)
        assert_equal(env["out"], want, f"fallback silu T={T} K={K}")


# -- the kernel that quantises x in its own prologue ---------------------------------------------------

def lower_xq(G, nid, dtype, variant, n):
    """(the prologue kernel for up to n tokens, the quantiser + int8 kernel pair it replaces)."""
    warps, rt, unroll = variant
    opts = Options(dtype=dtype, tuning=Tuning(linear=LinearTuning(i8_prologue_upto=n)))
    steps = linear_skinny.lower(nid, G, opts, warps=warps, row_tiles=rt, unroll=unroll)
    xq = steps[0]
    assert isinstance(xq, KernelLaunch) and xq.params.get("xq") == n and not xq.workspace, xq.name
    return xq, lower_int8(G, nid, dtype, variant)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS),
       n=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS, rows=st.lists(HEIGHTS, min_size=1, max_size=3),
       silu=st.booleans(), variant=st.sampled_from(VARIANTS), extra=st.sampled_from([0, 0, 1, 8]),
       offset=st.integers(0, 8), shift=st.sampled_from(["none", "none", "x", "w"]), kind=st.sampled_from(ROW_KINDS),
       seed=st.integers(0, 2**31))
# V2-Lite's q + kv_a, o, shared experts at b=1 and at N; odd K (element loads); V3's dense down at N = 4
@example(dtype="bf16", T=1, n=4, K=2048, rows=[3072, 576], silu=False, variant=VARIANTS[0], extra=0, offset=0,
         shift="none", kind="random", seed=1)
@example(dtype="bf16", T=4, n=4, K=2048, rows=[2048], silu=False, variant=VARIANTS[0], extra=0, offset=0,
         shift="none", kind="ties", seed=2)
@example(dtype="bf16", T=16, n=16, K=2048, rows=[2816], silu=True, variant=VARIANTS[0], extra=0, offset=0,
         shift="none", kind="random", seed=3)
@example(dtype="fp16", T=3, n=5, K=1001, rows=[17, 130, 5], silu=False, variant=VARIANTS[4], extra=1, offset=1,
         shift="x", kind="ties", seed=4)
@example(dtype="bf16", T=2, n=4, K=2816, rows=[2048], silu=False, variant=VARIANTS[0], extra=8, offset=8,
         shift="none", kind="zeros", seed=5)
@example(dtype="bf16", T=4, n=4, K=18432, rows=[256], silu=False, variant=VARIANTS[0], extra=0, offset=0,
         shift="none", kind="huge", seed=6)
def test_linear_int8_prologue_equals_the_quantiser_and_kernel(dtype, T, n, K, rows, silu, variant, extra, offset,
                                                             shift, kind, seed):
    """At T <= n the prologue kernel's outputs are bit-equal to the pair's on the same x (x a view whose
    parent has one more row, ten times larger, after the last: a read past row T - 1 shows)."""
    n = max(n, T)
    if not linear_skinny.xq_fits(K, n, variant[0] or 8, variant[1] or 1, Options()):
        n = T
    gen = torch.Generator().manual_seed(seed)
    if silu:   # rows past the 16-bit range would meet silu's -inf / inf (NaN) in both launches: plain rows
        rows, kind = rows[:1] * 2, "random" if kind in ("ties", "huge") else kind
        G, nid = single_op_graph(model("lite"), "gate_up_silu", {"out_dim": rows[0]}, {"x": act(K)},
                                 {"gate": "w0", "up": "w1"})
        as_int8(G)
    else:
        G, nid = graph(rows, K)
    outs = G.nodes[nid]["outputs"]
    xq, (quant, launch) = lower_xq(G, nid, dtype, variant, n)
    names = [f"w{i}" for i in range(len(rows))]
    ws = int8_weights(names, rows, K, gen)
    if silu:
        ws["w1_scale"] = ws["w1_scale"] / 4   # gate over a few units (silu's curve), up near one
    if shift == "w":
        ws["w0"] = shifted(ws["w0"])
    parent = x_view(T + 1, K, dtype, extra, offset, gen)
    parent[T] *= 10
    x = special_rows(parent[:T], kind, gen)
    if shift == "x":
        x = shifted(x.contiguous())
    widths = rows[:1] if silu else rows
    got = {o: empty_out((T, w), dtype) for o, w in zip(outs, widths)}
    runner().run_all([xq], values={"x": x, **got}, weights=ws, sizes={"T": T})
    want = {o: empty_out((T, w), dtype) for o, w in zip(outs, widths)}
    runner().run_all([quant, launch], values={"x": x, **want}, weights=ws, sizes={"T": T}, workspaces=workspaces(T, K))
    torch.cuda.synchronize()
    where = f"T={T} n={n} K={K} rows={rows} silu={silu} variant={variant} shift={shift} kind={kind}"
    for o in outs:
        assert_equal(got[o], want[o], f"prologue vs pair {o} {where}")
    if not silu:
        qx, sx = quantize_activation(x.cpu())
        for o, name in zip(outs, names):
            assert_equal(got[o], reference_out(qx, sx, ws, name, dtype), f"prologue vs reference {o} {where}")
