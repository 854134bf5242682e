"""Property tests: the FP8 x FP8 GEMM of FP8 linears above the skinny range (gemm_fp8: the quantiser
launch, then the wgmma GEMM; sm_90a), T from 17 to 16384.

Two checks an example, each against exact inputs:
  * the quantiser (templates/include/quant_fp8.cuh) against ir/act_quant.py's reference on the same x:
    the scales bit for bit, the e4m3 bytes within one step on at most a few elements (a value on a
    rounding boundary);
  * the GEMM against the FP8 product (ir/act_quant.py linear_fp8, float64) of the kernel's OWN quantised
    x (read back from the node's workspaces) and the FP8 weight bytes and scales: what is left is the
    kernel's fp32 accumulation and its bf16 / fp16 output rounding, so the tolerance is the 16-bit one.

Hypothesis draws T (17 .. 16384), K (multiples of 16: whole blocks and ceil blocks, V2-Lite's 10944 =
85.5 blocks), one or two stacked weights of odd heights (576: kv_a's 64-row ceil block), x as a strided
view, tokens whose scales differ by up to 2^8 (so a scale taken from the wrong token or block moves the
result far past the tolerance), all-zero tokens, and a misaligned output (element stores).  Outputs and
workspaces are poisoned (NaN) first.  The planted mutants of tests/gpu/test_mutants.py (a K block's x
scale from the next token, the ceil K block dropped, the promotion skipped for the last K block, the
quantiser's scale 1% off, the up rows scaled as their gate) run through these bodies and must fail them.

Split K (decode batches, T = 17..256: the tiles fewer than the SMs): most draws split (each example's
split counts are tallied and printed at the end), and V2-Lite's linears at T = 32 are explicit examples.
The split GEMM's tickets reset themselves: `test_split_gemm_runs_again_the_same` runs a launch twice,
after another T (another tile count) and twice from a captured CUDA graph, outputs and partials poisoned
each time, and wants the first run's output bit for bit (the partials are summed in a fixed order).
Its mutants: the ticket never reset, the last split's partial left out of the sum, a split's K range
one block short.

Tuning.moe.fp8_overlap (each K block promoted under the next block's wgmma, split K included):
`test_linear_fp8_gemm_overlap` checks its launch against the reference as above and bit for bit against
the knob-off launch on the same inputs.

Tuning.linear.gemm_weights_early (the first ring stages' weights issued before the PDL wait; overlap off and
on, split K included): `test_fp8_gemm_weights_early` wants the knob-off outputs bit for bit, eagerly and from
a CUDA graph with PDL replayed for two inputs (gemm_early_cases.py: the wait must still order x).

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gemm_fp8.py
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

from harness import TORCH_DTYPES, poison, shifted
from kernel_cases import Recorder, act, empty_out, kernel_test, model, runner, single_op_graph
from test_kernels_linear_fp8 import as_fp8, quantized

from codegen.families import gemm_fp8, linear_skinny
from codegen.kernel import KernelLaunch, LibraryCall, Options
from codegen.tuning import LinearTuning, MoeTuning, Tuning
from ir.act_quant import dequantize_act_fp8, dequantize_weight_fp8, linear_fp8, quantize_act_fp8
from ir.formats import FP8, cdiv, companion_names

SETTINGS = kernel_test(30)
REC = Recorder("gemm_fp8")
REC_SILU = Recorder("gemm_fp8 gate_up_silu")
DTYPES = ("bf16", "fp16")
BLOCK = FP8.block[0]
FIRST = linear_skinny.SKINNY_MAX_TOKENS + 1
TOKENS = st.one_of(st.sampled_from([FIRST, 31, 32, 64, 127, 128, 129, 255, 256, 257, 1000, 2048, 4096, 16384]),
                   st.integers(FIRST, 256), st.integers(FIRST, 700))
WIDTHS = st.one_of(st.sampled_from([16, 112, 128, 144, 1408, 2048, 2064, 2816, 10944]),
                   st.integers(1, 200).map(lambda k: 16 * k))
HEIGHTS = st.one_of(st.sampled_from([1, 8, 63, 64, 65, 127, 128, 129, 200, 576, 2048, 3072]), st.integers(1, 700))
MAX_MACS = 6 * 10 ** 11     # T * K * O: keeps the float64 reference to a second or so
# The FP8 tensor cores add a 128-K block's products with about 14 bits (DeepSeek-V3's report, 3.3.2;
# hence the promotion to fp32 registers per block): an output element may be off by a small multiple
# of 2^-14 of sum |x w| even where it is itself near zero.  Measured on an H100 (2026-12-06): at most
# 8.4e-5 of it (fp16 outputs; T = 257, K = 2256).  2^-12 leaves 3x; the norm-wise check is unchanged.
ACC_SLACK = 2.0 ** -12


SPLITS: Counter = Counter()    # examples by the largest split count of their GEMMs (printed at the end)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC.report()
    REC_SILU.report()
    print("\nSPLITS gemm_fp8 " + " ".join(f"S={k}:{v}" for k, v in sorted(SPLITS.items())))


def split_counts(launches, T: int) -> list[int]:
    """The GEMM launches' `splits` at T on this GPU (the runner's SM count), as the runner evaluates
    them: CTAs a tile (1: no split)."""
    from codegen import sizes
    from runtime.launcher import KernelRunner
    env = KernelRunner.step_sizes({"T": T}, {})
    return [sizes.evaluate(next(a.ref.expr for a in la.args if a.name == "splits"), env)
            for la in launches if la.stage == "fp8_wgmma"]


def gemm_launches(G, nid, dtype, overlap=False, early=False):
    """The node's launches that run above the skinny range: gemm_fp8's quantiser, then its GEMMs (with
    Tuning.moe.fp8_overlap and Tuning.linear.gemm_weights_early as asked; the FP8 skinny kernel's chunks off,
    so the GEMM runs from 17 tokens)."""
    tuning = Tuning(moe=MoeTuning(fp8_overlap=overlap),
                    linear=LinearTuning(fp8_chunks_upto=0, gemm_weights_early=early))
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=tuning))
    assert not [s for s in steps if isinstance(s, LibraryCall)], "FP8 weights above 16 tokens: no library call"
    launches = [s for s in steps if isinstance(s, KernelLaunch) and s.family == gemm_fp8.FAMILY]
    assert [la.stage for la in launches[:1]] == ["quant_x"] and all(la.stage == "fp8_wgmma" for la in launches[1:])
    assert all(la.name.removesuffix("__ew").endswith("__ovl") == overlap and la.name.endswith("__ew") == early
               for la in launches[1:]), [la.name for la in launches]
    return launches


# gate_up_silu's output grows as x squared: its x at 2^-3 of x_tokens' sizes keeps silu(g) * u inside
# fp16's 65504 (|x| reaches ~300 at the widest token and group sizes drawn, where silu(g) * u reached
# 2.4e5), the spread of scales unchanged (a power of two scales exactly)
SILU_X = 2.0 ** -3


def x_tokens(T, K, dtype, extra, offset, zero_rows, gen, scale=1.0):
    """x [T, K] as a view into a [T, K + extra] parent: tokens whose sizes differ by up to 2^8 and
    128-column groups by up to 2^4, so every (token, group) scale differs; `zero_rows` all-zero tokens;
    everything times `scale`."""
    offset = min(offset, extra)
    size = torch.exp2(torch.rand(T, 1, generator=gen) * 8 - 4)
    groups = torch.exp2(torch.rand(1, cdiv(K + extra, BLOCK), generator=gen) * 4 - 2)
    groups = groups.repeat_interleave(BLOCK, 1)[:, :K + extra]
    parent = torch.randn((T, K + extra), generator=gen) * size * groups * scale
    parent[torch.randperm(T, generator=gen)[:zero_rows]] = 0
    return parent.to("cuda", TORCH_DTYPES[dtype])[:, offset:offset + K]


def poisoned_workspaces(T, K):
    """The node's workspaces filled with NaN (e4m3 0x7f and float NaN): an element the quantiser does
    not write fails the comparison."""
    xq = torch.full((T, K // 4), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    xs = torch.full((T, cdiv(K, BLOCK)), float("nan"), dtype=torch.float32, device="cuda")
    return {gemm_fp8.XQ: xq, gemm_fp8.XS: xs}


def check_quantiser(x, work, msg):
    """The kernel's quantised x against the reference's: scales exactly, bytes within one e4m3 step on
    at most a few elements.  Returns the kernel's (q, s), what the GEMM multiplied."""
    T, K = x.shape
    q = work[gemm_fp8.XQ].view(torch.uint8).view(T, K).view(torch.float8_e4m3fn)
    s = work[gemm_fp8.XS]
    q_ref, s_ref = quantize_act_fp8(x)
    assert torch.equal(s, s_ref), f"{msg}: quantiser scales differ from the reference at " \
                                  f"{(s != s_ref).nonzero()[:4].tolist()}"
    a, b = q.view(torch.uint8).int(), q_ref.view(torch.uint8).int()
    ma, mb = a & 0x7F, b & 0x7F                      # e4m3 magnitudes count up in steps of one code
    step = torch.where((a >> 7) == (b >> 7), (ma - mb).abs(), ma + mb)   # across zero: +0 and -0 meet
    off = int((step != 0).sum())
    assert int(step.max()) <= 1 and off <= max(4, x.numel() // 10000), \
        f"{msg}: {off} quantised bytes differ (largest {int(step.max())} steps)"
    return q, s


def run_case(dtype, T, K, rows, extra, offset, zero_rows, shift, seed, overlap=False):
    """One example against the reference; the outputs by name."""
    m = model("lite")
    gen = torch.Generator().manual_seed(seed)
    if len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"})
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
    as_fp8(G)
    outs = G.nodes[nid]["outputs"]
    x = x_tokens(T, K, dtype, extra, offset, zero_rows, gen)
    ws = {}
    for i, n in enumerate(rows):
        ws[f"w{i}"], ws[companion_names(f"w{i}", FP8)[0]] = quantized(n, K, gen, K ** -0.5)
    ys = {o: shifted(empty_out((T, n), dtype), shift) for o, n in zip(outs, rows)}
    launches = gemm_launches(G, nid, dtype, overlap)
    S = split_counts(launches, T)
    SPLITS[max(S)] += 1
    work = runner().run_all(launches, values={"x": x, **ys}, weights=ws, sizes={"T": T},
                            workspaces=poisoned_workspaces(T, K))
    torch.cuda.synchronize()
    msg = (f"T={T} K={K} rows={list(rows)} extra={extra} zero_rows={zero_rows} shift={shift} splits={S} "
           f"overlap={overlap}")
    q, s = check_quantiser(x, work, msg)
    for i, o in enumerate(outs):
        w, sw = ws[f"w{i}"], ws[companion_names(f"w{i}", FP8)[0]]
        REC.check(ys[o], linear_fp8(q, s, w, sw), dtype, f"{o} {msg}", slack=ACC_SLACK * abs_products(q, s, w, sw))
    REC.example()
    return ys


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=TOKENS, K=WIDTHS, rows=st.lists(HEIGHTS, min_size=1, max_size=2),
       extra=st.sampled_from([0, 0, 8, 64]), offset=st.integers(0, 64), zero_rows=st.sampled_from([0, 0, 1, 5]),
       shift=st.sampled_from([False, False, True]), seed=st.integers(0, 2**31))
# V2-Lite: the fused q + kv_a (576: a 64-row ceil block), o_proj at 16384 tokens, the dense down
# (K = 10944: 85.5 blocks) off a strided view, the first T the GEMM serves
@example(dtype="bf16", T=512, K=2048, rows=[3072, 576], extra=0, offset=0, zero_rows=0, shift=False, seed=1)
@example(dtype="bf16", T=16384, K=2048, rows=[2048], extra=0, offset=0, zero_rows=0, shift=False, seed=2)
@example(dtype="bf16", T=300, K=10944, rows=[2048], extra=64, offset=8, zero_rows=1, shift=False, seed=3)
@example(dtype="bf16", T=FIRST, K=2064, rows=[129], extra=0, offset=0, zero_rows=0, shift=False, seed=4)
# one partial K block, one output row, a misaligned output, fp16
@example(dtype="fp16", T=129, K=16, rows=[1], extra=8, offset=8, zero_rows=5, shift=True, seed=5)
@example(dtype="fp16", T=1000, K=2816, rows=[200, 64], extra=0, offset=0, zero_rows=0, shift=True, seed=6)
# V2-Lite's linears at a decode batch of 32, K split (132 SMs: q 5 ways, kv_a 8, o_proj 8, the dense down 8)
@example(dtype="bf16", T=32, K=2048, rows=[3072, 576], extra=0, offset=0, zero_rows=0, shift=False, seed=7)
@example(dtype="bf16", T=32, K=2048, rows=[2048], extra=0, offset=0, zero_rows=1, shift=False, seed=8)
@example(dtype="bf16", T=32, K=10944, rows=[2048], extra=0, offset=0, zero_rows=0, shift=False, seed=9)
@example(dtype="fp16", T=200, K=2048, rows=[576], extra=8, offset=8, zero_rows=0, shift=True, seed=10)
def test_linear_fp8_gemm(dtype, T, K, rows, extra, offset, zero_rows, shift, seed):
    assume(T * K * sum(rows) <= MAX_MACS)
    run_case(dtype, T, K, rows, extra, offset, zero_rows, shift, seed)


@kernel_test(12)
@given(dtype=st.sampled_from(DTYPES), T=TOKENS, K=WIDTHS, rows=st.lists(HEIGHTS, min_size=1, max_size=2),
       zero_rows=st.sampled_from([0, 0, 1, 5]), shift=st.sampled_from([False, False, True]), seed=st.integers(0, 2**31))
# V2-Lite: q + kv_a at 512 tokens (16 K blocks), o_proj at 16384; the dense down split at T = 32 (85.5 blocks
# over 8 splits: odd and even ranges); a ceil block of 16 columns (17 blocks); one block alone
@example(dtype="bf16", T=512, K=2048, rows=[3072, 576], zero_rows=0, shift=False, seed=21)
@example(dtype="bf16", T=16384, K=2048, rows=[2048], zero_rows=0, shift=False, seed=22)
@example(dtype="bf16", T=32, K=10944, rows=[2048], zero_rows=1, shift=False, seed=23)
@example(dtype="fp16", T=FIRST, K=2064, rows=[129], zero_rows=0, shift=True, seed=24)
@example(dtype="bf16", T=300, K=128, rows=[200], zero_rows=5, shift=False, seed=25)
def test_linear_fp8_gemm_overlap(dtype, T, K, rows, zero_rows, shift, seed):
    """moe.fp8_overlap on gemm_fp8: the launch against the reference (run_case), and its outputs the knob-off
    launch's bit for bit (the same FMAs in the same order per accumulator; split K sums the same partials)."""
    assume(T * K * sum(rows) <= MAX_MACS)
    on = run_case(dtype, T, K, rows, 0, 0, zero_rows, shift, seed, overlap=True)
    off = run_case(dtype, T, K, rows, 0, 0, zero_rows, shift, seed)
    for o in on:
        same = on[o].view(torch.int16) == off[o].view(torch.int16)
        assert bool(same.all()), f"{o} T={T} K={K} rows={rows}: {int((~same).sum())} elements differ with the overlap"


def abs_products(q, s, w, sw):
    """sum over k of |x[t, k] w[o, k]| (float64) for the quantised x and weight: the scale of the
    tensor cores' accumulation error at [t, o]."""
    return dequantize_act_fp8(q, s).abs() @ dequantize_weight_fp8(w, sw).abs().T


def silu_slack(g, u, g_slack, u_slack):
    """The accumulation slacks of g and u carried through silu(g) * u: |d silu / dg| <= 1.1, so the
    bound on the product is 1.1 |u| slack(g) + |silu(g)| slack(u) (the products' own rounding is the
    16-bit tolerance's)."""
    return 1.1 * u.abs() * g_slack + (g * torch.sigmoid(g)).abs() * u_slack


# the fast SiLU's relative error (__expf and __fdividef: a few fp32 ulps), far under a 16-bit ulp
FAST_SILU = 2.0 ** -16


def silu_as_rounded(actual, g, u, g_slack, u_slack, td):
    """gate_up_silu as the kernel (and the unfused ops) round it: g and u (the float64 products) each
    rounded to the activation type, silu(g) rounded, their product in float64.  The tensor cores' sums
    may land anywhere within their accumulation slack and the fast SiLU within FAST_SILU, so a rounding
    of g, u or silu(g) near enough a midpoint may fall either way; of the roundings within those bounds,
    the one nearer `actual` (the kernel's) is taken.  One such flip moves an output by an ulp of the
    chain, which on a few hundred elements alone exceeds the norm-wise bound (T = 17, n = 8 reached
    0.0059 in bf16 against a 0.0021 rounding floor)."""
    a, g, u, g_slack, u_slack = (t.detach().double().cpu() for t in (actual, g, u, g_slack, u_slack))

    def roundings(v, band):
        """round(v) and the roundings of v's band's ends: every rounding a value within a band under an
        ulp either side can take (a wider band's further ulps are Recorder.check's slack)."""
        return [(v + d * band).to(td).double() for d in (0, -1, 1)]

    best = None
    for gr in roundings(g, g_slack):
        silu = gr * torch.sigmoid(gr)
        for sr in roundings(silu, silu.abs() * FAST_SILU):
            for ur in roundings(u, u_slack):
                y = sr * ur
                best = y if best is None else torch.where((y - a).abs() < (best - a).abs(), y, best)
    return best


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=TOKENS, K=WIDTHS, n=HEIGHTS, extra=st.sampled_from([0, 0, 8]),
       offset=st.integers(0, 8), shift=st.sampled_from([False, False, True]), seed=st.integers(0, 2**31))
# V2-Lite's dense gate + up (n = 10944) and shared experts' (2816); n = 200: a 64-column tile past the
# first scale block that ends inside it
@example(dtype="bf16", T=1000, K=2048, n=10944, extra=0, offset=0, shift=False, seed=1)
@example(dtype="bf16", T=FIRST, K=2048, n=2816, extra=0, offset=0, shift=False, seed=2)
@example(dtype="bf16", T=130, K=2064, n=200, extra=8, offset=8, shift=True, seed=3)
@example(dtype="fp16", T=4096, K=144, n=65, extra=0, offset=0, shift=False, seed=4)
# the shared experts' width at a decode batch: 44 tiles, K split 3 ways (132 SMs)
@example(dtype="bf16", T=32, K=2048, n=2816, extra=0, offset=0, shift=False, seed=5)
def test_gate_up_silu_fp8_gemm(dtype, T, K, n, extra, offset, shift, seed):
    assume(T * K * n * 2 <= MAX_MACS)
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(model("lite"), "gate_up_silu", {"out_dim": n}, {"x": act(K)}, {"gate": "wg", "up": "wu"})
    as_fp8(G)
    x = x_tokens(T, K, dtype, extra, offset, 0, gen, SILU_X)
    ws = {}
    for name in ("wg", "wu"):
        ws[name], ws[companion_names(name, FP8)[0]] = quantized(n, K, gen, K ** -0.5)
    out = shifted(empty_out((T, n), dtype), shift)
    launches = gemm_launches(G, nid, dtype)
    S = split_counts(launches, T)
    SPLITS[max(S)] += 1
    work = runner().run_all(launches, values={"x": x, "out": out}, weights=ws, sizes={"T": T},
                            workspaces=poisoned_workspaces(T, K))
    torch.cuda.synchronize()
    msg = f"T={T} K={K} n={n} shift={shift} splits={S}"
    q, s = check_quantiser(x, work, msg)
    g, u = linear_fp8(q, s, ws["wg"], ws["wg_scale_inv"]), linear_fp8(q, s, ws["wu"], ws["wu_scale_inv"])
    g_slack = ACC_SLACK * abs_products(q, s, ws["wg"], ws["wg_scale_inv"])
    u_slack = ACC_SLACK * abs_products(q, s, ws["wu"], ws["wu_scale_inv"])
    REC_SILU.check(out, silu_as_rounded(out, g, u, g_slack, u_slack, TORCH_DTYPES[dtype]), dtype, msg,
                   slack=silu_slack(g, u, g_slack, u_slack))
    REC_SILU.example()


# (K, output widths): V2-Lite's q + kv_a (one multi_linear), o_proj, the dense down; a short K of two blocks
SPLIT_SHAPES = [(2048, (3072, 576)), (2048, (2048,)), (10944, (2048,)), (256, (640,))]


@kernel_test(8)
@given(dtype=st.sampled_from(DTYPES), T=st.integers(FIRST, 256), shape=st.sampled_from(SPLIT_SHAPES),
       seed=st.integers(0, 2**31))
@example(dtype="bf16", T=32, shape=SPLIT_SHAPES[1], seed=11)
def test_split_gemm_runs_again_the_same(dtype, T, shape, seed):
    """The split GEMM's tickets reset themselves and its sum has one order: a second run, a run after
    a launch of the same kernels at another T (another tile count) and two replays of a captured CUDA
    graph each give the first run's output bit for bit, with the outputs and the partials poisoned
    (NaN) before every run; the first run against the reference as in test_linear_fp8_gemm."""
    K, rows = shape
    gen = torch.Generator().manual_seed(seed)
    m = model("lite")
    if len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"})
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
    as_fp8(G)
    outs = G.nodes[nid]["outputs"]
    ws = {}
    for i, n in enumerate(rows):
        ws[f"w{i}"], ws[companion_names(f"w{i}", FP8)[0]] = quantized(n, K, gen, K ** -0.5)
    launches = gemm_launches(G, nid, dtype)
    S = split_counts(launches, T)
    assert max(S) > 1, f"T={T} K={K} rows={list(rows)}: no GEMM splits K ({S})"

    def problem(t, seed_):
        x = x_tokens(t, K, dtype, 0, 0, 0, torch.Generator().manual_seed(seed_))
        return x, {o: empty_out((t, n), dtype) for o, n in zip(outs, rows)}

    x, ys = problem(T, seed + 1)
    work = runner().run_all(launches, values={"x": x, **ys}, weights=ws, sizes={"T": T},
                            workspaces=poisoned_workspaces(T, K))
    torch.cuda.synchronize()
    msg = f"T={T} K={K} rows={list(rows)} splits={S}"
    q, s = check_quantiser(x, work, msg)
    first = {}
    for i, o in enumerate(outs):
        w, sw = ws[f"w{i}"], ws[companion_names(f"w{i}", FP8)[0]]
        REC.check(ys[o], linear_fp8(q, s, w, sw), dtype, f"{o} {msg}", slack=ACC_SLACK * abs_products(q, s, w, sw))
        first[o] = ys[o].clone()

    def poison_all():
        for t in (*ys.values(), *work.values()):
            poison(t)

    def same_as_first(what):
        torch.cuda.synchronize()
        for o in outs:
            assert torch.equal(ys[o], first[o]), \
                f"{o} {msg}: {what} differs from the first run at {int((ys[o] != first[o]).sum())} elements"

    def run():
        runner().run_all(launches, values={"x": x, **ys}, weights=ws, sizes={"T": T}, workspaces=work)

    poison_all()
    run()
    same_as_first("a second run")
    T2 = 300 if T <= 128 else 64                    # another tile count (and split count) in between
    x2, ys2 = problem(T2, seed + 2)
    runner().run_all(launches, values={"x": x2, **ys2}, weights=ws, sizes={"T": T2})
    poison_all()
    run()
    same_as_first(f"a run after one at T={T2}")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    for rep in range(2):
        poison_all()
        graph.replay()
        same_as_first(f"graph replay {rep}")
    REC.example()


@kernel_test(10)
@given(dtype=st.sampled_from(DTYPES), T=st.one_of(st.integers(FIRST, 256), st.sampled_from([128, 1000, 4096])),
       shape=st.sampled_from(SPLIT_SHAPES + [(2048, "silu")]), overlap=st.booleans(), seed=st.integers(0, 2**31))
# V2-Lite's o_proj, q + kv_a and dense down at the decode batches the brief measured (K split), gate_up_silu
@example(dtype="bf16", T=32, shape=SPLIT_SHAPES[1], overlap=True, seed=61)
@example(dtype="bf16", T=128, shape=SPLIT_SHAPES[0], overlap=True, seed=62)
@example(dtype="bf16", T=32, shape=SPLIT_SHAPES[2], overlap=False, seed=63)
@example(dtype="fp16", T=64, shape=(2048, "silu"), overlap=True, seed=64)
def test_fp8_gemm_weights_early(dtype, T, shape, overlap, seed):
    """linear.gemm_weights_early: the knob-off outputs bit for bit, eagerly and from a PDL graph replayed for
    two inputs (gemm_early_cases.check_early)."""
    from gemm_early_cases import check_early
    K, rows = shape
    gen = torch.Generator().manual_seed(seed)
    m = model("lite")
    silu = rows == "silu"
    if silu:
        rows, (G, nid) = (1408,), single_op_graph(m, "gate_up_silu", {"out_dim": 1408}, {"x": act(K)},
                                                   {"gate": "w0", "up": "w1"})
        names = ["w0", "w1"]
    elif len(rows) == 1:
        (G, nid), names = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"}), ["w0"]
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
        names = [f"w{i}" for i in range(len(rows))]
    as_fp8(G)
    ws = {}
    for i, name in enumerate(names):
        ws[name], ws[companion_names(name, FP8)[0]] = quantized(rows[min(i, len(rows) - 1)], K, gen, K ** -0.5)
    x1, x2 = (x_tokens(T, K, dtype, 0, 0, 0, gen, SILU_X if silu else 1.0).contiguous() for _ in range(2))
    outs = {o: empty_out((T, n), dtype) for o, n in zip(G.nodes[nid]["outputs"], rows)}
    off, on = (gemm_launches(G, nid, dtype, overlap, early) for early in (False, True))
    check_early(off, on, x1, x2, outs, ws, T, lambda: poisoned_workspaces(T, K),
                f"T={T} K={K} rows={list(rows)} overlap={overlap} splits={split_counts(on, T)}")
