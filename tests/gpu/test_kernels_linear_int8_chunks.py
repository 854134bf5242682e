"""Property tests: the int8 skinny kernel in 16-token chunks (Tuning.linear.i8_chunks_upto, here 128: linear,
multi_linear and gate_up_silu at 17 <= T <= 128 after the quantiser's launch, templates/include/int8_chunks.cuh)
against two things:

- ir/formats_int.py's definitions on the CPU (tests/gpu/test_kernels_linear_int8.py's reference_out: the exact
  int64 sums, then (float(acc) * s_w) * s_x): BIT-equal for linear / multi_linear; gate_up_silu's gate and up
  exact, silu(gate) * up within the int8 test's tolerance (the kernel's expf);
- the T <= 16 kernel (after its quantiser) run on each 16-row chunk of x alone: BIT-equal, every op (each
  token's arithmetic is that code).

Outputs are poisoned (NaN) and carry 16 guard rows past T that must stay poisoned: a chunk that writes past
T (its token count not clipped) or one row late fails even where the values it writes are right.  The
planted mutants of tests/gpu/test_mutants.py (the output one row late, the last chunk not clipped) run
through this body and must fail it.

Run: python3 tests/gpu/run_isolated.py -j 6 tests/gpu/test_kernels_linear_int8_chunks.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import GPU_MARKS, TORCH_DTYPES, shifted
from kernel_cases import Recorder, act, empty_out, kernel_test, model, runner, single_op_graph
from test_kernels_linear import x_view
from test_kernels_linear_int8 import DTYPES, VARIANTS, as_int8, assert_equal, int8_weights, reference_out, workspaces

from codegen.families import linear_skinny
from codegen.kernel import KernelLaunch, Options
from codegen.tuning import parse_tune
from ir.formats_int import quantize_activation

pytestmark = GPU_MARKS
SETTINGS = kernel_test(30)
REC_SILU = Recorder("linear_skinny int8 chunks gate_up_silu")
UPTO = 128
CHUNK = linear_skinny.SKINNY_MAX_TOKENS
GUARD = 16
# K a multiple of 16: the linear table's int8 GEMM case (its rows: the chunks, i8_wgmma) needs 16-byte rows
WIDTHS = st.one_of(st.sampled_from([16, 48, 64, 128, 144, 720, 1408, 2048, 2064, 2816, 10944]),
                   st.integers(1, 200).map(lambda k: 16 * k))
HEIGHTS = st.one_of(st.sampled_from([1, 15, 16, 17, 127, 128, 129, 136, 576]), st.integers(1, 400))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC_SILU.report()


def launches(G, nid, dtype, variant) -> tuple[KernelLaunch, KernelLaunch, KernelLaunch]:
    """(the quantiser, the T <= 16 int8 kernel, the chunked one) of the node under i8_chunks_upto = UPTO (no
    prologue kernel: the pair is what each chunk is compared with)."""
    warps, rt, unroll = variant
    tuning = parse_tune([f"linear.i8_chunks_upto={UPTO}", "linear.i8_prologue_upto=0"])
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=tuning), warps=warps, row_tiles=rt, unroll=unroll)
    quant, plain, chunked = [s for s in steps if isinstance(s, KernelLaunch) and s.family == linear_skinny.FAMILY]
    assert quant.stage == "quant_int8" and "chunk" not in plain.params and chunked.params["chunk"] == CHUNK
    return quant, plain, chunked


def _graph(K, rows, silu):
    m = model("lite")
    if silu:
        G, nid = single_op_graph(m, "gate_up_silu", {"out_dim": rows[0]}, {"x": act(K)}, {"gate": "w0", "up": "w1"})
        heights = [rows[0]] * 2
    elif len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"})
        heights = rows
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
        heights = rows
    as_int8(G)
    return G, nid, [f"w{i}" for i in range(len(heights))], heights


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(CHUNK + 1, UPTO), K=WIDTHS,
       rows=st.lists(HEIGHTS, min_size=1, max_size=3), silu=st.booleans(), big=st.booleans(),
       extra=st.sampled_from([0, 0, 1, 8, 64]), offset=st.integers(0, 64),
       shift=st.sampled_from(["none", "none", "x", "w"]), variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**31))
# V2-Lite's q + kv_a, o_proj, the dense FFN and the shared experts at b=32 / 128 (2 and 8 chunks); a last
# chunk of 1 token and of 15; sums past 2^24
@example(dtype="bf16", T=32, K=2048, rows=[3072, 576], silu=False, big=False, extra=0, offset=0, shift="none",
         variant=VARIANTS[0], seed=1)
@example(dtype="bf16", T=128, K=2048, rows=[2048], silu=False, big=False, extra=0, offset=0, shift="none",
         variant=VARIANTS[0], seed=2)
@example(dtype="bf16", T=33, K=2048, rows=[10944], silu=True, big=False, extra=0, offset=0, shift="none",
         variant=VARIANTS[0], seed=3)
@example(dtype="bf16", T=127, K=10944, rows=[2048], silu=False, big=True, extra=0, offset=0, shift="none",
         variant=VARIANTS[0], seed=4)
@example(dtype="bf16", T=64, K=2816, rows=[2048], silu=False, big=False, extra=0, offset=0, shift="none",
         variant=VARIANTS[0], seed=5)
# other kernel shapes; a strided view; misaligned x (the quantiser's element loads) and weights (byte loads); fp16
@example(dtype="bf16", T=40, K=2048, rows=[2048], silu=False, big=False, extra=64, offset=8, shift="none",
         variant=VARIANTS[4], seed=6)
@example(dtype="fp16", T=65, K=720, rows=[136, 40], silu=False, big=False, extra=0, offset=0, shift="x",
         variant=VARIANTS[5], seed=7)
@example(dtype="bf16", T=17, K=2064, rows=[200], silu=True, big=False, extra=0, offset=0, shift="w",
         variant=VARIANTS[2], seed=8)
def test_linear_skinny_int8_chunks(dtype, T, K, rows, silu, big, extra, offset, shift, variant, seed):
    gen = torch.Generator().manual_seed(seed)
    G, nid, names, heights = _graph(K, rows, silu)
    outs = G.nodes[nid]["outputs"]
    widths = rows[:1] if silu else rows
    ws = int8_weights(names, heights, K, gen, big=big and not silu)
    if silu:   # gate over a few units (silu's curve), up near one
        ws["w1_scale"] = ws["w1_scale"] / 4
    # rows past T in bounds: a chunk that reads them fails by the guard rows it writes, not by a fault
    x = x_view(T + GUARD, K, dtype, extra, offset, gen)[:T]
    if big and not silu:   # one sign a row, magnitudes 0.8..1: quantised to about +-100..127
        sign = torch.where(torch.arange(T) % 2 == 0, 1.0, -1.0).reshape(-1, 1)
        x = ((torch.rand((T, K), generator=gen) * 0.2 + 0.8) * sign).to("cuda", TORCH_DTYPES[dtype])
    if shift == "x":
        x = shifted(x.contiguous())
    elif shift == "w":
        ws[names[-1]] = shifted(ws[names[-1]])
    quant, plain, chunked = launches(G, nid, dtype, variant)
    ys, parents = {}, {}
    for o, n in zip(outs, widths):
        parents[o] = empty_out((T + GUARD, n), dtype)
        ys[o] = parents[o][:T]
    # the quantised rows past T hold finite values (127s, scale 1): a chunk that reads them writes numbers
    work = workspaces(T + GUARD, K)
    work["x_scale"][T:] = 1.0
    runner().run_all([quant, chunked], values={"x": x, **ys}, weights=ws, sizes={"T": T}, workspaces=work)
    torch.cuda.synchronize()
    what = f"T={T} K={K} rows={list(rows)} silu={silu} big={big} variant={variant} shift={shift}"
    for o in outs:
        assert torch.isnan(parents[o][T:].float()).all(), f"{o}: rows past T written ({what})"
    qx, sx = quantize_activation(x.cpu())
    if silu:
        g, u = (reference_out(qx, sx, ws, w, dtype).double() for w in names)
        REC_SILU.check(ys[outs[0]], (g * torch.sigmoid(g)).to(TORCH_DTYPES[dtype]).double() * u, dtype, what)
        REC_SILU.example()
    else:
        for o, name in zip(outs, names):
            assert_equal(ys[o], reference_out(qx, sx, ws, name, dtype), f"{o} {what}")
    for c0 in range(0, T, CHUNK):   # the quantiser and the T <= 16 kernel on the chunk's rows alone
        tc = min(CHUNK, T - c0)
        small = {o: empty_out((tc, n), dtype) for o, n in zip(outs, widths)}
        runner().run_all([quant, plain], values={"x": x[c0:c0 + tc], **small}, weights=ws, sizes={"T": tc},
                         workspaces=workspaces(tc, K))
        torch.cuda.synchronize()
        for o in outs:
            assert_equal(ys[o][c0:c0 + tc], small[o], f"{o}: chunk at {c0} vs the T = {tc} kernel ({what})")
