"""Property tests: the skinny linear kernel (linear_skinny: linear, multi_linear and gate_up_silu at
T <= 16 tokens) against the ops' reference semantics (float64 on the kernel's own rounded inputs;
gate_up_silu's also rounding gate, up and silu(gate) where the kernel does).

Hypothesis draws the token count (1..16: one and two n8 tiles), the reduction width K (odd ones,
ones that leave some warps without a 32-wide step, multiples and neighbours of the CTA's 256-wide
round), one to four stacked weights of odd heights (tiles straddle two weights), the dtype, x as a
strided view (row stride K + extra, starting `offset` elements in) and `shift`: a weight or x one
element past an aligned allocation, so the CTA's alignment test sends it to the element loads.
Outputs are poisoned (NaN): an element the kernel does not write fails.  The kernel's shape
(warps, row tiles, unroll, cluster split of K) is drawn too, among the variants
bench/perf_linear.py times, so whichever the H200 picks is tested.  Fixed regression cases sit beside the test as @example."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import TORCH_DTYPES, shifted, tolerance
from kernel_cases import DTYPES, Recorder, act, empty_out, kernel_test, model, rand, reference, runner, single_op_graph

from codegen.families import linear_skinny
from codegen.kernel import KernelLaunch, Options
from codegen.tuning import LinearTuning

SETTINGS = kernel_test(40)
REC = Recorder("linear_skinny")
REC_SILU = Recorder("linear_skinny gate_up_silu")
# (warps, row tiles, unroll, cluster): the default and the variants perf_linear.py times
VARIANTS = ((LinearTuning().warps, LinearTuning().row_tiles, LinearTuning().unroll, LinearTuning().ksplit),
            (8, 1, 2, 1), (8, 1, 8, 1), (4, 1, 4, 1), (8, 2, 2, 1), (16, 1, 2, 1), (8, 1, 4, 2), (8, 1, 2, 4))
WIDTHS = st.one_of(st.sampled_from([1, 7, 8, 9, 31, 32, 33, 40, 255, 256, 257, 264, 511, 512, 2048, 2049, 2816]),
                   st.integers(1, 3000))
HEIGHTS = st.one_of(st.sampled_from([1, 15, 16, 17, 31, 33, 576]), st.integers(1, 300))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC.report()
    REC_SILU.report()


def x_view(T, K, dtype, extra, offset, gen):
    """x [T, K] as a view into a [T, K + extra] parent, `offset` elements in (row stride K + extra)."""
    offset = min(offset, extra)
    return rand((T, K + extra), dtype, gen=gen, scale=3.0)[:, offset:offset + K]


def run_case(dtype, T, K, rows, extra, offset, shift, variant, seed):
    """One launch of linear_skinny (a linear when len(rows) == 1, else a multi_linear) on poisoned
    outputs, checked against the op's reference; returns the outputs."""
    m = model("lite")
    gen = torch.Generator().manual_seed(seed)
    if len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"})
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
    outs = G.nodes[nid]["outputs"]
    # x spans about +-3 and each weight about +-1 / sqrt(K): outputs near unit size at any K
    x = x_view(T, K, dtype, extra, offset, gen)
    ws = {f"w{i}": rand((n, K), dtype, gen=gen, scale=K ** -0.5) for i, n in enumerate(rows)}
    if shift == "x":
        x = shifted(x.contiguous())
    elif shift == "w":
        ws["w0"] = shifted(ws["w0"])
    ys = {o: empty_out((T, n), dtype) for o, n in zip(outs, rows)}
    warps, rt, unroll, ks = variant
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype), warps=warps, row_tiles=rt, unroll=unroll, ksplit=ks)
    launches = [s for s in steps if isinstance(s, KernelLaunch)]
    assert len(launches) == 1 and len(steps) == 2 and steps[1].from_tokens == linear_skinny.SKINNY_MAX_TOKENS + 1
    runner().run_all(launches, values={"x": x, **ys}, weights=ws, sizes={"T": T})
    torch.cuda.synchronize()
    refs = reference(G, nid, [x], ws)
    for o, ref in zip(outs, refs):
        REC.check(ys[o], ref, dtype, f"{o} T={T} K={K} rows={list(rows)} variant={variant} shift={shift}")
    REC.example()
    return [ys[o] for o in outs]


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS,
       rows=st.lists(HEIGHTS, min_size=1, max_size=4), extra=st.sampled_from([0, 0, 1, 3, 8, 64]),
       offset=st.integers(0, 64), shift=st.sampled_from(["none", "none", "x", "w"]),
       variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**31))
# V2-Lite's fused q + kv_a at decode b=1 and b=16, the shared gate + up at b=9 (the second n8 tile)
@example(dtype="bf16", T=1, K=2048, rows=[3072, 576], extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=1)
@example(dtype="bf16", T=16, K=2048, rows=[3072, 576], extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=2)
@example(dtype="fp16", T=9, K=2048, rows=[2816, 2816], extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=3)
# o_proj off a strided view, the shared down projection (K = 2816: a partial last round of warps)
@example(dtype="bf16", T=8, K=2048, rows=[2048], extra=64, offset=8, shift="none", variant=VARIANTS[0], seed=4)
@example(dtype="bf16", T=3, K=2816, rows=[2048], extra=0, offset=0, shift="none", variant=VARIANTS[4], seed=5)
# odd K (element loads only), tiles straddling three weights, an unaligned x and an unaligned weight
@example(dtype="bf16", T=7, K=41, rows=[17, 5, 30], extra=3, offset=1, shift="none", variant=VARIANTS[1], seed=6)
@example(dtype="fp16", T=16, K=264, rows=[33, 15], extra=0, offset=0, shift="x", variant=VARIANTS[0], seed=7)
@example(dtype="bf16", T=2, K=512, rows=[100], extra=0, offset=0, shift="w", variant=VARIANTS[3], seed=8)
# fp32 on CUDA cores: aligned, odd and unaligned
@example(dtype="fp32", T=16, K=2048, rows=[64, 64], extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=9)
@example(dtype="fp32", T=5, K=37, rows=[9], extra=2, offset=1, shift="x", variant=VARIANTS[5], seed=10)
# K split over clusters of 2 and 4 CTAs (distributed shared memory): V2-Lite's o_proj, an odd fp32 one
@example(dtype="bf16", T=11, K=2048, rows=[2048], extra=0, offset=0, shift="none", variant=VARIANTS[6], seed=12)
@example(dtype="fp16", T=4, K=2816, rows=[40, 9], extra=8, offset=8, shift="none", variant=VARIANTS[7], seed=13)
@example(dtype="fp32", T=16, K=99, rows=[33], extra=0, offset=0, shift="w", variant=VARIANTS[7], seed=14)
# K below one step: most warps have nothing to do
@example(dtype="bf16", T=12, K=7, rows=[20], extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=11)
def test_linear_skinny(dtype, T, K, rows, extra, offset, shift, variant, seed):
    run_case(dtype, T, K, rows, extra, offset, shift, variant, seed)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), seed=st.integers(0, 2**31))
def test_multi_linear_equals_its_linears(dtype, T, seed):
    """Stacking changes nothing: each output of a multi_linear is bitwise the output of its weight's
    own linear launch (3072 rows are whole 16-row tiles, so every row sits at the same place of its
    tile and is summed in the same order either way)."""
    K, rows = 2048, [3072, 576]
    fused = run_case(dtype, T, K, rows, 0, 0, "none", VARIANTS[0], seed)
    gen = torch.Generator().manual_seed(seed)   # the same draws as run_case
    x = x_view(T, K, dtype, 0, 0, gen)
    ws = {f"w{j}": rand((m, K), dtype, gen=gen, scale=K ** -0.5) for j, m in enumerate(rows)}
    for i, (n, y) in enumerate(zip(rows, fused)):
        G, nid = single_op_graph(model("lite"), "linear", {"out_dim": n}, {"x": act(K)}, {"weight": f"w{i}"})
        (la, _) = linear_skinny.lower(nid, G, Options(dtype=dtype))
        alone = empty_out((T, n), dtype)
        runner().run_all([la], values={"x": x, "out": alone}, weights={f"w{i}": ws[f"w{i}"]}, sizes={"T": T})
        torch.cuda.synchronize()
        assert torch.equal(alone, y), f"weight {i}"


def silu_reference(x, wg, wu, dtype):
    """gate_up_silu as the kernel rounds it (and the unfused linear, linear, silu_and_mul do): gate
    and up in float64 from the rounded inputs, each rounded to the activation type, silu(gate)
    rounded; their product in float64 (the kernel rounds it once more: within the tolerance)."""
    td = TORCH_DTYPES[dtype]
    g = (x.double() @ wg.double().T).to(td).double()
    u = (x.double() @ wu.double().T).to(td).double()
    s = (g * torch.sigmoid(g)).to(td).double()
    return s * u


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(1, linear_skinny.SKINNY_MAX_TOKENS), K=WIDTHS, n=HEIGHTS,
       extra=st.sampled_from([0, 0, 1, 8]), offset=st.integers(0, 8), shift=st.sampled_from(["none", "none", "x", "w"]),
       variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**31))
# V2-Lite's shared experts (n = 2816) at b=1 and b=16, the dense FFN's gate + up (n = 10944)
@example(dtype="bf16", T=1, K=2048, n=2816, extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=1)
@example(dtype="bf16", T=16, K=2048, n=2816, extra=0, offset=0, shift="none", variant=VARIANTS[0], seed=2)
@example(dtype="fp16", T=9, K=2048, n=10944, extra=0, offset=0, shift="none", variant=VARIANTS[4], seed=3)
# odd widths (n = 13: the last tile's columns past n), unaligned x, a cluster variant, fp32
@example(dtype="bf16", T=5, K=41, n=13, extra=1, offset=1, shift="none", variant=VARIANTS[1], seed=4)
@example(dtype="fp16", T=12, K=264, n=40, extra=0, offset=0, shift="x", variant=VARIANTS[6], seed=5)
@example(dtype="fp32", T=16, K=99, n=17, extra=0, offset=0, shift="w", variant=VARIANTS[7], seed=6)
def test_gate_up_silu(dtype, T, K, n, extra, offset, shift, variant, seed):
    """The fused shared-expert / dense-FFN gate + up with SwiGLU in the epilogue: gate row c and up
    row c sit in one 16-row tile (rows g and g + 8 of the mma), so one thread holds both."""
    m = model("lite")
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(m, "gate_up_silu", {"out_dim": n}, {"x": act(K)}, {"gate": "wg", "up": "wu"})
    x = x_view(T, K, dtype, extra, offset, gen)
    # gate spans a few units (silu's curve, not just its linear part), up near one
    wg = rand((n, K), dtype, gen=gen, scale=2 * K ** -0.5)
    wu = rand((n, K), dtype, gen=gen, scale=K ** -0.5)
    if shift == "x":
        x = shifted(x.contiguous())
    elif shift == "w":
        wu = shifted(wu)
    out = empty_out((T, n), dtype)
    warps, rt, unroll, ks = variant
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype), warps=warps, row_tiles=rt, unroll=unroll, ksplit=ks)
    launches = [s for s in steps if isinstance(s, KernelLaunch)]
    assert len(launches) == 1 and steps[-1].op == "gate_up_silu"
    runner().run_all(launches, values={"x": x, "out": out}, weights={"wg": wg, "wu": wu}, sizes={"T": T})
    torch.cuda.synchronize()
    ref = silu_reference(x, wg, wu, dtype)
    REC_SILU.check(out, ref, dtype, f"T={T} K={K} n={n} variant={variant} shift={shift}")
    # and the op's own reference semantics (float64 throughout) within the element-wise tolerance
    torch.testing.assert_close(out.double().cpu(), reference(G, nid, [x], {"wg": wg, "wu": wu})[0].cpu(),
                               rtol=tolerance(dtype)[0], atol=tolerance(dtype)[1])
    REC_SILU.example()
