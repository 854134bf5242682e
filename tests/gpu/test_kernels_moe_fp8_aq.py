"""Property tests: gate_up_silu's FP8 x FP8 epilogue hands down its e4m3 activations
(Tuning.moe.fp8_act_epilogue; templates/include/moe_gemm_fp8.cuh AQ, codegen/families/_moe_aq.py), run as
moe_expert_ffn's two-launch path above decode's range (x's quantiser, gate_up_silu's AQ GEMM writing a's
e4m3 rows and scales into the node's workspace, down's AQ GEMM reading them there: no quantiser for a).

Each example runs the same node, inputs and weights twice, the knob off (today's four launches: the
16-bit a, down's quantiser over it into moe_aq / moe_as, down) and on, and checks:
  * a's e4m3 bytes and fp32 scales from the epilogue EXACTLY equal (bit for bit) what down's quantiser
    launch made from the kernel's 16-bit a (the off run; the on run's GEMM and rounding are the same
    code, fp8x_mainloop and fp8x_stage, so its 16-bit a is that one);
  * down's output bit-equal to the off run's (the same bytes into the same GEMM), and within the FP8
    bound of test_kernels_moe_gemm_fp8.py against ir/act_quant.py on the handed-down rows.
The workspace is poisoned (bytes 0x7f: e4m3 NaN, scales 3.4e38) and so is the output, so a byte, a
scale or an element nobody writes fails.  Hypothesis draws T (257 .. 16384), E, top-k, the routing
(uniform, skewed, empty experts, one hot expert), M with partial last groups (M % 128 != 0: the
group's second 64-column tile short or absent) and D with a ceil K block.  The planted mutants of
tests/gpu/test_mutants.py (a group's scale in the neighbouring group's place, the scale's 448 off by
1%, the last partial group's columns past M counted) run through this body and must fail it.

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_moe_fp8_aq.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

import test_kernels_moe as base
import test_kernels_gemm_fp8 as gemm_tests
from harness import TORCH_DTYPES, single_op_graph, tiny_model
from kernel_cases import Recorder, empty_out, kernel_test, runner
from test_kernels_moe_fp8 import quantized_experts
from test_kernels_moe_gemm_fp8 import ACC_SLACK, FIRST, ROUTINGS, TOKENS, _abs8, lite_counts, routing_ids
from test_kernels_moe_gemm_fp8 import pytestmark  # noqa: F401  (GPU marks; sm_90a)

from codegen import sizes
from codegen.families import _moe_gemm_fp8, moe_expert_ffn
from codegen.kernel import Options
from codegen.tuning import MoeTuning, Tuning
from ir.act_quant import grouped_linear_fp8
from ir.formats import FP8, cdiv, companion_names, set_format
from ir.ops import TType

SETTINGS = kernel_test(15)
REC = Recorder("moe_expert_ffn fp8 x fp8, a handed down in e4m3")
BLOCK = FP8.block[0]
ON = Tuning(moe=MoeTuning(fp8_act_epilogue=True))
MS = (16, 112, 128, 144, 256, 272, 528, 1408)      # a's width: whole 16-byte chunks, groups whole or not
DS = (128, 144, 272, 2048)
MAX_MACS = 3 * 10 ** 10


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC.report()


def case_of(dtype, T, E, K, D, M, *, routing="uniform", counts=None, seed=41):
    return {"dtype": dtype, "T": T, "E": E, "K": K, "D": D, "M": M, "routing": routing, "counts": counts, "seed": seed}


@st.composite
def cases(draw):
    E = draw(st.sampled_from((1, 2, 3, 5, 8, 16)))
    K = draw(st.integers(1, min(E, 8)))
    case = case_of(draw(st.sampled_from(("bf16", "fp16"))), draw(TOKENS), E, K, draw(st.sampled_from(DS)),
                   draw(st.sampled_from(MS)), routing=draw(st.sampled_from(ROUTINGS)),
                   seed=draw(st.integers(0, 2**31 - 1)))
    assume(case["T"] * K * case["M"] * case["D"] * 3 <= MAX_MACS)
    return case


def graph(E, K, D, M):
    G, nid = single_op_graph(tiny_model(), "moe_expert_ffn", {"num_experts": E, "inner_dim": M, "out_dim": D},
                             {"x": TType(("T", D), "act"), "R": TType((f"T*{K}", E), "routing")},
                             {"gate": "e.{expert}.gate", "up": "e.{expert}.up", "down": "e.{expert}.down"})
    for name in G.nodes[nid]["weights"].values():
        set_format(G.graph["weights"], name, FP8)
    return G, nid


def launches(G, nid, dtype, env, tuning):
    steps = moe_expert_ffn.lower(nid, G, Options(dtype=dtype, tuning=tuning))
    return [la for la in steps if all(sizes.evaluate(g, env) > 0 for g in la.grid)]


def handed_down(act: torch.Tensor, NP: int, M: int):
    """(q [NP, M] e4m3, s [NP, ceil(M / 128)] fp32) from a's storage (moe_gemm_fp8.cuh fp8x_aq_scales)."""
    raw = act.view(torch.uint8).reshape(-1)
    KB = cdiv(M, BLOCK)
    q = raw[:NP * M].view(NP, M).view(torch.float8_e4m3fn)
    s = raw[NP * M:NP * M + 4 * NP * KB].view(torch.float32).view(NP, KB)
    return q, s


def run_case(case: dict) -> None:
    dtype, T, E, K, D, M = (case[k] for k in ("dtype", "T", "E", "K", "D", "M"))
    td, NP = TORCH_DTYPES[dtype], T * K
    g = torch.Generator().manual_seed(case["seed"])
    ids = base._ids_with_counts(case["counts"], K, g) if case["counts"] else routing_ids(T, E, K, case["routing"], g)
    _, dev_r = base._routing(T, E, K, g, ids)
    G, nid = graph(E, K, D, M)
    weights, fp8w = {}, {}
    for role, name in G.nodes[nid]["weights"].items():
        N, KD = (D, M) if role == "down" else (M, D)
        q, s = quantized_experts(E, N, KD, g, KD ** -0.5)
        weights[name], weights[companion_names(name, FP8)[0]] = q, s
        fp8w[role] = (q, s)
    env = {"T": T, "NP": NP, "SMS": torch.cuda.get_device_properties(0).multi_processor_count}
    off, on = launches(G, nid, dtype, env, Tuning()), launches(G, nid, dtype, env, ON)
    assert [la.stage for la in off] == ["quant_x", "wgmma_fp8", "quant_x", "wgmma_fp8"], [la.stage for la in off]
    assert [la.stage for la in on] == ["quant_x", _moe_gemm_fp8.AQ_VARIANT, _moe_gemm_fp8.AQ_VARIANT]
    x = gemm_tests.x_tokens(T, D, dtype, 0, 0, 0, g, gemm_tests.SILU_X).contiguous()
    (y_name,) = G.nodes[nid]["outputs"]
    msg = f"T={T} E={E} K={K} D={D} M={M} routing={case['routing']} counts={case['counts'] is not None} {dtype}"

    def run(steps):
        y = empty_out((NP, D), dtype)
        act = torch.empty((NP, M), dtype=td, device="cuda")
        act.view(torch.uint8).fill_(0x7F)
        q_ws, s_ws = _moe_gemm_fp8.WORKSPACES[True]
        work = {moe_expert_ffn.WORKSPACE: act,
                q_ws: torch.full((NP, M // 4), 0x7F7F7F7F, dtype=torch.int32, device="cuda"),
                s_ws: torch.full((NP, cdiv(M, BLOCK)), float("nan"), dtype=torch.float32, device="cuda")}
        work = runner().run_all(steps, values={"x": x, "R": dev_r, y_name: y}, weights=weights,
                                sizes={"T": T, "NP": NP}, workspaces=work)
        torch.cuda.synchronize()
        return y, work

    y_off, w_off = run(off)
    y_on, w_on = run(on)
    q_ws, s_ws = _moe_gemm_fp8.WORKSPACES[True]
    q_ref = w_off[q_ws].view(torch.uint8).view(NP, M)
    s_ref = w_off[s_ws]
    q, s = handed_down(w_on[moe_expert_ffn.WORKSPACE], NP, M)
    bad = (s != s_ref).nonzero()
    assert not len(bad), f"{msg}: {len(bad)} scales differ from down's quantiser, first {bad[:4].tolist()}"
    bad = (q.view(torch.uint8) != q_ref).nonzero()
    assert not len(bad), f"{msg}: {len(bad)} e4m3 bytes differ from down's quantiser, first {bad[:4].tolist()}"
    assert torch.equal(y_on.view(torch.int16), y_off.view(torch.int16)), f"{msg}: down's output differs"
    qw, sw = fp8w["down"]
    pairs, experts = torch.arange(NP, device="cuda"), ids.reshape(-1).to("cuda")
    ref = grouped_linear_fp8(q, s, pairs, experts, qw, sw)
    slack = ACC_SLACK * grouped_linear_fp8(_abs8(q), s, pairs, experts, _abs8(qw), sw)
    REC.check(y_on, ref, dtype, msg, slack=slack)
    REC.example()


@SETTINGS
@given(case=cases())
# V2-Lite's routed experts (64 x 1408, hidden 2048, top-6), row-tile edges and an empty expert
@example(case=case_of("bf16", 300, 64, 6, 2048, 1408, counts=lite_counts(300, 6)))
# the last group's second 64-column tile absent (144 = 128 + 16), one hot expert over 4096 pairs, fp16
@example(case=case_of("fp16", 2048, 8, 2, 272, 144, routing="hot", seed=42))
# the last group's second tile short (272 = 2 x 128 + 16; 200 columns would not be whole e4m3 chunks)
@example(case=case_of("bf16", FIRST, 5, 3, 144, 272, routing="empty", seed=43))
# V3's experts (2048 wide, top-8 of 256), the hidden width shrunk to 272
@example(case=case_of("bf16", 300, 256, 8, 272, 2048, routing="skewed", seed=44))
def test_moe_fp8_act_epilogue(case):
    run_case(case)
