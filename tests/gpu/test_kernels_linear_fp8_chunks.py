"""Property tests: the FP8 skinny kernel in 16-token chunks (Tuning.linear.fp8_chunks_upto, here 128: linear,
multi_linear and gate_up_silu at 17 <= T <= 128, templates/include/fp8_chunks.cuh) against two things:

- the ops' reference on the weights dequantised exactly (float64), within the T <= 16 kernel's tolerance
  (tests/gpu/test_kernels_linear_fp8.py's bodies: same weights, scales, views and misalignments);
- the T <= 16 kernel run on each 16-row chunk of x alone: BIT-equal (each token's arithmetic is that code).

Outputs are poisoned (NaN) and carry 16 guard rows past T that must stay poisoned: a chunk that writes past
T (its token count not clipped) or one row late fails even where the values it writes are right.  The
planted mutants of tests/gpu/test_mutants.py (the output one row late, the last chunk not clipped) run
through this body and must fail it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from kernel_cases import Recorder, act, empty_out, kernel_test, model, reference, runner, single_op_graph
from test_kernels_linear import silu_reference, x_view
from test_kernels_linear_fp8 import DTYPES, VARIANTS, as_fp8, fp8_weights
from harness import shifted

from codegen.families import linear_skinny
from codegen.kernel import KernelLaunch, Options
from codegen.tuning import parse_tune

SETTINGS = kernel_test(30)
REC = Recorder("linear_skinny fp8 chunks")
UPTO = 128
CHUNK = linear_skinny.SKINNY_MAX_TOKENS
GUARD = 16
# K a multiple of 16: the linear table's FP8 case (its rows: the chunks, gemm_fp8) needs whole 16-byte rows
WIDTHS = st.one_of(st.sampled_from([16, 48, 64, 128, 144, 512, 720, 2048, 2064, 2816]),
                   st.integers(1, 200).map(lambda k: 16 * k))
HEIGHTS = st.one_of(st.sampled_from([1, 15, 16, 17, 127, 128, 129, 136, 576]), st.integers(1, 400))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC.report()


def launches(G, nid, dtype, variant) -> tuple[KernelLaunch, KernelLaunch]:
    """(the T <= 16 FP8 skinny launch, the chunked one) of the node under fp8_chunks_upto = UPTO."""
    warps, rt, unroll, ks, pipeline = variant
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=parse_tune([f"linear.fp8_chunks_upto={UPTO}"])),
                                warps=warps, row_tiles=rt, unroll=unroll, ksplit=ks, pipeline=pipeline)
    plain, chunked = [s for s in steps if isinstance(s, KernelLaunch) and s.family == linear_skinny.FAMILY]
    assert "chunk" not in plain.params and chunked.params["chunk"] == CHUNK, (plain.name, chunked.name)
    return plain, chunked


def guarded(T: int, n: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output [T, n], its parent [T + GUARD, n]), all poisoned."""
    parent = empty_out((T + GUARD, n), dtype)
    return parent[:T], parent


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), T=st.integers(CHUNK + 1, UPTO), K=WIDTHS,
       rows=st.lists(HEIGHTS, min_size=1, max_size=3), silu=st.booleans(), extra=st.sampled_from([0, 0, 1, 8, 64]),
       offset=st.integers(0, 64), shift=st.sampled_from(["none", "none", "x", "w"]),
       variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**31))
# V2-Lite's q + kv_a, o_proj, the dense FFN at b=32 / 128 (2 and 8 chunks); a last chunk of 1 token and of 15
@example(dtype="bf16", T=32, K=2048, rows=[3072, 576], silu=False, extra=0, offset=0, shift="none",
         variant=VARIANTS[0], seed=1)
@example(dtype="bf16", T=128, K=2048, rows=[2048], silu=False, extra=0, offset=0, shift="none", variant=VARIANTS[0],
         seed=2)
@example(dtype="bf16", T=33, K=2048, rows=[10944], silu=True, extra=0, offset=0, shift="none", variant=VARIANTS[0],
         seed=3)
@example(dtype="bf16", T=127, K=10944, rows=[2048], silu=False, extra=0, offset=0, shift="none", variant=VARIANTS[0],
         seed=4)
# clusters of 2 and 4 with chunks along y; a strided view; misaligned x (element loads); fp16
@example(dtype="bf16", T=40, K=2048, rows=[2048], silu=False, extra=64, offset=8, shift="none", variant=VARIANTS[8],
         seed=5)
@example(dtype="fp16", T=65, K=720, rows=[136, 40], silu=False, extra=0, offset=0, shift="x", variant=VARIANTS[9],
         seed=6)
@example(dtype="bf16", T=17, K=2064, rows=[200], silu=True, extra=0, offset=0, shift="w", variant=VARIANTS[2],
         seed=7)
def test_linear_skinny_fp8_chunks(dtype, T, K, rows, silu, extra, offset, shift, variant, seed):
    gen = torch.Generator().manual_seed(seed)
    m = model("lite")
    if silu:
        G, nid = single_op_graph(m, "gate_up_silu", {"out_dim": rows[0]}, {"x": act(K)}, {"gate": "wg", "up": "wu"})
        names, heights = ["wg", "wu"], [rows[0]] * 2
    elif len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": act(K)}, {"weight": "w0"})
        names, heights = ["w0"], rows
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": list(rows)}, {"x": act(K)},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))})
        names, heights = [f"w{i}" for i in range(len(rows))], rows
    as_fp8(G)
    outs = G.nodes[nid]["outputs"]
    widths = rows[:1] if silu else rows
    # rows past T in bounds: a chunk that reads them fails by the guard rows it writes, not by a fault
    x = x_view(T + GUARD, K, dtype, extra, offset, gen)[:T]
    ws, ref_ws = fp8_weights(names, heights, K, gen, K ** -0.5)
    if silu:   # gate over a few units (silu's curve), up near one
        ref_ws["wg"] = ref_ws["wg"] * 2
        ws["wg_scale_inv"] = ws["wg_scale_inv"] * 2
    if shift == "x":
        x = shifted(x.contiguous())
    elif shift == "w":
        ws[names[-1]] = shifted(ws[names[-1]])
    plain, chunked = launches(G, nid, dtype, variant)
    ys, parents = {}, {}
    for o, n in zip(outs, widths):
        ys[o], parents[o] = guarded(T, n, dtype)
    runner().run_all([chunked], values={"x": x, **ys}, weights=ws, sizes={"T": T})
    torch.cuda.synchronize()
    what = f"T={T} K={K} rows={list(rows)} silu={silu} variant={variant} shift={shift}"
    for o in outs:
        assert torch.isnan(parents[o][T:].float()).all(), f"{o}: rows past T written ({what})"
    expected = [silu_reference(x, ref_ws["wg"], ref_ws["wu"], dtype)] if silu else reference(G, nid, [x], ref_ws)
    for o, ref in zip(outs, expected):
        REC.check(ys[o], ref, dtype, f"{o} {what}")
    for c0 in range(0, T, CHUNK):   # the T <= 16 kernel on the chunk's rows alone
        tc = min(CHUNK, T - c0)
        small = {o: empty_out((tc, n), dtype) for o, n in zip(outs, widths)}
        runner().run_all([plain], values={"x": x[c0:c0 + tc], **small}, weights=ws, sizes={"T": tc})
        torch.cuda.synchronize()
        for o in outs:
            assert torch.equal(ys[o][c0:c0 + tc], small[o]), f"{o}: chunk at {c0} differs from the T = {tc} kernel"
    REC.example()
