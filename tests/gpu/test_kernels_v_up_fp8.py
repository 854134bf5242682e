"""Property tests: mla_v_up's "qf8" variant (Tuning.linear.v_up_fp8; ir/passes/fuse_v_up_fp8_quant.py,
templates/include/v_up_rows.cuh), which also writes o_proj's e4m3 rows and per-128-column scales of its output
o [T, H * 128] (a CTA a whole head).  Everything compared is exact:

- o bit-equal to the plain v_up kernel's (mma_t32_m2) on the same inputs: the same k slices, the same sums;
- the e4m3 rows and float32 scales bit-equal to what o_proj's own quantiser launch (gemm_fp8's quant_x,
  templates/include/quant_fp8.cuh) writes from o as stored -- the bytes o_proj read before the knob -- and the
  scales bit-equal to ir/act_quant.py quantize_act_fp8's (bytes within one e4m3 step on a few elements:
  test_kernels_gemm_fp8.check_quantiser, the check the quantiser launch itself passes);
- o_proj (gemm_fp8, V2-Lite's 2048 x 2048 FP8 weight) reading v_up's rows bit-equal to o_proj with its quantiser.

Hypothesis draws T (1..300 and the token-tile edges: 16-token tiles, 8 chunks, CTAs that loop), the dtype, kv_b
in FP8 (V2-Lite's) or 16-bit, o_lat as a view at an offset into wider rows (lead), o misaligned by one element
(the read-back's element loads), tokens whose sizes differ by up to 2^8 and all-zero tokens (the AMAX_FLOOR
scale).  v_up's input is the attention's output o_lat; the context and the pages behind it shape nothing here
(tests/gpu/test_e2e_v_up_fp8.py runs the whole decode step).  Outputs and rows are poisoned first.
Planted mutant (tests/gpu/test_mutants.py): head h's rows quantised from the neighbouring head's columns.

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_v_up_fp8.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import GPU_MARKS, TORCH_DTYPES, poison
from kernel_cases import act, kernel_test, model, runner, single_op_graph
from test_kernels_gemm_fp8 import poisoned_workspaces
from test_kernels_linear_fp8 import as_fp8, quantized
from test_kernels_linear_int8 import assert_equal
from test_kernels_mla import TOKEN_EDGES, absorb_out, head_views
from test_kernels_norm_fp8 import check_rows

from codegen.families import _norm_quant, family_for_op, gemm_fp8
from codegen.kernel import Options
from codegen.tuning import LinearTuning, Tuning
from ir.formats import FP8, FP8_BLOCK, companion_names, set_format
from ir.ops import TType
from ir.passes.norm_rows import give_rows

pytestmark = GPU_MARKS
SETTINGS = kernel_test(30)
ON = Tuning(linear=LinearTuning(v_up_fp8=True))


def _v_up_graph(fp8: bool):
    m = model("lite")
    H, C = m.dims["heads"], m.dims["kv_lora_rank"]
    G, nid = single_op_graph(m, "mla_v_up", {}, {"o_lat": TType(("T", H, C), "act")}, {"kv_b": "kvb"},
                             phase="decode")
    if fp8:
        set_format(G.graph["weights"], "kvb", FP8)
    return G, nid


def _kv_b(fp8: bool, dtype: str, gen) -> dict:
    m = model("lite")
    rows, C = m.dims["heads"] * (m.dims["qk_nope_head_dim"] + m.dims["v_head_dim"]), m.dims["kv_lora_rank"]
    if fp8:
        q, s = quantized(rows, C, gen, 0.1)
        return {"kvb": q, companion_names("kvb", FP8)[0]: s}
    return {"kvb": (torch.randn(rows, C, generator=gen) * 0.05).to("cuda", TORCH_DTYPES[dtype])}


def run_v_up(fp8, dtype, T, lead, odd_out, zeros, seed, *, rows: bool) -> dict:
    """v_up's outputs (poisoned first) from its qf8 variant (rows) or its plain kernel, by value name."""
    gen = torch.Generator().manual_seed(seed)
    G, nid = _v_up_graph(fp8)
    m = model("lite")
    H, C, V = m.dims["heads"], m.dims["kv_lora_rank"], m.dims["v_head_dim"]
    (o_lat,) = head_views(T, H, [C], dtype, gen, lead)
    o_lat.mul_(torch.exp2(torch.rand(T, 1, 1, generator=gen) * 8 - 4).cuda().to(o_lat.dtype))
    if zeros:
        o_lat[0] = 0
    if rows:
        nid = give_rows(G, nid, "fp8")
    outs = G.nodes[nid]["outputs"]
    values = {"o_lat": o_lat, outs[0]: absorb_out((T, H * V), dtype, 1 if odd_out else 0)}
    if rows:
        values[outs[1]] = torch.full((T, H * V // 4), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
        values[outs[2]] = torch.full((T, H), float("nan"), device="cuda")
    # no reader here: the lowering is asked for the variant a reader multiplying FP8 x FP8 from T = 1 gets
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_norm_quant, "fp8_from", lambda G_, nid_, opts_: 1)
        launches = family_for_op("mla_v_up").lower(nid, G, Options(dtype=dtype, tuning=ON))
    assert [s.name.endswith("__qf8") for s in launches] == [rows], [s.name for s in launches]
    runner().run_all(launches, values=values, weights=_kv_b(fp8, dtype, gen), sizes={"T": T})
    torch.cuda.synchronize()
    return {o: values[o] for o in outs}


def o_proj(o: torch.Tensor, dtype: str, rows: tuple | None, seed: int) -> torch.Tensor:
    """V2-Lite's o_proj (gemm_fp8, FP8 weight) on o: with its quantiser launch (rows None) or reading the e4m3
    rows and scales `rows` (v_up's) instead."""
    T, K = o.shape
    gen = torch.Generator().manual_seed(seed + 1)
    G, nid = single_op_graph(model("lite"), "linear", {"out_dim": K}, {"x": act(K)}, {"weight": "w0"})
    as_fp8(G)
    ws = dict(zip(("w0", companion_names("w0", FP8)[0]), quantized(K, K, gen, K ** -0.5)))
    (y,) = G.nodes[nid]["outputs"]
    values = {"x": o, y: poison(torch.empty(T, K, dtype=TORCH_DTYPES[dtype], device="cuda"))}
    if rows is None:
        launches = gemm_fp8.lower(nid, G, Options(dtype=dtype))
    else:
        values.update({"o.qf8": rows[0], "o.sf8": rows[1]})
        launches = gemm_fp8.launches(nid, "linear", "x", K, ["w0"], [y], [K], Options(dtype=dtype), None, 1,
                                     ("o.qf8", "o.sf8"))
        assert not any(s.stage == "quant_x" for s in launches)
    runner().run_all(launches, values=values, weights=ws, sizes={"T": T}, workspaces=poisoned_workspaces(T, K))
    torch.cuda.synchronize()
    return values[y]


@SETTINGS
@given(fp8=st.sampled_from([True, True, False]), dtype=st.sampled_from(("bf16", "fp16")),
       T=st.one_of(st.sampled_from(TOKEN_EDGES), st.integers(1, 300)), lead=st.sampled_from([0, 0, 8, 3]),
       odd_out=st.booleans(), zeros=st.booleans(), seed=st.integers(0, 2**31))
@example(fp8=True, dtype="bf16", T=65, lead=0, odd_out=False, zeros=False, seed=1)     # the first T it runs at
@example(fp8=True, dtype="bf16", T=128, lead=0, odd_out=False, zeros=True, seed=2)     # 8 chunks of 16
@example(fp8=True, dtype="bf16", T=257, lead=0, odd_out=False, zeros=False, seed=3)    # CTAs that loop, a 1-token tile
@example(fp8=True, dtype="fp16", T=33, lead=3, odd_out=True, zeros=False, seed=4)      # element loads of o_lat and o
@example(fp8=False, dtype="bf16", T=100, lead=8, odd_out=False, zeros=True, seed=5)    # 16-bit kv_b
@example(fp8=True, dtype="bf16", T=1, lead=0, odd_out=False, zeros=False, seed=6)      # one token: half a warp
def test_v_up_fp8_rows_equal_the_quantisers(fp8, dtype, T, lead, odd_out, zeros, seed):
    got = run_v_up(fp8, dtype, T, lead, odd_out, zeros, seed, rows=True)
    plain = run_v_up(fp8, dtype, T, lead, odd_out, zeros, seed, rows=False)
    o, q, s = got.values()
    msg = f"fp8={fp8} {dtype} T={T} lead={lead} odd_out={odd_out} zeros={zeros}"
    assert_equal(o, next(iter(plain.values())), f"{msg}: o against the plain kernel")
    check_rows(o, q, s, dtype, zeros, msg)
    if T >= 17:   # o_proj's FP8 x FP8 GEMM (as it runs from 65 in the model): the same bits either way
        assert_equal(o_proj(o, dtype, (q, s), seed), o_proj(o, dtype, None, seed), f"{msg}: o_proj's output")
