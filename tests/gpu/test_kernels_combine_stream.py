"""Property test: moe_combine_residual_rms_norm's streaming launches (Tuning.moe.combine_stream_above;
codegen/families/_combine_stream.py, templates/include/moe_combine_stream.cuh) write the plain kernel's outputs
BIT FOR BIT: h, s, and the quantised rows and scales where the norm writes them (int8: linear.norm_int8; e4m3:
linear.norm_fp8).  The streaming kernel sums the same rows in the same order with the same rounding points and
reduces the sum of squares over the same threads, so nothing may differ.

Hypothesis draws T (1..3000, odd T included), the width (V2-Lite's 2048, V3's 7168, small and partial rows), K
and S (the shared experts as pairs, or a shared input), the dtype (fp32 too: its 16-byte slices are 4 floats), the
rows (none, int8, fp8), misaligned inputs (the rows then come from global memory, not the stage), the SM count the
grid is sized for (1, 3 or the device's: from every token in one CTA to one token a CTA), other ranks' pairs
(weight 0, NaN rows: skipped, not multiplied), token sizes spread over 2^8.  Outputs are poisoned first.  Planted
mutants (tests/gpu/test_mutants.py): the next token's copies read the current token's rows; the sums read the
stage without waiting for the copies.

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_combine_stream.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import GPU_MARKS, TORCH_DTYPES, poison, shifted
from kernel_cases import kernel_test, model, runner, single_op_graph
from test_kernels_linear_int8 import assert_equal

from codegen import sizes
from codegen.families import _combine_stream, _norm_quant, family_for_op
from codegen.kernel import Options
from codegen.tuning import LinearTuning, MoeTuning, Tuning
from ir.ops import TType
from ir.passes.norm_rows import give_rows

pytestmark = GPU_MARKS
SETTINGS = kernel_test(30)
OP = "moe_combine_residual_rms_norm"
WIDTHS = st.one_of(st.sampled_from([2048, 7168, 5120, 1408, 144, 40, 41]), st.integers(1, 200).map(lambda k: 16 * k))


def tuning(rows: str | None, stream: bool) -> Tuning:
    """The streaming launch at every T (above 0 tokens) or none; the norm's rows as `rows`."""
    return Tuning(moe=MoeTuning(combine_stream_above=0 if stream else None),
                  linear=LinearTuning(norm_int8=rows == "int8", norm_fp8=rows == "fp8"))


def _inputs(T: int, D: int, K: int, S: int, dtype: str, other_ranks: bool, gen):
    tdt = TORCH_DTYPES[dtype]
    types = {"eo": TType((f"T*{K}", D), "act"), "w": TType(("T", K), "f32")}
    ins = [torch.randn(T * K, D, generator=gen).to(tdt), torch.rand(T, K, generator=gen) * (2.0 / K)]
    if S:
        ins[1][:, K - S:] = 1.0
    if other_ranks:   # another rank's pairs: weight 0 and rows nobody wrote
        gone = torch.rand(T, K, generator=gen) < 0.4
        gone[:, K - S:] = False
        ins[1][gone] = 0.0
        ins[0][gone.reshape(-1)] = float("nan")
    if not S:
        types["shared"] = TType(("T", D), "act")
        ins.append(torch.randn(T, D, generator=gen).to(tdt))
    types["residual"] = TType(("T", D), "act")
    ins.append(torch.randn(T, D, generator=gen).to(tdt))
    size = torch.exp2(torch.rand(T, 1, generator=gen) * 8 - 4)
    ins[-1].mul_(size.to(tdt))
    return types, ins


def run_combine(case: dict, *, stream: bool) -> dict:
    """The node's outputs (poisoned first), by value name, from its streaming launch or its plain one."""
    T, D, K, S, dtype, rows = case["T"], case["D"], case["K"], case["S"], case["dtype"], case["rows"]
    gen = torch.Generator().manual_seed(case["seed"])
    types, ins = _inputs(T, D, K, S, dtype, case["other_ranks"], gen)
    G, nid = single_op_graph(model("lite"), OP, {"shared_experts": S} if S else {}, types, {"weight": "nw"})
    if rows:
        nid = give_rows(G, nid, rows)
    values = {name: shifted(t.cuda(), case["misalign"]) for name, t in zip(types, ins)}
    for o in G.nodes[nid]["outputs"]:
        t = G.graph["values"][o]
        shape = tuple(sizes.evaluate(d, {"T": T}) for d in t.shape)
        if t.dtype == "i32":
            values[o] = torch.full(shape, 0x7F7F7F7F, dtype=torch.int32, device="cuda")
        elif t.dtype == "f32":
            values[o] = poison(torch.empty(shape, device="cuda"))
        else:
            values[o] = poison(torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="cuda"))
    nw = (torch.rand(D, generator=gen) + 0.5).to(TORCH_DTYPES[dtype]).cuda()
    # no reader here: the lowering is asked for the rows a reader multiplying FP8 x FP8 from T = 1 gets
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_norm_quant, "fp8_from", lambda G_, nid_, opts_: 1)
        launches = family_for_op(OP).lower(nid, G, Options(dtype=dtype, tuning=tuning(rows, stream)))
    elem = torch.finfo(TORCH_DTYPES[dtype]).bits // 8   # the plain launch only: partial slices, a stage too big
    streams = stream and D * elem % 16 == 0 and (_combine_stream.stage_bytes(D, K, S, elem)
                                                 + _combine_stream.CTA_RESERVED <= _combine_stream.CTA_SMEM_MAX)
    assert [("stream" in la.params) for la in launches] == [streams], [la.name for la in launches]
    run_sizes = {"T": T, "NP": T * K, **({"SMS": case["sms"]} if case["sms"] else {})}
    runner().run_all(launches, values=values, weights={"nw": nw}, sizes=run_sizes)
    torch.cuda.synchronize()
    return {o: values[o] for o in G.nodes[nid]["outputs"]}


@st.composite
def cases(draw):
    K = draw(st.integers(1, 9))
    D = draw(WIDTHS)
    rows = draw(st.sampled_from((None, "int8", "fp8"))) if D % 16 == 0 else draw(st.sampled_from((None, "int8")))
    dtype = draw(st.sampled_from(("bf16", "fp16", "bf16") + (() if rows else ("fp32",))))   # rows: 16-bit only
    T = draw(st.one_of(st.integers(1, 64), st.integers(1, 1500).map(lambda k: 2 * k + 1)))
    T = min(T, 20_000_000 // (D * (K + 2)) * 2 + 1)   # at most ~80 MB of rows a case
    return {"T": T, "D": D, "K": K,
            "S": draw(st.integers(0, min(3, K - 1))), "dtype": dtype, "rows": rows,
            "misalign": draw(st.sampled_from((False, False, False, True))), "sms": draw(st.sampled_from((1, 3, 0))),
            "other_ranks": draw(st.booleans()), "seed": draw(st.integers(0, 2**31 - 1))}


def _case(T, D, K, S, rows, *, dtype="bf16", misalign=False, sms=0, other_ranks=False, seed=7):
    return {"T": T, "D": D, "K": K, "S": S, "dtype": dtype, "rows": rows, "misalign": misalign, "sms": sms,
            "other_ranks": other_ranks, "seed": seed}


def check_stream_equals_plain(case: dict) -> None:
    got = run_combine(case, stream=True)
    plain = run_combine(case, stream=False)
    for o in plain:
        assert_equal(got[o], plain[o], f"{case}: output {o}, streamed against the plain kernel")


@SETTINGS
@given(case=cases())
@example(case=_case(2999, 2048, 8, 2, "fp8"))                 # V2-Lite's FP8 prefill kernel, several tokens a CTA
@example(case=_case(1001, 2048, 8, 2, None, sms=3))           # 12 CTAs, ~83 tokens each: copies ahead of every norm
@example(case=_case(777, 7168, 9, 1, "fp8", sms=1))           # V3 (896 threads, 140 KB stage), one CTA
@example(case=_case(513, 7168, 8, 0, "int8"))                 # W4A8 V3: the shared input, int8 rows
@example(case=_case(333, 2048, 6, 0, "int8", other_ranks=True, sms=3))
@example(case=_case(65, 2048, 8, 2, "fp8", misalign=True, sms=1))   # unaligned: rows read from global memory
@example(case=_case(1, 41, 3, 1, None, dtype="fp16"))         # odd width: the plain launch only
def test_streamed_combine_is_bit_equal_to_the_plain_kernel(case):
    check_stream_equals_plain(case)
