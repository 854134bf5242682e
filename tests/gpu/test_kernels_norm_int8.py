"""Property tests: the RMSNorms' "qi8" variants (Tuning.linear.norm_int8; ir/passes/fuse_norm_int8_quant.py,
templates/include/norm_quant.cuh), which also write their int8 readers' rows.  Everything compared is exact:

- the int8 rows (their zero padding included) and the float32 scales equal quantize_activation's
  (ir/formats_int.py) on the norm's own output h, as the kernel stored it -- and, up to 16 tokens, the bytes
  and scales the int8 linears' own quantiser launch (linear_skinny quant_int8) writes from that h;
- h (and fused_add_rms_norm's / the combine's sum s) bit-equal to the plain norm kernel's on the same inputs:
  writing the rows changes nothing else.

Hypothesis draws the op (rms_norm, fused_add_rms_norm, moe_combine_residual_rms_norm), the dtype (bf16, fp16),
T (1..80), the width (odd ones: element loads and byte stores; V2-Lite's 2048, V3's 7168), x as a strided view
with an offset (misaligned rows), the norm weight's scale (large: the row's max at int8's edge), rows of
zeros.  Outputs and rows are poisoned first.  Planted mutants (tests/gpu/test_mutants.py): the scale x1.01,
the scale one ulp up, the max taken over values up to half a bf16 ulp larger (as over the unrounded row),
the padding not zeroed.

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_norm_int8.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import GPU_MARKS, TORCH_DTYPES, poison
from kernel_cases import act, kernel_test, model, rand, runner, single_op_graph
from test_kernels_linear import x_view
from test_kernels_linear_int8 import assert_equal, graph, lower_int8, workspaces

from codegen.families import family_for_op, linear_skinny
from codegen.kernel import Options
from codegen.tuning import LinearTuning, Tuning
from ir.formats_int import qrow, quantize_activation
from ir.ops import TType
from ir.passes.norm_rows import give_rows

pytestmark = GPU_MARKS
SETTINGS = kernel_test(40)
ON = Tuning(linear=LinearTuning(norm_int8=True))
NORM_OPS = ("rms_norm", "fused_add_rms_norm", "moe_combine_residual_rms_norm")
WIDTHS = st.one_of(st.sampled_from([1, 7, 8, 15, 16, 17, 41, 512, 1001, 1536, 2048, 5120, 7168]),
                   st.integers(1, 3000))
PAIRS = 3     # moe_combine_residual_rms_norm: expert outputs a token


def _inputs(op: str, T: int, n: int, dtype: str, extra: int, offset: int, zeros: bool, gen):
    """(input types, input tensors) of the norm op: x as a strided view (rms_norm, the add's first operand)."""
    tdt = TORCH_DTYPES[dtype]
    if op == "moe_combine_residual_rms_norm":
        types = {"eo": TType((f"T*{PAIRS}", n), "act"), "rw": TType(("T", PAIRS), "f32"), "sh": act(n), "res": act(n)}
        ins = [rand((T * PAIRS, n), dtype, gen=gen), (torch.rand(T, PAIRS, generator=gen) * (2.0 / PAIRS)).cuda(),
               rand((T, n), dtype, gen=gen), rand((T, n), dtype, gen=gen)]
    else:
        types = {f"x{i}": act(n) for i in range(1 if op == "rms_norm" else 2)}
        ins = [x_view(T, n, dtype, extra, offset, gen)]
        if op == "fused_add_rms_norm":
            ins.append(rand((T, n), dtype, gen=gen))
    if zeros:   # token 0's row all zeros (its scale 0, its rows 0)
        for t in ins:
            if t.dtype == tdt:
                t[: PAIRS if t.shape[0] == T * PAIRS else 1] = 0
    return types, ins


def run_norm(op, dtype, T, n, extra, offset, wscale, zeros, seed, *, rows: bool) -> dict:
    """The norm's outputs (poisoned first) from its qi8 variant (rows) or its plain kernel, by value name."""
    gen = torch.Generator().manual_seed(seed)
    types, ins = _inputs(op, T, n, dtype, extra, offset, zeros, gen)
    G, nid = single_op_graph(model("lite"), op, {}, types, {"weight": "w"})
    if rows:
        nid = give_rows(G, nid, "int8")
    w = ((torch.rand(n, generator=gen) + 0.5) * wscale).to(TORCH_DTYPES[dtype]).cuda()
    values = dict(zip(types, ins))
    outs = G.nodes[nid]["outputs"]
    for o in outs:
        t = G.graph["values"][o]
        if t.dtype == "i32":
            values[o] = torch.full((T, t.shape[1]), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
        elif t.dtype == "f32":
            values[o] = poison(torch.empty(T, device="cuda"))
        else:
            values[o] = poison(torch.empty(T, n, dtype=TORCH_DTYPES[dtype], device="cuda"))
    launches = family_for_op(op).lower(nid, G, Options(dtype=dtype, tuning=ON))
    assert [s.name.endswith("__qi8") for s in launches] == [rows]
    runner().run_all(launches, values=values, weights={"w": w}, sizes={"T": T, "NP": T * PAIRS})
    torch.cuda.synchronize()
    return {o: values[o] for o in outs}


@SETTINGS
@given(op=st.sampled_from(NORM_OPS), dtype=st.sampled_from(("bf16", "fp16")), T=st.integers(1, 80), n=WIDTHS,
       extra=st.sampled_from([0, 0, 1, 8]), offset=st.integers(0, 8), wscale=st.sampled_from([1.0, 1.0, 40.0]),
       zeros=st.booleans(), seed=st.integers(0, 2**31))
@example(op="rms_norm", dtype="bf16", T=1, n=2048, extra=0, offset=0, wscale=1.0, zeros=False, seed=1)
@example(op="fused_add_rms_norm", dtype="bf16", T=16, n=2048, extra=0, offset=0, wscale=40.0, zeros=True, seed=2)
@example(op="moe_combine_residual_rms_norm", dtype="bf16", T=5, n=2048, extra=0, offset=0, wscale=1.0, zeros=False,
         seed=3)
@example(op="rms_norm", dtype="fp16", T=9, n=1001, extra=1, offset=1, wscale=1.0, zeros=True, seed=4)
@example(op="fused_add_rms_norm", dtype="fp16", T=33, n=7168, extra=8, offset=8, wscale=1.0, zeros=False, seed=5)
@example(op="moe_combine_residual_rms_norm", dtype="bf16", T=3, n=41, extra=0, offset=0, wscale=40.0, zeros=True,
         seed=6)
def test_norm_int8_rows_equal_the_quantisers(op, dtype, T, n, extra, offset, wscale, zeros, seed):
    got = run_norm(op, dtype, T, n, extra, offset, wscale, zeros, seed, rows=True)
    plain = run_norm(op, dtype, T, n, extra, offset, wscale, zeros, seed, rows=False)
    names = list(got)
    h, q, s = got[names[0]], got[names[-2]], got[names[-1]]
    for o in plain:   # h (and s) unchanged by the rows
        assert_equal(got[o], plain[o], f"{op} output {o} against the plain kernel T={T} n={n}")
    rows = q.view(torch.int8)
    assert rows.shape == (T, qrow(n))
    want_q, want_s = quantize_activation(h.cpu())
    assert_equal(rows[:, :n], want_q, f"{op} int8 rows T={T} n={n}")
    assert_equal(rows[:, n:], torch.zeros_like(rows[:, n:]), f"{op} int8 row padding T={T} n={n}")
    assert_equal(s, want_s.reshape(-1), f"{op} scales T={T} n={n}")
    if T <= linear_skinny.SKINNY_MAX_TOKENS:   # the quantiser launch the readers ran before, on this h
        Gq, nq = graph([64], n)
        quant, _ = lower_int8(Gq, nq, dtype, (None, None, None))
        ws = runner().run_all([quant], values={"x": h}, sizes={"T": T}, workspaces=workspaces(T, n))
        torch.cuda.synchronize()
        assert_equal(q, ws["x_int8"], f"{op} rows against the quantiser launch T={T} n={n}")
        assert_equal(s, ws["x_scale"], f"{op} scales against the quantiser launch T={T} n={n}")
