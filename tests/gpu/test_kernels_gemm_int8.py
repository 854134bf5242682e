"""Property tests: the int8 x int8 GEMM of int8 linears above the skinny range (gemm_int8: its quantiser
launch, templates/include/quant_int8.cuh, then the wgmma GEMM, templates/include/gemm_int8.cuh; sm_90a),
T from 17 to 16384, against ir/formats_int.py's definitions.  Integer arithmetic is exact, so the
comparisons are bitwise:

  * the quantiser: its int8 rows and float32 scales equal quantize_activation's (on the CPU, where
    `amax / 127` is a true division) on the kernel's own bf16 / fp16 input, with a first row made of
    rounding ties, zeros, tiny values (a subnormal scale) or huge ones;
  * the GEMM, on the kernel's OWN quantised x (read back from the node's workspaces): outputs equal
    ((float32(acc) * s_w) * s_x) rounded to the activation type, acc the exact sum (float64 sums on the
    GPU, exact) -- and, on small examples, int_linear on the CPU; with
    activations and weights near +-127 so the sums pass 2^24 (a float accumulator would lose bits);
  * gate_up_silu: gate and up exact as above, silu(gate) * up within the bf16 / fp16 tolerance (the
    kernel's expf).

Hypothesis draws T (17 .. 16384: rows past the last 128-row tile), K (multiples of 16: whole 128-byte
K boxes and a partial last one, 144 = 128 + 16, V2-Lite's 10944 = 85.5 boxes, V3's 18432), one or two
stacked weights of odd heights (576: a 64-row last tile), x as a strided view, and a misaligned output
(element stores).  Outputs and workspaces are poisoned first.  Planted mutants (tests/gpu/test_mutants.py):
the next channel's weight scale, the last k32 step dropped, the up rows scaled as their gate, the partial
last K box dropped.

Split K (decode batches, T = 17..256: the tiles fewer than the SMs): most draws split (each example's
split counts are tallied and printed at the end); the int32 partials are summed as integers, so the split
result is held to the same bit-exact reference.  V2-Lite's linears at T = 32 must split (S > 1) and match.
`test_split_int8_gemm_runs_again_the_same` runs a launch twice, after another T (another tile count) and
twice from a captured CUDA graph, outputs and partials poisoned each time, and wants the first run's
output bit for bit.  Its mutants: the ticket never reset, the last split's partial left out of the sum.

Tuning.linear.gemm_weights_early (the first ring stages' weights issued before the PDL wait, split K included):
`test_int8_gemm_weights_early` wants the knob-off outputs bit for bit, eagerly and from a CUDA graph with PDL
replayed for two inputs (gemm_early_cases.py: the wait must still order x).

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gemm_int8.py
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

from harness import GPU_MARKS, TORCH_DTYPES, poison, shifted
from kernel_cases import Recorder, act, empty_out, kernel_test, model, runner, single_op_graph
from test_kernels_linear import x_view
from test_kernels_linear_int8 import I8, ROW_KINDS, as_int8, assert_equal, int8_weights, special_rows

from codegen import sizes
from codegen.families import _gemm_split as gemm_split
from codegen.families import gemm_int8, linear_skinny
from codegen.kernel import KernelLaunch, LibraryCall, Options
from codegen.tuning import LinearTuning, Tuning
from ir.formats import companion_names
from ir.formats_int import int_linear, quantize_activation

pytestmark = GPU_MARKS
SETTINGS = kernel_test(30)
REC_SILU = Recorder("gemm_int8 gate_up_silu")
DTYPES = ("bf16", "fp16")
FIRST = linear_skinny.SKINNY_MAX_TOKENS + 1
TOKENS = st.one_of(st.sampled_from([FIRST, 31, 64, 127, 128, 129, 255, 256, 257, 1000, 2048, 4096, 16384]),
                   st.integers(FIRST, 700))
WIDTHS = st.one_of(st.sampled_from([16, 112, 128, 144, 1408, 2048, 2064, 2816, 10944, 18432]),
                   st.integers(1, 200).map(lambda k: 16 * k))
HEIGHTS = st.one_of(st.sampled_from([1, 8, 63, 64, 65, 127, 128, 129, 200, 576, 2048, 3072]), st.integers(1, 700))
MAX_MACS = 6 * 10 ** 11     # T * K * O: the GPU reference's integer product stays well under a second
CPU_MACS = 3 * 10 ** 7      # and the CPU's int64 one, checked as well below this
SPLITS: Counter = Counter()    # examples by the largest split count of their GEMMs (printed at the end)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC_SILU.report()
    print("\nSPLITS gemm_int8 " + " ".join(f"S={k}:{v}" for k, v in sorted(SPLITS.items())))


def _step_env(T: int) -> dict:
    """The sizes the runner evaluates a launch's expressions with at T on this GPU (its SM count)."""
    from runtime.launcher import KernelRunner
    return KernelRunner.step_sizes({"T": T}, {})


def split_counts(launches, T: int) -> list[int]:
    """The GEMM launches' `splits` at T on this GPU: CTAs a tile (1: no split)."""
    env = _step_env(T)
    return [sizes.evaluate(next(a.ref.expr for a in la.args if a.name == "splits"), env)
            for la in launches if la.stage == "i8_wgmma"]


def gemm_launches(G, nid, dtype, early=False, min_kb=1):
    """The node's launches that run above the skinny range: gemm_int8's quantiser, then its GEMMs (with
    Tuning.linear.gemm_weights_early and gemm_split_min_kb as asked; the int8 skinny kernel's chunks off, so
    the GEMM and its quantiser run from 17 tokens)."""
    tuning = Tuning(linear=LinearTuning(i8_chunks_upto=0, gemm_weights_early=early, gemm_split_min_kb=min_kb))
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=tuning))
    assert not [s for s in steps if isinstance(s, LibraryCall)], "int8 weights above 16 tokens, sm_90a: no library call"
    launches = [s for s in steps if isinstance(s, KernelLaunch) and s.family == gemm_int8.FAMILY]
    assert [la.stage for la in launches[:1]] == ["quant_i8"] and all(la.stage == "i8_wgmma" for la in launches[1:])
    assert all(la.name.endswith("__ew") == early for la in launches[1:]), [la.name for la in launches]
    return launches


def poisoned_workspaces(T, K, launches):
    """The node's workspaces: 0x7f bytes and NaN scales (an element the quantiser does not write fails),
    the split GEMMs' int32 partials 0x7f7f7f7f (a partial summed but never written moves the sum far)."""
    xq = torch.full((T, gemm_int8.qrow(K) // 4), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    (rows,) = {sizes.evaluate(w.shape[0], _step_env(T)) for la in launches for w in la.workspace
               if w.name == gemm_int8.PARTIALS}
    partials = torch.full((rows, gemm_split.PARTIAL_WORDS), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    return {gemm_int8.XQ: xq, gemm_int8.XS: poison(torch.empty(T, device="cuda")), gemm_int8.PARTIALS: partials}


def check_quantiser(x, work, msg):
    """The kernel's quantised x and scales bit-equal to quantize_activation's; returns them (on the GPU)."""
    T, K = x.shape
    q = work[gemm_int8.XQ].view(torch.int8)
    s = work[gemm_int8.XS]
    want_q, want_s = quantize_activation(x.cpu())
    assert_equal(q[:, :K], want_q, f"quantiser q {msg}")
    assert_equal(q[:, K:], torch.zeros_like(q[:, K:]), f"quantiser padding {msg}")
    assert_equal(s, want_s.reshape(-1), f"quantiser s {msg}")
    return q[:, :K].contiguous(), s


def reference_out(q, s, ws, name, dtype):
    """((float32(acc) * s_w) * s_x) in the activation type (int_linear's order and roundings), acc the exact
    integer sum on the GPU: float64 sums, exact (every partial sum is an integer below 2^53; ir's int_matmul
    falls back to them too), so float32(acc) is the correctly rounded integer as int64 -> float32 is."""
    acc = q.to(torch.float64) @ ws[name].to(torch.float64).T
    y = (acc.to(torch.float32) * ws[companion_names(name, I8)[0]].reshape(1, -1)) * s.reshape(-1, 1)
    return y.to(TORCH_DTYPES[dtype])


def tokens(T, K, dtype, extra, offset, kind, big, gen):
    """x [T, K]: a strided view with its first row made `kind` (special_rows); big: one sign a row,
    magnitudes 0.8..1, so the quantised rows sit near +-127 and the sums pass 2^24."""
    if big:
        sign = torch.where(torch.arange(T) % 2 == 0, 1.0, -1.0).reshape(-1, 1)
        return ((torch.rand((T, K), generator=gen) * 0.2 + 0.8) * sign).to("cuda", TORCH_DTYPES[dtype])
    return special_rows(x_view(T, K, dtype, extra, offset, gen), kind, gen)


def linear_graph(K, rows):
    """A linear (one width) or multi_linear node with int8 weights w0, w1, ...: (G, nid, its outputs)."""
    m = model("lite")
    if len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"})
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
    as_int8(G)
    return G, nid, G.nodes[nid]["outputs"]


def run_case(dtype, T, K, rows, extra, offset, kind, big, shift, seed, min_kb=1):
    """Runs the node at T and checks it bit for bit; returns the GEMMs' split counts."""
    gen = torch.Generator().manual_seed(seed)
    G, nid, outs = linear_graph(K, rows)
    names = [f"w{i}" for i in range(len(rows))]
    ws = int8_weights(names, rows, K, gen, big=big)
    x = tokens(T, K, dtype, extra, offset, kind, big, gen)
    ys = {o: shifted(empty_out((T, n), dtype), shift) for o, n in zip(outs, rows)}
    launches = gemm_launches(G, nid, dtype, min_kb=min_kb)
    S = split_counts(launches, T)
    SPLITS[max(S)] += 1
    work = runner().run_all(launches, values={"x": x, **ys}, weights=ws, sizes={"T": T},
                            workspaces=poisoned_workspaces(T, K, launches))
    torch.cuda.synchronize()
    msg = (f"T={T} K={K} rows={list(rows)} extra={extra} offset={offset} kind={kind} big={big} shift={shift} "
           f"splits={S}")
    q, s = check_quantiser(x, work, msg)
    for o, name, n in zip(outs, names, rows):
        want = reference_out(q, s, ws, name, dtype)
        if T * K * n <= CPU_MACS:   # the reference backend's linear on the CPU: the same numbers
            stored, comp = ws[name].cpu(), [ws[c].cpu() for c in companion_names(name, I8)]
            assert torch.equal(int_linear(x.cpu(), stored, comp, I8).to(TORCH_DTYPES[dtype]), want.cpu()), msg
        assert_equal(ys[o], want, f"{o} {msg}")
    return S


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=TOKENS, K=WIDTHS, rows=st.lists(HEIGHTS, min_size=1, max_size=2),
       extra=st.sampled_from([0, 0, 8, 64]), offset=st.integers(0, 64), kind=st.sampled_from(ROW_KINDS),
       big=st.sampled_from([False, False, True]), shift=st.sampled_from([False, False, True]),
       seed=st.integers(0, 2**31))
# V2-Lite: the fused q + kv_a (576: a 64-row last tile) at prefill 32 x 512's step, o_proj at 16384 tokens,
# the dense down (K = 10944: 85.5 boxes) off a strided view, the first T the GEMM serves
@example(dtype="bf16", T=512, K=2048, rows=[3072, 576], extra=0, offset=0, kind="random", big=False, shift=False,
         seed=1)
@example(dtype="bf16", T=16384, K=2048, rows=[2048], extra=0, offset=0, kind="ties", big=False, shift=False, seed=2)
@example(dtype="bf16", T=300, K=10944, rows=[2048], extra=64, offset=8, kind="zeros", big=False, shift=False, seed=3)
@example(dtype="bf16", T=FIRST, K=2064, rows=[129], extra=0, offset=0, kind="random", big=False, shift=False, seed=4)
# one partial K box alone, one output row, a misaligned output, fp16
@example(dtype="fp16", T=129, K=16, rows=[1], extra=8, offset=8, kind="random", big=False, shift=True, seed=5)
@example(dtype="fp16", T=1000, K=2816, rows=[200, 64], extra=0, offset=0, kind="ties", big=False, shift=True, seed=6)
# sums past 2^24 (V3's dense down K = 18432), a partial last box with them, tiny and huge rows
@example(dtype="bf16", T=200, K=18432, rows=[256], extra=0, offset=0, kind="random", big=True, shift=False, seed=7)
@example(dtype="fp16", T=77, K=144, rows=[65], extra=0, offset=0, kind="random", big=True, shift=False, seed=8)
@example(dtype="bf16", T=40, K=720, rows=[136], extra=8, offset=8, kind="tiny", big=False, shift=False, seed=9)
@example(dtype="bf16", T=40, K=720, rows=[136], extra=0, offset=0, kind="huge", big=False, shift=True, seed=10)
# V2-Lite's linears at a decode batch of 32, K split (132 SMs: q 5 ways, kv_a 8, o_proj 8, the dense down 8),
# and at 200 tokens (kv_a's 10 tiles: 8 ways) with sums past 2^24
@example(dtype="bf16", T=32, K=2048, rows=[3072, 576], extra=0, offset=0, kind="random", big=False, shift=False,
         seed=11)
@example(dtype="bf16", T=32, K=2048, rows=[2048], extra=0, offset=0, kind="ties", big=False, shift=False, seed=12)
@example(dtype="bf16", T=32, K=10944, rows=[2048], extra=0, offset=0, kind="random", big=False, shift=False, seed=13)
@example(dtype="fp16", T=200, K=2048, rows=[576], extra=8, offset=8, kind="random", big=True, shift=True, seed=14)
def test_linear_int8_gemm(dtype, T, K, rows, extra, offset, kind, big, shift, seed):
    assume(T * K * sum(rows) <= MAX_MACS)
    run_case(dtype, T, K, rows, extra, offset, kind, big, shift, seed)


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=TOKENS, K=WIDTHS, n=HEIGHTS, extra=st.sampled_from([0, 0, 8]),
       offset=st.integers(0, 8), shift=st.sampled_from([False, False, True]), seed=st.integers(0, 2**31))
# V2-Lite's dense gate + up (n = 10944) and shared experts' (2816); n = 200: a 64-column tile that ends past O
@example(dtype="bf16", T=1000, K=2048, n=10944, extra=0, offset=0, shift=False, seed=1)
@example(dtype="bf16", T=FIRST, K=2048, n=2816, extra=0, offset=0, shift=False, seed=2)
@example(dtype="bf16", T=130, K=2064, n=200, extra=8, offset=8, shift=True, seed=3)
@example(dtype="fp16", T=4096, K=144, n=65, extra=0, offset=0, shift=False, seed=4)
# the shared experts' width at a decode batch: 44 tiles, K split 3 ways (132 SMs)
@example(dtype="bf16", T=32, K=2048, n=2816, extra=0, offset=0, shift=False, seed=5)
def test_gate_up_silu_int8_gemm(dtype, T, K, n, extra, offset, shift, seed):
    """Gate and up each exact (their own channels' scales, rounded to the activation type), then
    silu(gate) rounded, times up."""
    assume(T * K * n * 2 <= MAX_MACS)
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(model("lite"), "gate_up_silu", {"out_dim": n}, {"x": act(K)}, {"gate": "wg", "up": "wu"})
    as_int8(G)
    ws = int8_weights(["wg", "wu"], [n, n], K, gen)
    ws["wu_scale"] = ws["wu_scale"] / 4   # gate over a few units (silu's curve), up near one
    x = x_view(T, K, dtype, extra, offset, gen)
    out = shifted(empty_out((T, n), dtype), shift)
    launches = gemm_launches(G, nid, dtype)
    S = split_counts(launches, T)
    SPLITS[max(S)] += 1
    work = runner().run_all(launches, values={"x": x, "out": out}, weights=ws, sizes={"T": T},
                            workspaces=poisoned_workspaces(T, K, launches))
    torch.cuda.synchronize()
    msg = f"T={T} K={K} n={n} extra={extra} offset={offset} shift={shift} splits={S}"
    q, s = check_quantiser(x, work, msg)
    g = reference_out(q, s, ws, "wg", dtype).double()
    u = reference_out(q, s, ws, "wu", dtype).double()
    expected = (g * torch.sigmoid(g)).to(TORCH_DTYPES[dtype]).double() * u
    REC_SILU.check(out, expected, dtype, msg)
    REC_SILU.example()


# (K, output widths): V2-Lite's q + kv_a (one multi_linear), o_proj, the dense down; a short K of two stages
SPLIT_SHAPES = [(2048, (3072, 576)), (2048, (2048,)), (10944, (2048,)), (256, (640,))]


@pytest.mark.parametrize("shape", SPLIT_SHAPES[:3], ids=["q_kv_a", "o_proj", "dense_down"])
def test_v2_lite_linears_split_at_a_decode_batch_of_32(shape):
    """At T = 32 every V2-Lite linear's GEMM splits K (S > 1 for each of its launches) and stays bit-exact."""
    K, rows = shape
    G, nid, _ = linear_graph(K, rows)
    S = split_counts(gemm_launches(G, nid, "bf16"), 32)
    assert min(S) > 1, f"K={K} rows={list(rows)}: a GEMM does not split K at T = 32 ({S})"
    assert run_case("bf16", 32, K, list(rows), 0, 0, "random", False, False, 21) == S


@pytest.mark.parametrize("min_kb", [4, 8])
def test_fewer_longer_splits_stay_exact(min_kb):
    """Tuning.linear.gemm_split_min_kb: q + kv_a and o_proj at T = 32 and 128 split into at most 16 // min_kb
    K ranges (fewer partials for the last CTA to sum) and stay bit-equal to the reference."""
    for shape in SPLIT_SHAPES[:2]:
        K, rows = shape
        for T in (32, 128):
            S = run_case("bf16", T, K, list(rows), 0, 0, "random", False, False, 23, min_kb=min_kb)
            assert 1 < max(S) <= 16 // min_kb, (shape, T, S)


@kernel_test(8)
@given(dtype=st.sampled_from(DTYPES), T=st.integers(FIRST, 256), shape=st.sampled_from(SPLIT_SHAPES),
       seed=st.integers(0, 2**31))
@example(dtype="bf16", T=32, shape=SPLIT_SHAPES[1], seed=11)
def test_split_int8_gemm_runs_again_the_same(dtype, T, shape, seed):
    """The split GEMM's tickets reset themselves: a second run, a run after a launch of the same kernels at
    another T (another tile count) and two replays of a captured CUDA graph each give the first run's
    output bit for bit, with the outputs and the partials poisoned before every run; the first run bit-equal
    to the reference as in test_linear_int8_gemm."""
    K, rows = shape
    gen = torch.Generator().manual_seed(seed)
    G, nid, outs = linear_graph(K, rows)
    names = [f"w{i}" for i in range(len(rows))]
    ws = int8_weights(names, rows, K, gen)
    launches = gemm_launches(G, nid, dtype)
    S = split_counts(launches, T)
    assert max(S) > 1, f"T={T} K={K} rows={list(rows)}: no GEMM splits K ({S})"

    def problem(t, seed_):
        x = x_view(t, K, dtype, 0, 0, torch.Generator().manual_seed(seed_))
        return x, {o: empty_out((t, n), dtype) for o, n in zip(outs, rows)}

    x, ys = problem(T, seed + 1)
    work = runner().run_all(launches, values={"x": x, **ys}, weights=ws, sizes={"T": T},
                            workspaces=poisoned_workspaces(T, K, launches))
    torch.cuda.synchronize()
    msg = f"T={T} K={K} rows={list(rows)} splits={S}"
    q, s = check_quantiser(x, work, msg)
    first = {}
    for o, name in zip(outs, names):
        assert_equal(ys[o], reference_out(q, s, ws, name, dtype), f"{o} {msg}")
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


@kernel_test(10)
@given(dtype=st.sampled_from(DTYPES), T=st.one_of(st.integers(FIRST, 256), st.sampled_from([128, 1000, 4096])),
       shape=st.sampled_from(SPLIT_SHAPES + [(2048, "silu")]), seed=st.integers(0, 2**31))
# V2-Lite's o_proj, q + kv_a and dense down at the decode batches W4A8 runs them (K split), gate_up_silu
@example(dtype="bf16", T=32, shape=SPLIT_SHAPES[1], seed=61)
@example(dtype="bf16", T=128, shape=SPLIT_SHAPES[0], seed=62)
@example(dtype="bf16", T=32, shape=SPLIT_SHAPES[2], seed=63)
@example(dtype="fp16", T=64, shape=(2048, "silu"), seed=64)
def test_int8_gemm_weights_early(dtype, T, shape, seed):
    """linear.gemm_weights_early: the knob-off outputs bit for bit, eagerly and from a PDL graph replayed for
    two inputs (gemm_early_cases.check_early)."""
    from gemm_early_cases import check_early
    K, rows = shape
    gen = torch.Generator().manual_seed(seed)
    if rows == "silu":
        rows = (1408,)
        G, nid = single_op_graph(model("lite"), "gate_up_silu", {"out_dim": rows[0]}, {"x": act(K)},
                                 {"gate": "wg", "up": "wu"})
        as_int8(G)
        ws = int8_weights(["wg", "wu"], [rows[0], rows[0]], K, gen)
    else:
        G, nid, _ = linear_graph(K, rows)
        ws = int8_weights([f"w{i}" for i in range(len(rows))], rows, K, gen)
    x1, x2 = (x_view(T, K, dtype, 0, 0, gen).contiguous() for _ in range(2))
    outs = {o: empty_out((T, n), dtype) for o, n in zip(G.nodes[nid]["outputs"], rows)}
    off, on = (gemm_launches(G, nid, dtype, early) for early in (False, True))
    check_early(off, on, x1, x2, outs, ws, T, lambda: poisoned_workspaces(T, K, on),
                f"T={T} K={K} rows={list(rows)} splits={split_counts(on, T)}")
