"""Property tests: Tuning.linear.gemm_multi -- a multi_linear's dense one-byte GEMMs (gemm_fp8, gemm_int8) as ONE
launch (templates/include/gemm_multi.cuh), each part's CTAs running its own launch's tile walk.

Each example runs the node's launches twice on the same x and weights, knob off (a GEMM launch a weight) and on
(one), outputs and workspaces poisoned each time, and wants:
  * every part's output BIT-EQUAL to its own launch's (the same sums in the same order: the one launch's part p
    is its own launch's CTAs, split counts and split-order partial sums);
  * and to the reference, as the single GEMMs' tests check them: FP8 against the FP8 product of the kernel's
    own quantised x within the 16-bit tolerance plus the tensor cores' accumulation slack
    (test_kernels_gemm_fp8.py), int8 bit for bit (test_kernels_gemm_int8.py).

Hypothesis draws T at decode batches (17..300: split K) and prefill sizes (1000, 2048, 16384: the persistent
walk), 2 to 4 weights (a multi_linear's most) of odd heights (576: kv_a's 64-row last tile), K, the split floor
gemm_split_min_kb (so the parts' split counts vary: 1 to 8 K splits each), the weights issued early or not
and, FP8, the overlapped K loop or not.  V2-Lite's q + kv_a at the decode batches 32 and 128 and at 16384
tokens are explicit examples.  The planted mutant (tests/gpu/test_mutants.py): part 1's tiles scaled by part
0's weight scales.

Run: python3 tests/gpu/run_isolated.py -j 4 tests/gpu/test_kernels_gemm_multi.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

from harness import GPU_MARKS, shifted
from kernel_cases import Recorder, act, empty_out, kernel_test, model, runner, single_op_graph
from test_kernels_gemm_fp8 import ACC_SLACK, abs_products, x_tokens
from test_kernels_gemm_fp8 import check_quantiser as fp8_quantiser
from test_kernels_gemm_fp8 import poisoned_workspaces as fp8_workspaces
from test_kernels_gemm_int8 import check_quantiser as int8_quantiser
from test_kernels_gemm_int8 import linear_graph, reference_out, tokens
from test_kernels_gemm_int8 import poisoned_workspaces as int8_workspaces
from test_kernels_linear_fp8 import as_fp8, quantized
from test_kernels_linear_int8 import ROW_KINDS, assert_equal, int8_weights

from codegen.families import gemm_fp8, gemm_int8, linear_skinny
from codegen.kernel import KernelLaunch, Options
from codegen.tuning import LinearTuning, MoeTuning, Tuning
from ir.act_quant import linear_fp8
from ir.formats import FP8, companion_names

pytestmark = GPU_MARKS
REC = Recorder("gemm_multi fp8")
DTYPES = ("bf16", "fp16")
FIRST = linear_skinny.SKINNY_MAX_TOKENS + 1
TOKENS = st.one_of(st.integers(FIRST, 300), st.sampled_from([32, 64, 128, 129, 256, 1000, 2048, 16384]))
WIDTHS = st.sampled_from([16, 128, 144, 1408, 2048, 2064, 2816])
HEIGHTS = st.one_of(st.sampled_from([1, 63, 64, 65, 128, 129, 576, 1536, 2048, 3072]), st.integers(1, 700))
MAX_MACS = 3 * 10 ** 11     # T * K * sum(O): the references in a second or two
LITE = [3072, 576]          # V2-Lite's q + kv_a (K = 2048)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC.report()


def launches(G, nid, dtype, family, multi, *, early, min_kb, overlap=False):
    """The node's launches above the skinny range (the quantiser, then the GEMMs: one with `multi`), the
    skinny chunks off so that the GEMM serves from 17 tokens."""
    fam = gemm_fp8 if family == "fp8" else gemm_int8
    lin = LinearTuning(fp8_chunks_upto=0, i8_chunks_upto=0, gemm_weights_early=early, gemm_split_min_kb=min_kb,
                       gemm_multi=multi)
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=Tuning(linear=lin,
                                                                          moe=MoeTuning(fp8_overlap=overlap))))
    out = [s for s in steps if isinstance(s, KernelLaunch) and s.family == fam.FAMILY]
    gemms = [la for la in out if la.stage.endswith("wgmma")]
    assert len(gemms) == (1 if multi else len(G.nodes[nid]["attrs"]["out_dims"])), [la.name for la in out]
    assert all(("parts" in la.params) == multi for la in gemms)
    return out


def run_both(family, dtype, T, rows, values, weights, G, nid, outs, shift, workspaces, **knobs):
    """The node's outputs and workspaces with the knob off and on (fresh poisoned outputs and workspaces each)."""
    got = {}
    for multi in (False, True):
        las = launches(G, nid, dtype, family, multi, **knobs)
        ys = {o: shifted(empty_out((T, n), dtype), shift) for o, n in zip(outs, rows)}
        work = runner().run_all(las, values={**values, **ys}, weights=weights, sizes={"T": T},
                                workspaces=workspaces(las))
        torch.cuda.synchronize()
        got[multi] = (ys, work, las)
    return got


def assert_bit_equal(got, outs, msg):
    for o in outs:
        a, b = got[True][0][o], got[False][0][o]
        same = a.view(torch.int16) == b.view(torch.int16)
        assert bool(same.all()), f"{o} {msg}: {int((~same).sum())} elements differ from the part's own launch"


def splits_of(las, T) -> list[int]:
    """The GEMM launches' split counts at T on this GPU (each `splits` / `splits<p>` argument)."""
    from codegen import sizes
    from runtime.launcher import KernelRunner
    env = KernelRunner.step_sizes({"T": T}, {})
    return [sizes.evaluate(a.ref.expr, env) for la in las for a in la.args if a.name.startswith("splits")]


@kernel_test(30)
@given(dtype=st.sampled_from(DTYPES), T=TOKENS, K=WIDTHS, rows=st.lists(HEIGHTS, min_size=2, max_size=4),
       min_kb=st.sampled_from([1, 2, 4, 8]), early=st.booleans(), overlap=st.booleans(),
       zero_rows=st.sampled_from([0, 0, 1]), shift=st.sampled_from([False, False, True]), seed=st.integers(0, 2**31))
@example(dtype="bf16", T=32, K=2048, rows=LITE, min_kb=4, early=True, overlap=True, zero_rows=0, shift=False, seed=1)
@example(dtype="bf16", T=128, K=2048, rows=LITE, min_kb=4, early=True, overlap=True, zero_rows=0, shift=False, seed=2)
@example(dtype="fp16", T=128, K=2048, rows=LITE, min_kb=1, early=False, overlap=False, zero_rows=1, shift=True,
         seed=3)
@example(dtype="bf16", T=16384, K=2048, rows=LITE, min_kb=4, early=True, overlap=True, zero_rows=0, shift=False,
         seed=4)
@example(dtype="bf16", T=200, K=2064, rows=[65, 3072, 1, 576], min_kb=1, early=True, overlap=False, zero_rows=0,
         shift=False, seed=5)
def test_fp8_gemm_multi(dtype, T, K, rows, min_kb, early, overlap, zero_rows, shift, seed):
    assume(T * K * sum(rows) <= MAX_MACS)
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(model("lite"), "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                             {f"weight{i}": f"w{i}" for i in range(len(rows))})
    as_fp8(G)
    outs = G.nodes[nid]["outputs"]
    x = x_tokens(T, K, dtype, 0, 0, zero_rows, gen)
    ws = {}
    for i, n in enumerate(rows):
        ws[f"w{i}"], ws[companion_names(f"w{i}", FP8)[0]] = quantized(n, K, gen, K ** -0.5)
    got = run_both("fp8", dtype, T, rows, {"x": x}, ws, G, nid, outs, shift, lambda las: fp8_workspaces(T, K),
                   early=early, min_kb=min_kb, overlap=overlap)
    msg = (f"T={T} K={K} rows={rows} min_kb={min_kb} early={early} overlap={overlap} "
           f"splits={splits_of(got[False][2], T)}")
    assert_bit_equal(got, outs, msg)
    q, s = fp8_quantiser(x, got[True][1], msg)
    for i, o in enumerate(outs):
        w, sw = ws[f"w{i}"], ws[companion_names(f"w{i}", FP8)[0]]
        REC.check(got[True][0][o], linear_fp8(q, s, w, sw), dtype, f"{o} {msg}",
                  slack=ACC_SLACK * abs_products(q, s, w, sw))
    REC.example()


@kernel_test(30)
@given(dtype=st.sampled_from(DTYPES), T=TOKENS, K=WIDTHS, rows=st.lists(HEIGHTS, min_size=2, max_size=4),
       min_kb=st.sampled_from([1, 2, 4, 8]), early=st.booleans(), kind=st.sampled_from(ROW_KINDS),
       shift=st.sampled_from([False, False, True]), seed=st.integers(0, 2**31))
@example(dtype="bf16", T=32, K=2048, rows=LITE, min_kb=4, early=True, kind="random", shift=False, seed=11)
@example(dtype="bf16", T=128, K=2048, rows=LITE, min_kb=4, early=True, kind="random", shift=False, seed=12)
@example(dtype="fp16", T=128, K=2048, rows=LITE, min_kb=1, early=False, kind="ties", shift=True, seed=13)
@example(dtype="bf16", T=16384, K=2048, rows=LITE, min_kb=4, early=True, kind="random", shift=False, seed=14)
@example(dtype="bf16", T=200, K=2064, rows=[65, 3072, 1, 576], min_kb=1, early=True, kind="zeros", shift=False,
         seed=15)
def test_int8_gemm_multi(dtype, T, K, rows, min_kb, early, kind, shift, seed):
    assume(T * K * sum(rows) <= MAX_MACS)
    gen = torch.Generator().manual_seed(seed)
    G, nid, outs = linear_graph(K, rows)
    names = [f"w{i}" for i in range(len(rows))]
    ws = int8_weights(names, rows, K, gen)
    x = tokens(T, K, dtype, 0, 0, kind, False, gen)
    got = run_both("int8", dtype, T, rows, {"x": x}, ws, G, nid, outs, shift,
                   lambda las: int8_workspaces(T, K, las), early=early, min_kb=min_kb)
    msg = f"T={T} K={K} rows={rows} min_kb={min_kb} early={early} kind={kind} splits={splits_of(got[False][2], T)}"
    assert_bit_equal(got, outs, msg)
    q, s = int8_quantiser(x, got[True][1], msg)
    for o, name in zip(outs, names):
        assert_equal(got[True][0][o], reference_out(q, s, ws, name, dtype), f"{o} {msg}")
