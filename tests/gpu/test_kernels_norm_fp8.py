"""Property tests: the RMSNorms' "qf8" variants (Tuning.linear.norm_fp8; ir/passes/fuse_norm_fp8_quant.py,
templates/include/norm_quant.cuh norm_rows_fp8), which also write their FP8 x FP8 readers' e4m3 rows and
per-128-column scales.  Everything compared is exact:

- the e4m3 rows and the float32 scales equal, bit for bit, what the FP8 GEMMs' own quantiser launch
  (gemm_fp8's quant_x, templates/include/quant_fp8.cuh) writes from the norm's own output h, as stored --
  the bytes the readers read before the knob;
- the scales equal ir/act_quant.py quantize_act_fp8's on that h bit for bit, the bytes within one e4m3
  step on a few elements (tests/gpu/test_kernels_gemm_fp8.py check_quantiser: the same check the quantiser
  launch passes);
- h (and fused_add_rms_norm's / the combine's sum s) bit-equal to the plain norm kernel's on the same inputs:
  writing the rows changes nothing else.

Hypothesis draws the op (rms_norm, fused_add_rms_norm, moe_combine_residual_rms_norm), the dtype (bf16, fp16),
T (1..80), the width (multiples of 16: whole and partial 128-groups; V2-Lite's 2048, V3's 7168), x as a
strided view with an offset (misaligned rows: the row's element loads), the norm weight's scale (large: e4m3's
saturation edge), token sizes spread over 2^8, rows of zeros (the AMAX_FLOOR scale).  Outputs and rows are
poisoned first.  Planted mutants (tests/gpu/test_mutants.py): the scale x1.01, the max over values up to half
a bf16 ulp larger (as over the unrounded row), a group's max shared with its neighbour (the shuffle over the
whole warp).

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_norm_fp8.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import GPU_MARKS, TORCH_DTYPES, poison
from kernel_cases import act, kernel_test, model, rand, runner, single_op_graph
from test_kernels_gemm_fp8 import check_quantiser, poisoned_workspaces
from test_kernels_linear import x_view
from test_kernels_linear_fp8 import as_fp8
from test_kernels_linear_int8 import assert_equal

from codegen.families import _norm_quant, family_for_op, gemm_fp8
from codegen.kernel import Options
from codegen.tuning import LinearTuning, Tuning
from ir.formats import FP8_BLOCK, cdiv
from ir.ops import TType
from ir.passes.norm_rows import give_rows

pytestmark = GPU_MARKS
SETTINGS = kernel_test(40)
ON = Tuning(linear=LinearTuning(norm_fp8=True))
NORM_OPS = ("rms_norm", "fused_add_rms_norm", "moe_combine_residual_rms_norm")
WIDTHS = st.one_of(st.sampled_from([16, 112, 128, 144, 1408, 1536, 2048, 2064, 5120, 7168]),
                   st.integers(1, 300).map(lambda k: 16 * k))
PAIRS = 3     # moe_combine_residual_rms_norm: expert outputs a token


def _inputs(op: str, T: int, n: int, dtype: str, extra: int, offset: int, zeros: bool, gen):
    """(input types, input tensors) of the norm op: x as a strided view (rms_norm, the add's first operand),
    tokens whose sizes differ by up to 2^8."""
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
    size = torch.exp2(torch.rand(T, 1, generator=gen) * 8 - 4).cuda()
    for t in ins:
        if t.dtype == tdt and t.shape[0] == T:
            t.mul_(size.to(tdt))
        if zeros and t.dtype == tdt:   # token 0's row all zeros: its scales the floor's, its bytes 0
            t[: PAIRS if t.shape[0] == T * PAIRS else 1] = 0
    return types, ins


def run_norm(op, dtype, T, n, extra, offset, wscale, zeros, seed, *, rows: bool) -> dict:
    """The norm's outputs (poisoned first) from its qf8 variant (rows) or its plain kernel, by value name."""
    gen = torch.Generator().manual_seed(seed)
    types, ins = _inputs(op, T, n, dtype, extra, offset, zeros, gen)
    G, nid = single_op_graph(model("lite"), op, {}, types, {"weight": "w"})
    if rows:
        nid = give_rows(G, nid, "fp8")
    w = ((torch.rand(n, generator=gen) + 0.5) * wscale).to(TORCH_DTYPES[dtype]).cuda()
    values = dict(zip(types, ins))
    outs = G.nodes[nid]["outputs"]
    for o in outs:
        t = G.graph["values"][o]
        if t.dtype == "i32":
            values[o] = torch.full((T, t.shape[1]), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
        elif t.dtype == "f32":
            values[o] = torch.full((T, cdiv(n, FP8_BLOCK)), float("nan"), device="cuda")
        else:
            values[o] = poison(torch.empty(T, n, dtype=TORCH_DTYPES[dtype], device="cuda"))
    # no reader here: the lowering is asked for the variant a reader multiplying FP8 x FP8 from T = 1 gets
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_norm_quant, "fp8_from", lambda G_, nid_, opts_: 1)
        launches = family_for_op(op).lower(nid, G, Options(dtype=dtype, tuning=ON))
    assert [s.name.endswith("__qf8") for s in launches] == [rows]
    runner().run_all(launches, values=values, weights={"w": w}, sizes={"T": T, "NP": T * PAIRS})
    torch.cuda.synchronize()
    return {o: values[o] for o in outs}


def quantiser_launch(h: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, xs): gemm_fp8's quantiser launch (the one the readers run without the knob) on h, poisoned first."""
    T, n = h.shape
    G, nid = single_op_graph(model("lite"), "linear", {"out_dim": 128}, {"x": act(n)}, {"weight": "w0"})
    as_fp8(G)
    quant = gemm_fp8.lower(nid, G, Options(dtype=dtype))[0]
    assert quant.stage == "quant_x"
    ws = runner().run_all([quant], values={"x": h}, sizes={"T": T}, workspaces=poisoned_workspaces(T, n))
    torch.cuda.synchronize()
    return ws[gemm_fp8.XQ], ws[gemm_fp8.XS]


@SETTINGS
@given(op=st.sampled_from(NORM_OPS), dtype=st.sampled_from(("bf16", "fp16")), T=st.integers(1, 80), n=WIDTHS,
       extra=st.sampled_from([0, 0, 8, 16]), offset=st.integers(0, 8), wscale=st.sampled_from([1.0, 1.0, 300.0]),
       zeros=st.booleans(), seed=st.integers(0, 2**31))
@example(op="rms_norm", dtype="bf16", T=32, n=2048, extra=0, offset=0, wscale=1.0, zeros=False, seed=1)
@example(op="fused_add_rms_norm", dtype="bf16", T=17, n=2048, extra=0, offset=0, wscale=300.0, zeros=True, seed=2)
@example(op="moe_combine_residual_rms_norm", dtype="bf16", T=5, n=2048, extra=0, offset=0, wscale=1.0, zeros=False,
         seed=3)
@example(op="rms_norm", dtype="fp16", T=9, n=144, extra=8, offset=1, wscale=1.0, zeros=True, seed=4)
@example(op="fused_add_rms_norm", dtype="fp16", T=33, n=7168, extra=16, offset=8, wscale=1.0, zeros=False, seed=5)
@example(op="moe_combine_residual_rms_norm", dtype="bf16", T=3, n=16, extra=0, offset=0, wscale=300.0, zeros=True,
         seed=6)
def test_norm_fp8_rows_equal_the_quantisers(op, dtype, T, n, extra, offset, wscale, zeros, seed):
    got = run_norm(op, dtype, T, n, extra, offset, wscale, zeros, seed, rows=True)
    plain = run_norm(op, dtype, T, n, extra, offset, wscale, zeros, seed, rows=False)
    names = list(got)
    h, q, s = got[names[0]], got[names[-2]], got[names[-1]]
    msg = f"{op} {dtype} T={T} n={n} extra={extra} offset={offset} wscale={wscale} zeros={zeros}"
    for o in plain:   # h (and s) unchanged by the rows
        assert_equal(got[o], plain[o], f"{msg}: output {o} against the plain kernel")
    assert q.shape == (T, n // 4) and s.shape == (T, cdiv(n, FP8_BLOCK))
    check_rows(h, q, s, dtype, zeros, msg)


def check_rows(h, q, s, dtype: str, zeros: bool, msg: str) -> None:
    """A kernel's e4m3 rows q and scales s of its own output h: bit-equal to the quantiser launch's on h, the
    scales to ir/act_quant.py's (the bytes within its one step); token 0 all zeros (zeros): the floor's scale."""
    xq, xs = quantiser_launch(h, dtype)
    assert_equal(q, xq, f"{msg}: e4m3 rows against the quantiser launch")
    assert_equal(s, xs, f"{msg}: scales against the quantiser launch")
    check_quantiser(h, {gemm_fp8.XQ: q, gemm_fp8.XS: s}, f"{msg}: against ir/act_quant.py")
    if zeros:
        floor = torch.tensor(1e-10, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)
        assert not q[0].any() and torch.equal(s[0].cpu(), floor.expand(s.shape[1])), msg
