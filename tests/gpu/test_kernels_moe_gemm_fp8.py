"""Property tests: the grouped expert GEMMs with FP8 weights and FP8 activations at prefill
(templates/include/moe_gemm_fp8.cuh, the "wgmma_fp8" row of codegen/dispatch.py's grouped_experts table:
above decode's 256 tokens at the default tuning; sm_90a): moe_gate_up_silu, moe_gate_up and moe_down,
each as its two launches (gemm_fp8's quantiser over the node's input, then the grouped FP8 x FP8 GEMM).

Two checks an example, each against exact inputs (test_kernels_gemm_fp8.py's recipe):
  * the quantiser against ir/act_quant.py's on the same input (gate_up: x [T, D], one row a token for its
    K pairs; down: a [NP, M], one row a pair), read back from the node's workspaces: the scales bit for
    bit, the e4m3 bytes within one step on at most a few elements;
  * the GEMM against ir/act_quant.py grouped_linear_fp8 (float64, on the GPU) of the kernel's OWN
    quantised rows and the FP8 expert weights (bytes and block scales), rounded where the kernel rounds
    (gate_up_silu: gate, up and silu(gate) to the activation type): the 16-bit tolerance plus ACC_SLACK
    (the FP8 tensor cores' accumulation error, 2^-12 of sum |x w|) element-wise, STRICT norm-wise.

Hypothesis draws T from 257 to 16384, E (1 .. 16; examples at V2-Lite's 64 experts and V3's 256) and top-k,
the routing uniform, skewed, with empty experts, or with one expert taking every token (a row tile walk
of 128-pair tiles over 16384 pairs), widths with ceil blocks (KD a multiple of 16, not of 128; N odd or
past a 64 / 128-row tile), rows whose scales differ by up to 2^8 and all-zero rows, the input or the
outputs one element past an aligned base (the quantiser's element loads; the GEMM's element stores).
Outputs are poisoned (NaN) and the workspaces too (e4m3 0x7f, NaN scales), so an element no kernel writes
fails.  Half the examples run with Tuning.moe.fp8_overlap on (each K block promoted under the next
block's wgmma), and test_moe_fp8x_overlap_is_bit_equal checks that its outputs are the knob-off launch's
bit for bit.  The planted mutants of tests/gpu/test_mutants.py (a K block's x scale from another pair, the
ceil K block dropped, the promotion skipped for the first K block, the gate and up scales swapped; with
the overlap: the promotion of the other fp32 tile, a block promoted with its neighbour's scales) run
through these bodies and must fail them.  A quarter of the examples run with Tuning.moe.fp8_multicast on
(clusters of two CTAs on two row tiles of one expert, each multicasting half of a stage's weight boxes), and
test_moe_fp8x_multicast_is_bit_equal checks its outputs against the knob-off launch's bit for bit (experts of
1, 2 and 3 row tiles: a cluster's second tile empty); its mutants (rank 1 on rank 0's row tile, rank 1's box
landing on box 0's half) run through test_moe_down_fp8x.

Run: python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_moe_gemm_fp8.py
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

import test_kernels_gemm_fp8 as gemm_tests
import test_kernels_moe as base
from harness import GPU_MARKS, TORCH_DTYPES, shifted, single_op_graph, tiny_model
from kernel_cases import Recorder, empty_out, kernel_test, runner
from test_kernels_moe_fp8 import quantized_experts

from codegen import families, sizes
from codegen.families import _moe_gemm_fp8, gemm_fp8
from codegen.kernel import Options
from codegen.tuning import MoeTuning, Tuning
from ir.act_quant import grouped_linear_fp8
from ir.formats import FP8, cdiv, companion_names, set_format
from ir.ops import TType

_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                             reason="the FP8 x FP8 expert GEMM needs a compute capability 9.0 GPU (sm_90a)")
pytestmark = [*GPU_MARKS, _HOPPER]

SETTINGS = kernel_test(20)
REC = {op: Recorder(f"{op} fp8 x fp8") for op in ("moe_gate_up_silu", "moe_gate_up", "moe_down")}
ACC_SLACK = gemm_tests.ACC_SLACK
BLOCK = FP8.block[0]
FIRST = 257                    # the first T the FP8 x FP8 row serves at the default tuning
TOKENS = st.one_of(st.sampled_from([FIRST, 300, 383, 384, 385, 512, 1000, 2048, 4096, 16384]),
                   st.integers(FIRST, 1200))
KDS = (16, 112, 128, 144, 256, 272, 528, 1408, 2048)
NS = (1, 37, 64, 65, 128, 129, 190, 200, 264, 1408)
ROUTINGS = ("uniform", "skewed", "empty", "hot")
MAX_MACS = 3 * 10 ** 10        # pairs x N x KD: the float64 references stay at a second or so


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for rec in REC.values():
        rec.report()


def routing_ids(T: int, E: int, K: int, kind: str, g) -> torch.Tensor:
    """ids [T, K], K distinct experts a token: "uniform" (random scores), "skewed" (some experts far
    more often than others), "empty" (up to E - K experts never chosen), "hot" (expert 0 in every token)."""
    logits = torch.randn(T, E, generator=g)
    if kind == "skewed":
        logits += torch.linspace(0, 6, E)[torch.randperm(E, generator=g)]
    elif kind == "empty":
        dead = torch.randperm(E, generator=g)[:E - K]
        logits[:, dead[:int(torch.randint(0, E - K + 1, (1,), generator=g))]] = float("-inf")
    elif kind == "hot":
        logits[:, 0] = float("inf")
    return logits.topk(K, dim=1).indices


def case_of(dtype, T, E, K, KD, N, *, routing="uniform", counts=None, misalign="none", zero_rows=0, seed=31,
            overlap=False, multicast=False):
    if counts is not None:
        assert sum(counts) == T * K and len(counts) == E and max(counts) <= T, (counts, T, K)
    return {"dtype": dtype, "T": T, "E": E, "K": K, "KD": KD, "N": N, "routing": routing, "counts": counts,
            "misalign": misalign, "zero_rows": zero_rows, "seed": seed, "overlap": overlap,
            **({"multicast": True} if multicast else {})}


@st.composite
def cases(draw, kds=KDS, ns=NS):
    E = draw(st.sampled_from((1, 2, 3, 5, 8, 16)))
    K = draw(st.integers(1, min(E, 8)))
    case = case_of(draw(st.sampled_from(("bf16", "fp16"))), draw(TOKENS), E, K, draw(st.sampled_from(kds)),
                   draw(st.sampled_from(ns)), routing=draw(st.sampled_from(ROUTINGS)),
                   misalign=draw(st.sampled_from(("none", "none", "inputs", "outputs"))),
                   zero_rows=draw(st.sampled_from((0, 0, 1, 5))), seed=draw(st.integers(0, 2**31 - 1)),
                   overlap=draw(st.booleans()), multicast=draw(st.sampled_from((False, False, False, True))))
    assume(case["T"] * K * case["N"] * case["KD"] <= MAX_MACS)
    return case


def graph(op: str, E: int, K: int, KD: int, N: int):
    r = TType((f"T*{K}", E), "routing")
    if op == "moe_down":
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"a": TType((f"T*{K}", KD), "act"), "R": r}, {"weight": "e.{expert}.down"})
    else:
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"x": TType(("T", KD), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})
    for name in G.nodes[nid]["weights"].values():
        set_format(G.graph["weights"], name, FP8)
    return G, nid


def fp8x_launches(G, nid, dtype, env, overlap=False, multicast=False):
    """The node's launches with work at the step's sizes: the quantiser, then the FP8 x FP8 GEMM (with
    Tuning.moe.fp8_overlap and Tuning.moe.fp8_multicast as asked: every T here is above decode's range, where
    the multicast GEMM serves)."""
    opts = Options(dtype=dtype, tuning=Tuning(moe=MoeTuning(fp8_overlap=overlap, fp8_multicast=multicast)))
    launches = families.family_for_op(G.nodes[nid]["op"]).lower(nid, G, opts)
    running = [la for la in launches if all(sizes.evaluate(g, env) > 0 for g in la.grid)]
    assert [la.stage for la in running] == [_moe_gemm_fp8.QUANT_STAGE, _moe_gemm_fp8.VARIANT], \
        [la.stage for la in running]
    assert f"{dtype}_{_moe_gemm_fp8.NAME}" in running[1].name, running[1].name
    assert ("__ovl__" in running[1].name) == overlap, running[1].name
    assert ("__mc__" in running[1].name) == multicast, running[1].name
    return running


def poisoned_workspaces(rows: int, KD: int, down: bool) -> dict:
    q_ws, s_ws = _moe_gemm_fp8.WORKSPACES[down]
    return {q_ws: torch.full((rows, KD // 4), 0x7F7F7F7F, dtype=torch.int32, device="cuda"),
            s_ws: torch.full((rows, cdiv(KD, BLOCK)), float("nan"), dtype=torch.float32, device="cuda")}


def _abs8(q: torch.Tensor) -> torch.Tensor:
    """|q| as e4m3 (exact): sum |x w| through the same grouped product."""
    return q.float().abs().to(torch.float8_e4m3fn)


def launch_case(op: str, case: dict, overlap: bool, multicast: bool = False):
    """The case's inputs (all drawn from its seed: the same for the same case) through the node's two launches;
    the graph, ids, FP8 weights, x, the outputs by name and the workspaces."""
    dtype, T, E, K, KD, N = (case[k] for k in ("dtype", "T", "E", "K", "KD", "N"))
    down = op == "moe_down"
    g = torch.Generator().manual_seed(case["seed"])
    ids = base._ids_with_counts(case["counts"], K, g) if case["counts"] else routing_ids(T, E, K, case["routing"], g)
    ref_r, dev_r = base._routing(T, E, K, g, ids)
    G, nid = graph(op, E, K, KD, N)
    weights, fp8w = {}, {}
    for role, name in G.nodes[nid]["weights"].items():
        q, s = quantized_experts(E, N, KD, g, KD ** -0.5)
        weights[name], weights[companion_names(name, FP8)[0]] = q, s
        fp8w[role] = (q, s)
    env = {"T": T, "NP": T * K, "SMS": torch.cuda.get_device_properties(0).multi_processor_count}
    launches = fp8x_launches(G, nid, dtype, env, overlap, multicast)
    rows = T * K if down else T
    x_scale = gemm_tests.SILU_X if op == "moe_gate_up_silu" else 1.0
    x = shifted(gemm_tests.x_tokens(rows, KD, dtype, 0, 0, case["zero_rows"], g, x_scale).contiguous(),
                case["misalign"] == "inputs")
    outs = G.nodes[nid]["outputs"]
    ys = {o: shifted(empty_out((T * K, N), dtype), case["misalign"] == "outputs") for o in outs}
    work = runner().run_all(launches, values={"a" if down else "x": x, "R": dev_r, **ys}, weights=weights,
                            sizes={"T": T, "NP": T * K}, workspaces=poisoned_workspaces(rows, KD, down))
    torch.cuda.synchronize()
    return G, nid, ids, fp8w, x, ys, work


def run_case(op: str, case: dict) -> None:
    dtype, T, E, K, KD, N = (case[k] for k in ("dtype", "T", "E", "K", "KD", "N"))
    td = TORCH_DTYPES[dtype]
    down = op == "moe_down"
    G, nid, ids, fp8w, x, ys, work = launch_case(op, case, case.get("overlap", False), case.get("multicast", False))
    outs = G.nodes[nid]["outputs"]
    msg = (f"{op} T={T} E={E} K={K} KD={KD} N={N} routing={case['routing']} counts={case['counts'] is not None} "
           f"misalign={case['misalign']} zero_rows={case['zero_rows']} overlap={case.get('overlap', False)} "
           f"multicast={case.get('multicast', False)}")
    q_ws, s_ws = _moe_gemm_fp8.WORKSPACES[down]
    qx, sx = gemm_tests.check_quantiser(x, {gemm_fp8.XQ: work[q_ws], gemm_fp8.XS: work[s_ws]}, msg)
    pair_rows = torch.arange(T * K, device="cuda")
    if not down:
        pair_rows = pair_rows // K                      # a token's K pairs share its quantised row
    experts = ids.reshape(-1).to("cuda")                # pair t * K + k: expert ids[t, k]

    def product(role):
        qw, sw = fp8w[role]
        return (grouped_linear_fp8(qx, sx, pair_rows, experts, qw, sw),
                ACC_SLACK * grouped_linear_fp8(_abs8(qx), sx, pair_rows, experts, _abs8(qw), sw))

    rec = REC[op]
    if down:
        y, slack = product("weight")
        rec.check(ys[outs[0]], y, dtype, msg, slack=slack)
    else:
        (gt, gs), (ut, us) = product("gate"), product("up")
        if op == "moe_gate_up":
            rec.check(ys[outs[0]], gt, dtype, f"gate {msg}", slack=gs)
            rec.check(ys[outs[1]], ut, dtype, f"up {msg}", slack=us)
        else:
            out = ys[outs[0]]
            rec.check(out, gemm_tests.silu_as_rounded(out, gt, ut, gs, us, td), dtype, msg,
                      slack=gemm_tests.silu_slack(gt, ut, gs, us))
    rec.example()


def lite_counts(T, K, E=64, hot=(300, 257, 129, 128, 127, 64, 0, 1)):
    """E experts, T tokens of K pairs: the given counts first (row-tile edges, an empty expert), the
    rest spread evenly (whole tokens: no expert above T)."""
    counts = list(hot) + [0] * (E - len(hot))
    rest = T * K - sum(hot)
    for i in range(len(hot), E):
        counts[i] = rest // (E - len(hot)) + (1 if i - len(hot) < rest % (E - len(hot)) else 0)
    return counts


@SETTINGS
@given(case=cases())
# V2-Lite's routed experts (64 x 1408, hidden 2048, top-6), row-tile edges and an empty expert
@example(case=case_of("bf16", 300, 64, 6, 2048, 1408, counts=lite_counts(300, 6)))
# V3's 256 experts of 2048, top-8, the hidden width shrunk to 448 (3.5 K blocks: a ceil block)
@example(case=case_of("bf16", 300, 256, 8, 448, 2048, routing="skewed", seed=2))
# one expert in every token of 16384 (128 row tiles of it), odd N (element stores), fp16
@example(case=case_of("fp16", 16384, 8, 2, 144, 37, routing="hot", seed=3))
# a partial K block of 16 columns, misaligned x and zero tokens; N past a 64-column tile
@example(case=case_of("bf16", FIRST, 5, 3, 272, 200, routing="empty", misalign="inputs", zero_rows=5, seed=4))
# the overlapped K loop (moe.fp8_overlap): V2-Lite (16 K blocks: an even count); 3.5 blocks (a ceil block, an odd count)
@example(case=case_of("bf16", 300, 64, 6, 2048, 1408, counts=lite_counts(300, 6), overlap=True))
@example(case=case_of("bf16", 300, 256, 8, 448, 2048, routing="skewed", seed=2, overlap=True))
def test_moe_gate_up_silu_fp8x(case):
    run_case("moe_gate_up_silu", case)


@SETTINGS
@given(case=cases())
@example(case=case_of("bf16", 300, 64, 6, 1408, 2048, counts=lite_counts(300, 6)))            # V2-Lite
@example(case=case_of("bf16", 300, 256, 8, 2048, 448, routing="skewed", seed=6))              # V3, hidden shrunk
@example(case=case_of("fp16", 1000, 3, 2, 272, 190, routing="empty", misalign="outputs", seed=7))  # N - n0 <= 64
@example(case=case_of("bf16", 16384, 8, 2, 112, 65, routing="hot", zero_rows=5, seed=8))
# the overlapped K loop: V2-Lite's 11 K blocks; one K block (the loop's one-block tail alone)
@example(case=case_of("bf16", 300, 64, 6, 1408, 2048, counts=lite_counts(300, 6), overlap=True))
@example(case=case_of("fp16", 1000, 3, 2, 112, 190, routing="empty", misalign="outputs", seed=7, overlap=True))
# the multicast GEMM (moe.fp8_multicast): V2-Lite (experts of 3, 2 and 1 row tiles: a cluster's second tile empty)
@example(case=case_of("bf16", 300, 64, 6, 1408, 2048, counts=lite_counts(300, 6), overlap=True, multicast=True))
def test_moe_down_fp8x(case):
    run_case("moe_down", case)


@kernel_test(6)
@given(case=cases(kds=(144, 272), ns=(37, 200)))
@example(case=case_of("bf16", 400, 4, 2, 272, 200, routing="skewed", misalign="outputs", seed=9))
def test_moe_gate_up_fp8x(case):
    run_case("moe_gate_up", case)


OPS = ("moe_gate_up_silu", "moe_gate_up", "moe_down")


@kernel_test(8)
@given(op=st.sampled_from(OPS), case=cases(kds=(128, 144, 272, 720, 1408, 2048), ns=(37, 200, 264)))
# K blocks: 11 (V2-Lite's down), 5.6 (a ceil block: 6, even), 2.1 (3, odd), 1; few pairs an expert, and one expert
# taking every token of 16384 (128 row tiles: many tiles a CTA, the ring's steps carried across tiles)
@example(op="moe_down", case=case_of("bf16", 300, 64, 6, 1408, 2048, counts=lite_counts(300, 6), seed=60))
@example(op="moe_gate_up_silu", case=case_of("bf16", 257, 16, 2, 720, 200, routing="skewed", seed=61))
@example(op="moe_gate_up", case=case_of("fp16", 400, 4, 2, 272, 200, routing="empty", misalign="outputs", seed=62))
@example(op="moe_down", case=case_of("bf16", 16384, 8, 2, 720, 37, routing="hot", seed=63))
@example(op="moe_gate_up_silu", case=case_of("bf16", 2048, 8, 2, 128, 264, routing="uniform", zero_rows=5, seed=64))
def test_moe_fp8x_overlap_is_bit_equal(op, case):
    """moe.fp8_overlap: each block's promotion under the next block's wgmma, the same FMAs in the same order per
    accumulator: the outputs are the knob-off launch's bit for bit, poisoned elements included."""
    _bit_equal(op, case, launch_case(op, case, overlap=False), launch_case(op, case, overlap=True))


def _bit_equal(op, case, off, on):
    for name in off[0].nodes[off[1]]["outputs"]:
        a, b = off[5][name], on[5][name]
        same = a.view(torch.int16) == b.view(torch.int16)
        assert bool(same.all()), (f"{op} {case}: {name} differs at {int((~same).sum())} of {same.numel()} elements, "
                                  f"first at {(~same).nonzero()[0].tolist()}")


@kernel_test(10)
@given(op=st.sampled_from(OPS), case=cases(kds=(128, 144, 272, 720, 1408, 2048), ns=(37, 64, 65, 200, 264)))
# V2-Lite: experts of 3 (300, 257 pairs), 2 (129) and 1 (128, 127, 64, 1) row tiles and an empty one; V3's 256
# experts (most of 1 tile); one expert taking every token of 16384 (128 tiles: 64 items of two); experts of 3, 1
# and 4 tiles (300, 100, 400 pairs); DOWN with N - n0 <= 64 (rank 1 issues no box: N = 65, 190)
@example(op="moe_gate_up_silu", case=case_of("bf16", 300, 64, 6, 2048, 1408, counts=lite_counts(300, 6), seed=70))
@example(op="moe_down", case=case_of("bf16", 300, 64, 6, 1408, 2048, counts=lite_counts(300, 6), seed=71))
@example(op="moe_down", case=case_of("bf16", 300, 256, 8, 2048, 448, routing="skewed", seed=72))
@example(op="moe_gate_up_silu", case=case_of("bf16", 16384, 8, 2, 720, 200, routing="hot", seed=73))
@example(op="moe_gate_up", case=case_of("fp16", 400, 4, 2, 272, 200, counts=[300, 0, 100, 400], misalign="outputs",
                                        seed=74))
@example(op="moe_down", case=case_of("fp16", 1000, 3, 2, 272, 65, routing="empty", seed=75))
@example(op="moe_down", case=case_of("bf16", 1000, 3, 2, 112, 190, routing="uniform", seed=76))
def test_moe_fp8x_multicast_is_bit_equal(op, case):
    """moe.fp8_multicast: the tile's arithmetic unchanged, only where its weight bytes come from: the outputs are
    the knob-off launch's bit for bit (both with the case's overlap), poisoned elements included."""
    ovl = case.get("overlap", False)
    _bit_equal(op, case, launch_case(op, case, overlap=ovl), launch_case(op, case, overlap=ovl, multicast=True))
