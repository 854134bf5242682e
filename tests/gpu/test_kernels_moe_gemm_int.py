"""Property tests: the grouped expert GEMMs with per-channel integer weights at prefill on int8 wgmma
(templates/include/moe_gemm_int.cuh, codegen/families/_moe_gemm_int.py: the "wgmma_int" row of the
grouped_experts table, Tuning.moe.int_wgmma_above; sm_90a): moe_gate_up_silu and moe_down with int4_channel
(packed, unpacked in shared memory) and int8_channel weights, and moe_expert_ffn's two launch pairs.

The integer sums are exact on both kernels and the epilogues round at the same points, so each example checks:
  * the quantiser's int8 rows and scales bit-equal to ir/formats_int.py quantize_activation's;
  * the wgmma_int launch's outputs BIT-EQUAL to the mma_int launch's (the knob off) on the same quantised rows;
  * moe_down's outputs bit-equal to ((float(acc) * s_w) * s_x) rounded (acc the exact int64 sum on the CPU),
    moe_gate_up_silu's within the 16-bit tolerance of silu(gate) * up on the exact gate and up
    (test_kernels_moe_int.py's reference: the kernel's expf before its rounding).

Hypothesis draws T from 65 to 600, E (1 .. 64), top-k, a skewed routing (some experts empty, some taking most
pairs: several row tiles an expert, partial last tiles), KD a multiple of 16 (ceil K boxes where KD % 128 != 0),
N even for int4 and any N for int8, whole column tiles or not (rows past N: TMA's zeros, never stored), outputs
one element past an aligned base (element stores).  Weights span the format's whole range (every nibble),
scales differ up to 16x between neighbouring channels: a swapped nibble, a channel permuted wrongly or a dropped
/16 moves the outputs far.  Outputs and workspaces are poisoned first.  Planted mutants (tests/gpu/
test_mutants.py): the unpacked even and odd boxes swapped, the /16 of the packed sums dropped.

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_moe_gemm_int.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

import test_kernels_moe as base
from harness import GPU_MARKS, TORCH_DTYPES, poison, shifted
from kernel_cases import Recorder, kernel_test, runner
from test_kernels_linear_int8 import assert_equal
from test_kernels_moe_int import bind_weights, graph, quant_workspaces, silu_mul, up_near_one

from codegen import families
from codegen.families import _moe_gemm_int, _moe_int
from codegen.kernel import Options
from codegen.tuning import MoeTuning, Tuning
from ir.formats import FORMATS
from ir.formats_int import quantize_activation

_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                             reason="the int8 wgmma expert GEMM needs a compute capability 9.0 GPU (sm_90a)")
pytestmark = [*GPU_MARKS, _HOPPER]

SETTINGS = kernel_test(20)
ABOVE = 64                        # the knob's value in these tests: wgmma_int from T = 65
ON = Tuning(moe=MoeTuning(int_wgmma_above=ABOVE))
REC = Recorder("moe_gate_up_silu wgmma_int")
REC_FFN = Recorder("moe_expert_ffn wgmma_int")
KDS = (16, 144, 272, 528, 1408, 2048)
NS = {"int4_channel": {True: (2, 128, 144, 200, 256, 2048), False: (2, 64, 90, 176, 192, 1408)},
      "int8_channel": {True: (37, 144, 200, 256, 2048), False: (37, 90, 176, 192, 1408)}}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REC.report()
    REC_FFN.report()


def skewed_ids(T: int, E: int, K: int, empty: int, g) -> torch.Tensor:
    """ids [T, K], K distinct experts a token drawn by weights 2^(3 * randn) (a few experts take most pairs),
    the last `empty` experts (as many as K allows) never drawn."""
    live = max(K, E - empty)
    w = torch.exp2(3 * torch.randn(E, generator=g))
    w[live:] = 0
    return torch.multinomial(w.expand(T, E), K, replacement=False, generator=g).to(torch.int64)


@st.composite
def cases(draw, ops=("moe_gate_up_silu", "moe_down")):
    op = draw(st.sampled_from(ops))
    fmt = draw(st.sampled_from(("int4_channel", "int4_channel", "int8_channel")))
    E = draw(st.sampled_from((1, 2, 5, 8, 64)))
    return {"op": op, "fmt": fmt, "dtype": draw(st.sampled_from(("bf16", "fp16"))),
            "T": draw(st.one_of(st.sampled_from((ABOVE + 1, 128, 129, 300, 600)), st.integers(ABOVE + 1, 600))),
            "E": E, "K": min(E, draw(st.sampled_from((1, 2, 6)))), "empty": draw(st.sampled_from((0, 1, 3))),
            "KD": draw(st.sampled_from(KDS)), "N": draw(st.sampled_from(NS[fmt][op == "moe_down"])),
            "shift": draw(st.booleans()), "seed": draw(st.integers(0, 2**31 - 1))}


def case_of(op, fmt, T, E, K, KD, N, *, dtype="bf16", empty=0, shift=False, seed=7):
    return {"op": op, "fmt": fmt, "dtype": dtype, "T": T, "E": E, "K": K, "empty": empty, "KD": KD, "N": N,
            "shift": shift, "seed": seed}


def exact(qx, sx, q, s, routing, K: int, down: bool, dtype) -> torch.Tensor:
    """test_kernels_moe_int.exact's numbers (CPU, the activation type): ((float32(acc) * s_w) * s_x), acc each
    pair's sum with its expert's weights -- here float64 on the GPU, exact as the int64 one (integers below
    2^53; prefill's widths would take the CPU minutes an example)."""
    order, off = routing["order"].long(), routing["offsets"].tolist()
    qd, sxd = qx.to("cuda", torch.float64), sx.reshape(-1).cuda()
    out = torch.zeros((order.numel(), q.shape[1]), dtype=torch.float32, device="cuda")
    for e in range(q.shape[0]):
        pairs = order[off[e]:off[e + 1]].cuda()
        if pairs.numel():
            rows = pairs if down else pairs // K
            acc = (qd[rows] @ q[e].to("cuda", torch.float64).T).float()
            out[pairs] = (acc * s[e].cuda().reshape(1, -1)) * sxd[rows].reshape(-1, 1)
    return out.cpu().to(TORCH_DTYPES[dtype])


def lowered(G, nid, dtype, tuning) -> list:
    return families.family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(dtype=dtype, tuning=tuning))


def pair_of(launches, stage):
    """The quantiser's launch and the GEMM of `stage` (the launch after it)."""
    i = [la.stage for la in launches].index(stage)
    assert launches[i - 1].stage == _moe_int.QUANT_STAGE, [la.stage for la in launches]
    return launches[i - 1], launches[i]


def run_case(case: dict) -> None:
    op, dtype, T, E, K, KD, N = (case[k] for k in ("op", "dtype", "T", "E", "K", "KD", "N"))
    tdt = TORCH_DTYPES[dtype]
    fmt = FORMATS[case["fmt"]]
    down = op == "moe_down"
    g = torch.Generator().manual_seed(case["seed"])
    ref_r, dev_r = base._routing(T, E, K, g, skewed_ids(T, E, K, case["empty"], g))
    G, nid = graph(op, E, K, KD, N, fmt)
    quant, wgmma = pair_of(lowered(G, nid, dtype, ON), _moe_gemm_int.VARIANT)
    _, mma = pair_of(lowered(G, nid, dtype, Tuning()), _moe_int.VARIANT)
    rows = T * K if down else T
    x = (torch.randn(rows, KD, generator=g) * torch.exp2(2 * torch.rand(rows, 1, generator=g))).to("cuda", tdt)
    roles = ("weight",) if down else ("gate", "up")
    weights, ref_w = bind_weights(G.nodes[nid]["weights"], {r: (E, N, KD) for r in roles}, g, False, fmt)
    if not down:
        up_near_one(G.nodes[nid]["weights"]["up"], weights, ref_w, fmt)
    (out_name,) = G.nodes[nid]["outputs"]
    first = "a" if down else "x"
    outs = {}
    work = quant_workspaces(quant, rows, KD)
    for name, launches in (("wgmma_int", [quant, wgmma]), ("mma_int", [mma])):
        outs[name] = shifted(poison(torch.empty(T * K, N, dtype=tdt, device="cuda")), case["shift"])
        work = runner().run_all(launches, values={first: x, "R": dev_r, out_name: outs[name]}, weights=weights,
                                sizes={"T": T, "NP": T * K}, workspaces=work)
        torch.cuda.synchronize()
    msg = f"{op} {fmt.name} {dtype} T={T} E={E} K={K} KD={KD} N={N} empty={case['empty']} shift={case['shift']}"
    qx, sx = quantize_activation(x.cpu())
    qname, sname = (w.name for w in quant.workspace[:2])
    assert_equal(work[qname].view(torch.int8)[:, :KD], qx, f"quantised rows {msg}")
    assert_equal(work[sname], sx.reshape(-1), f"row scales {msg}")
    assert torch.equal(outs["wgmma_int"].view(torch.int16).cpu(), outs["mma_int"].view(torch.int16).cpu()), \
        f"wgmma_int differs from mma_int bit for bit: {msg}"
    ys = {r: exact(qx, sx, *w[:2], ref_r, K, down, dtype) for r, w in ref_w.items()}
    if down:
        assert_equal(outs["wgmma_int"], ys["weight"], msg)
    else:
        REC.check(outs["wgmma_int"], silu_mul(ys["gate"], ys["up"], tdt), dtype, msg)
        REC.example()


@SETTINGS
@given(case=cases())
@example(case=case_of("moe_gate_up_silu", "int4_channel", 512, 64, 6, 2048, 1408))   # V2-Lite, 32x512's experts
@example(case=case_of("moe_down", "int4_channel", 512, 64, 6, 1408, 2048))
@example(case=case_of("moe_gate_up_silu", "int8_channel", 512, 64, 6, 2048, 1408, dtype="fp16"))
@example(case=case_of("moe_down", "int8_channel", 300, 8, 2, 1408, 2048, empty=3, shift=True))
# V3's experts and K (7168, 2048), the outputs shrunk: its whole widths draw 7.5e9 int4 weights on the CPU
# (~90 s of torch.randint a gate_up example), past run_isolated's 240 s with the rest of this test
@example(case=case_of("moe_gate_up_silu", "int4_channel", 200, 256, 8, 7168, 192, empty=3))
@example(case=case_of("moe_down", "int4_channel", 200, 256, 8, 2048, 448))
@example(case=case_of("moe_down", "int8_channel", 65, 2, 2, 144, 37, shift=True))              # ceil K, N odd
@example(case=case_of("moe_gate_up_silu", "int8_channel", 65, 1, 1, 16, 37))                  # one K box
@example(case=case_of("moe_down", "int4_channel", 90, 8, 3, 176, 144, empty=1, shift=True))     # the e2e tiny's
@example(case=case_of("moe_gate_up_silu", "int4_channel", 90, 8, 3, 144, 176, empty=1))         # widths
@example(case=case_of("moe_down", "int4_channel", 300, 5, 2, 528, 256, seed=16))               # test_mutants'
@example(case=case_of("moe_gate_up_silu", "int4_channel", 300, 5, 2, 528, 192, seed=16))        # test_mutants'
def test_moe_gemm_int_bit_equal_to_mma_int(case):
    run_case(case)


@SETTINGS
@given(fmt=st.sampled_from(("int4_channel", "int8_channel")), T=st.integers(ABOVE + 1, 400),
       E=st.sampled_from((2, 8, 64)), seed=st.integers(0, 2**31 - 1))
@example(fmt="int4_channel", T=300, E=64, seed=5)
def test_moe_expert_ffn_wgmma_int_bit_equal_to_mma_int(fmt, T, E, seed):
    """moe_expert_ffn above the knob: its two launch pairs on wgmma_int, the outputs bit-equal to the knob-off
    plan's (mma_int) on the same inputs (D = 2048 and M = 1408: V2-Lite's, whole packed boxes)."""
    K, D, M, dtype = min(E, 6), 2048, 1408, "bf16"
    fm = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    _, dev_r = base._routing(T, E, K, g, skewed_ids(T, E, K, 1, g))
    G, nid = graph("moe_expert_ffn", E, K, D, M, fm)
    x = torch.randn(T, D, generator=g).to("cuda", TORCH_DTYPES[dtype])
    weights, _ = bind_weights(G.nodes[nid]["weights"], {"gate": (E, M, D), "up": (E, M, D), "down": (E, D, M)},
                              g, False, fm)
    (out_name,) = G.nodes[nid]["outputs"]
    outs = {}
    for name, tuning in (("on", ON), ("off", Tuning())):
        launches = lowered(G, nid, dtype, tuning)
        if name == "on":
            assert [la.stage for la in launches].count(_moe_gemm_int.VARIANT) == 2, [la.stage for la in launches]
        outs[name] = poison(torch.empty(T * K, D, dtype=TORCH_DTYPES[dtype], device="cuda"))
        runner().run_all(launches, values={"x": x, "R": dev_r, out_name: outs[name]}, weights=weights,
                         sizes={"T": T, "NP": T * K})
        torch.cuda.synchronize()
    assert not torch.isnan(outs["on"].float()).any(), f"unwritten outputs: {fmt} T={T} E={E}"
    assert torch.equal(outs["on"].view(torch.int16), outs["off"].view(torch.int16)), f"{fmt} T={T} E={E}"
    REC_FFN.example()
