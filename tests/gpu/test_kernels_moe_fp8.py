"""Property tests: the grouped expert GEMMs with FP8 weights (fp8_e4m3_block128: float8_e4m3fn
[E, N, KD] and a float32 scale per 128 x 128 block [E, ceil(N / 128), ceil(KD / 128)];
templates/include/moe_fp8.cuh, the "wgmma_skinny_fp8" row of codegen/dispatch.py's grouped_experts
table, which serves every T) against the ops' references on the weights dequantised exactly
(float64, from the same bytes and scales) and the kernel's own rounded inputs.

Hypothesis draws pair counts per expert around the kernel's 32-pair row tile (0: no tile, 1, 2,
15 / 16 / 17 (wgmma N = 16), 31 / 32 / 33 (N = 32; 33 is two row tiles), 64, 65, 100), T from 1
to 192 (decode's range; an example above it: the prefill fallback), widths with ceil blocks (KD a
multiple of 16 but not of 128: a partial last K block; N not a multiple of 128: a partial last
row block, and of the 64 / 128-row tile), x or the outputs one element past an aligned base.
Weight bytes span e4m3's range in every block and block scales differ by up to 16x, so a scale
taken from the wrong block moves the result far past the tolerance; outputs are poisoned first.
The planted mutants of tests/gpu/test_mutants.py (a K slice scaled by the next K block's scale,
the ceil row block dropped from the scale layout, the gate and up scales swapped) run through these
bodies and must fail them.

The decode refinements, each behind its Tuning.moe knob (off by default) and tested with it on: down's
one-token launch (fp8_one_token_down), gate / up's shared-expert tile before the PDL wait behind the real
route as a slow PDL producer (fp8_shared_before_wait), the widening under the tensor core
(fp8_widen_ahead); their mutants: the one-token launch's early slices one K slice off and its tiles'
scales from the neighbouring row block, the shared tile reading the route's ids before the wait, the
widened-ahead box from the wrong stage and a box scaled by the next K block's scale.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_kernels_moe as base  # noqa: E402
import test_kernels_moe_wgmma as wgmma_tests  # noqa: E402
from harness import GPU_MARKS, TORCH_DTYPES, kernel_test, poison, shifted, single_op_graph, tiny_model  # noqa: E402

from codegen import families, sizes  # noqa: E402
from codegen.families import _moe_fp8  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402
from ir.formats import FP8, cdiv, companion_names, set_format  # noqa: E402
from ir.graph import node_view  # noqa: E402
from ir.ops import OPS, TType  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                             reason="the FP8 expert kernel needs a compute capability 9.0 GPU (sm_90a)")
pytestmark = [*GPU_MARKS, _HOPPER]

BLOCK = FP8.block[0]
COUNTS = (0, 1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 100)

runner = wgmma_tests.runner_fixture("fp8")


def quantized_experts(E: int, rows: int, K: int, gen, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [E, rows, K], s float32 [E, ceil(rows / 128), ceil(K / 128)]) on the GPU,
    quantised as DeepSeek-V3's checkpoints are (s = the block's amax / 448), blocks of about `scale`
    an element times 2^[-2, 2): the bytes span e4m3's range in every block, the scales differ."""
    rb, kb = cdiv(rows, BLOCK), cdiv(K, BLOCK)
    size = torch.exp2(torch.rand((E, rb, kb), generator=gen) * 4 - 2) * scale
    spread = size.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    w = torch.randn(spread.shape, generator=gen) * spread
    w[:, rows:, :] = 0
    w[:, :, K:] = 0
    s = w.abs().view(E, rb, BLOCK, kb, BLOCK).amax(dim=(2, 4)).clamp_min(1e-30) / 448
    q = (w / s.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2))[:, :rows, :K].to(torch.float8_e4m3fn)
    return q.contiguous().cuda(), s.cuda()


def dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W = q * s per 128 x 128 block (edge blocks partial), exactly, in float64 on the CPU."""
    _, rows, K = q.shape
    full = s.double().cpu().repeat_interleave(BLOCK, 1)[:, :rows].repeat_interleave(BLOCK, 2)[:, :, :K]
    return q.cpu().double() * full


def lower_fp8(G, nid, dtype, **moe):
    """The weight-only FP8 launches at every T: moe.fp8_activations off keeps the activations 16-bit above
    decode too (on, the FP8 x FP8 launches serve there: test_kernels_moe_gemm_fp8.py); `moe`: other knobs
    (the FP8 variants, off by default)."""
    tuning = Tuning(moe=MoeTuning(fp8_activations=False, **moe))
    launches = families.family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(dtype=dtype, tuning=tuning))
    assert all(la.stage.startswith(_moe_fp8.VARIANT) for la in launches), [la.stage for la in launches]
    assert all(f"{dtype}_{_moe_fp8.NAME}" in la.name for la in launches), [la.name for la in launches]
    return launches


def run_case(runner, op, case, expect=_moe_fp8.VARIANT, **moe):
    """One example: the FP8 launches on poisoned outputs against the reference on the dequantised weights;
    `expect`: the stage of the one launch that runs at the case's T; `moe`: knobs (lower_fp8)."""
    dtype, T, E, K, KD, N = (case[k] for k in ("dtype", "T", "E", "K", "KD", "N"))
    tdt = TORCH_DTYPES[dtype]
    g = torch.Generator().manual_seed(case["seed"])
    ids = base._ids_with_counts(case["counts"], K, g)
    ref_r, dev_r = base._routing(T, E, K, g, ids)
    r = TType((f"T*{K}", E), "routing")
    if op == "moe_down":
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"a": TType((f"T*{K}", KD), "act"), "R": r}, {"weight": "e.{expert}.down"})
        inp = torch.randn(T * K, KD, generator=g).to(tdt)
        first = "a"
    else:
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"x": TType(("T", KD), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})
        inp = torch.randn(T, KD, generator=g).to(tdt)
        first = "x"
    bound = G.nodes[nid]["weights"]
    weights, ref_w = {}, {}
    for role, name in bound.items():
        set_format(G.graph["weights"], name, FP8)
        q, s = quantized_experts(E, N, KD, g, KD ** -0.5)
        weights[name], weights[companion_names(name, FP8)[0]] = q, s
        ref_w[role] = dequantized(q, s)
    launches = lower_fp8(G, nid, dtype, **moe)
    env = {"T": T, "NP": T * K, "SMS": torch.cuda.get_device_properties(0).multi_processor_count}
    assert [la.stage for la in launches if sizes.evaluate(la.grid[0], env) > 0] == [expect]
    outs = G.nodes[nid]["outputs"]
    mis = case.get("misalign", "none")
    values = {first: shifted(inp.cuda(), mis == "inputs"), "R": dev_r,
              **{o: poison(shifted(torch.empty(T * K, N, dtype=tdt, device="cuda"), mis == "outputs")) for o in outs}}
    runner.run_all(launches, values=values, weights=weights, sizes={"T": T, "NP": T * K})
    if op == "moe_gate_up_silu":
        refs = [base._gate_up_silu_rounded(G, nid, inp, ref_r, ref_w, tdt)]
    else:
        refs = OPS[op].run(node_view(G, nid), [inp.double(), ref_r], ref_w, None)
    for o, ref in zip(outs, refs):
        base._record(f"{op} fp8", dtype, values[o], ref)


@st.composite
def fp8_cases(draw, KDS, NS, tokens=(1, 192)):
    """Pair counts from COUNTS (the last expert evening out whole tokens), K as large as distinct
    experts per token allow, T in `tokens`."""
    E = draw(st.sampled_from((1, 2, 3, 5, 8, 64)))
    counts = [draw(st.sampled_from(COUNTS)) if E <= 8 or i < 8 else draw(st.sampled_from((0, 0, 1, 2, 3)))
              for i in range(E)]
    if sum(counts) == 0:
        counts[0] = 1
    for K in sorted({min(E, k) for k in (1, 2, 6, draw(st.sampled_from((2, 3, 6))))}, reverse=True):
        c = counts[:-1] + [counts[-1] + (-sum(counts)) % K]
        if max(c) <= sum(c) // K:
            counts = c
            break
    T = sum(counts) // K
    assume(tokens[0] <= T <= tokens[1] and max(counts) <= T)
    return {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "T": T, "E": E, "K": K, "counts": counts,
            "KD": draw(st.sampled_from(KDS)), "N": draw(st.sampled_from(NS)),
            "misalign": draw(st.sampled_from(("none", "none", "inputs", "outputs"))),
            "seed": draw(st.integers(0, 2**31 - 1))}


def case_of(dtype, counts, K, KD, N, misalign="none", seed=31):
    assert sum(counts) % K == 0 and max(counts) <= sum(counts) // K, (counts, K)
    return {"dtype": dtype, "T": sum(counts) // K, "E": len(counts), "K": K, "counts": list(counts), "KD": KD,
            "N": N, "misalign": misalign, "seed": seed}


def lite(head, K=6):
    """64 experts, the given counts first, the rest 0 / 1 / 2, whole tokens."""
    counts = list(head) + [(0, 1, 2)[i % 3] for i in range(64 - len(head))]
    counts[-1] += (-sum(counts)) % K
    return counts


def one_token(E, experts):
    return [int(e in experts) for e in range(E)]


KDS, NS = (64, 144, 272, 528), (37, 64, 128, 200, 264)


@given(case=fp8_cases(KDS, NS))
@example(case=case_of("bf16", lite((17, 33, 65, 9, 16, 32, 31, 40, 50, 60)), 6, 2048, 1408))   # V2-Lite widths
@example(case=case_of("bf16", one_token(64, (0, 3, 9, 17, 40, 63)), 6, 2048, 1408))          # V2-Lite b=1
@example(case=case_of("fp16", (15, 16, 17, 31, 32, 33), 2, 144, 37))                 # ceil K block; odd N
@example(case=case_of("bf16", (100, 65, 64, 0, 33, 2), 2, 272, 200, "inputs"))     # several row tiles; x misaligned
@example(case=case_of("bf16", (300, 290, 10, 0), 2, 144, 200))                      # T = 300: above decode
@kernel_test(12)
def test_moe_gate_up_silu_fp8(runner, case):
    run_case(runner, "moe_gate_up_silu", case)


@given(case=fp8_cases(KDS, NS))
@example(case=case_of("bf16", (17, 64, 0, 33), 1, 272, 200, "outputs"))
@kernel_test(4)
def test_moe_gate_up_fp8(runner, case):
    run_case(runner, "moe_gate_up", case)


@given(case=fp8_cases(KDS, NS + (1408, 2048)))
@example(case=case_of("bf16", lite((17, 33, 65, 9, 16, 32, 31, 40, 50, 60)), 6, 1408, 2048))   # V2-Lite widths
@example(case=case_of("bf16", one_token(64, (0, 3, 9, 17, 40, 63)), 6, 1408, 2048))          # V2-Lite b=1
@example(case=case_of("fp16", (15, 16, 17, 31, 32, 33), 2, 272, 41))              # N - n0 <= 64: one box
@example(case=case_of("bf16", (100, 65, 64, 0, 33, 2), 2, 144, 200, "outputs"))   # ceil row block, column tile 2
@kernel_test(12)
def test_moe_down_fp8(runner, case):
    run_case(runner, "moe_down", case)


@st.composite
def one_token_cases(draw):
    """One token: K of E experts one pair each (a one-pair row tile an expert), down's widths of
    fp8_cases and V2-Lite's in the examples."""
    E = draw(st.sampled_from((1, 2, 3, 5, 8, 64, 66)))
    K = draw(st.integers(1, min(E, 9)))
    chosen = draw(st.permutations(range(E)))[:K]
    return {**case_of(draw(st.sampled_from(("bf16", "fp16"))), one_token(E, chosen), K,
                      draw(st.sampled_from(KDS + (1408,))), draw(st.sampled_from(NS + (2048,))),
                      draw(st.sampled_from(("none", "none", "inputs", "outputs"))), draw(st.integers(0, 2**31 - 1)))}


@given(case=one_token_cases())
@example(case=case_of("bf16", one_token(66, (0, 1, 5, 17, 30, 41, 50, 65)), 8, 1408, 2048))      # V2-Lite b=1: 128 tiles
@example(case=case_of("bf16", one_token(66, (0, 1, 5, 17, 30, 41, 50, 65, 3)), 9, 1408, 2048))   # 144 tiles on 132 CTAs
@example(case=case_of("fp16", one_token(3, (2, 0)), 2, 272, 37))                                  # odd N, one box
@example(case=case_of("bf16", one_token(5, (4,)), 1, 64, 264, "inputs"))                          # KD: one K slice
@example(case=case_of("fp16", one_token(8, (1, 6, 7)), 3, 144, 136, "outputs"))                   # ceil K block
@kernel_test(10)
def test_moe_down_fp8_one_token_launch(runner, case):
    """Down's FP8 one-token launch (moe.fp8_one_token_down: one CTA an SM, a ring of 16 FP8 stages, all
    of its first tile's 16 slices issued before its wait) is the one that runs at T = 1 and matches the
    reference; V2-Lite's 22 K slices wrap the 16-stage ring, and at 144 tiles some of the 132 CTAs
    (an H100's SMs) walk a second tile."""
    run_case(runner, "moe_down", case, expect=_moe_fp8.ONE_TOKEN_VARIANT, fp8_one_token_down=True)


def _route_then_gate_up_silu(T, S, dtype, g, E=64, K=6, D=2048, M=1408):
    """V2-Lite's route (S shared experts, laid out as the route lays them: token t's shared pair s at
    t * (K + S) + K + s) and the FP8 gate_up_silu after it with moe.fp8_shared_before_wait on: (plain
    launches, PDL launches, weights, values, gate_up_silu's graph and node, its dequantised weights)."""
    import dataclasses
    from codegen.families import _moe
    m = tiny_model()
    act = lambda *s: TType(s, "act")     # noqa: E731
    P = K + S
    route_attrs = {"num_experts": E, "top_k": K, "scoring": "softmax", "method": "greedy", "groups": 1,
                   "topk_groups": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "shared_experts": S}
    Gr, nr = single_op_graph(m, "moe_route", route_attrs, {"h": act("T", D)}, {"gate": "router.w"},
                             outputs=["ids", "rw", "R"])
    Gg, ng = single_op_graph(m, "moe_gate_up_silu", {"num_experts": E + S, "out_dim": M},
                             {"h": act("T", D), "R": TType((f"T*{P}", E + S), "routing")},
                             {"gate": "e.{expert}.gate", "up": "e.{expert}.up"}, outputs=["a"])
    weights, ref_w = {"router.w": (torch.randn(E, D, generator=g) / D ** 0.5 * 2).cuda()}, {}
    for role, name in Gg.nodes[ng]["weights"].items():
        set_format(Gg.graph["weights"], name, FP8)
        q, s = quantized_experts(E + S, M, D, g, D ** -0.5)
        weights[name], weights[companion_names(name, FP8)[0]] = q, s
        ref_w[role] = dequantized(q, s)
    saved = _moe.routing_shared
    _moe.routing_shared = lambda G, routing: S       # (the test graph takes the routing as an input)
    try:
        expert = lower_fp8(Gg, ng, dtype, fp8_shared_before_wait=True)
    finally:
        _moe.routing_shared = saved
    assert all(f"sh{S}w" in la.name for la in expert), [la.name for la in expert]
    plain = families.family_for_op("moe_route").lower(nr, Gr, Options(dtype=dtype)) + expert
    pdl = [dataclasses.replace(la, pdl=True) for la in plain]
    tdt = TORCH_DTYPES[dtype]
    values = {"h": torch.randn(T, D, generator=g).to("cuda", tdt),
              "ids": torch.empty(T, P, dtype=torch.int64, device="cuda"),
              "rw": torch.empty(T, P, dtype=torch.float32, device="cuda"),
              "R.order": torch.empty(T * P, dtype=torch.int32, device="cuda"),
              "R.offsets": torch.empty(E + S + 1, dtype=torch.int32, device="cuda"),
              "a": torch.empty(T * P, M, dtype=tdt, device="cuda")}
    return plain, pdl, weights, values, (Gg, ng), ref_w


def _chain(runner, launches, values, weights, T, P, sync_each=False):
    shared: dict = {}
    for la in launches:
        shared.update(runner.run_all([la], values=values, weights=weights, sizes={"T": T, "NP": T * P},
                                     workspaces=shared))
        if sync_each:
            torch.cuda.synchronize()


def _stale_routing(values):
    """Before a run: the routing a run must not read before the route writes it, valid but wrong (every
    pair token 0's, as if of the last step's first token) so that an early read gives wrong rows, not a
    fault; the outputs poisoned."""
    values["R.order"].zero_()
    for k in ("ids", "rw", "a"):
        poison(values[k])


@st.composite
def shared_chain_cases(draw):
    return {"T": draw(st.sampled_from((1, 2, 3, 9, 31, 32, 33, 130))), "S": draw(st.integers(1, 3)),
            "dtype": draw(st.sampled_from(("bf16", "fp16"))), "seed": draw(st.integers(0, 2**31 - 1))}


@given(case=shared_chain_cases())
@example(case={"T": 1, "S": 2, "dtype": "bf16", "seed": 51})     # V2-Lite b=1: 44 shared tiles of 176
@example(case={"T": 9, "S": 2, "dtype": "bf16", "seed": 52})     # tokens past the first: an early read is wrong
@example(case={"T": 32, "S": 3, "dtype": "fp16", "seed": 53})    # the most tokens the early tile takes
@example(case={"T": 33, "S": 2, "dtype": "bf16", "seed": 54})    # two row tiles a shared expert: no early tile
@kernel_test(6)
def test_moe_gate_up_silu_fp8_shared_tile_before_the_wait_of_a_running_route(runner, case):
    """moe.fp8_shared_before_wait behind a slow producer: the route (router GEMV, top-k, alignment) runs
    while gate_up_silu's shared tiles run their K loops, both PDL launches, eagerly and replayed from a
    captured graph, each run on a new h (a new routing) with the routing left stale and the outputs
    poisoned before it: a shared tile that read the route's `order` (or anything else of the route)
    before its wait gathers the stale rows.  Every run's `a` is bitwise the serial run's (route, sync,
    gate_up_silu), and the serial run is within the 1% bounds of the reference on the dequantised
    weights, its routing the route's own.  Above 32 tokens (two row tiles a shared expert) the kernel takes
    no early tile: the walk's other row tile would take its pairs from `order`, not by token."""
    T, S, dtype = case["T"], case["S"], case["dtype"]
    g = torch.Generator().manual_seed(case["seed"])
    plain, pdl, weights, values, (Gg, ng), ref_w = _route_then_gate_up_silu(T, S, dtype, g)
    P = 6 + S
    serial = {k: v.clone() for k, v in values.items()}
    _chain(runner, pdl, values, weights, T, P)            # every module loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _chain(runner, pdl, values, weights, T, P)
    for run in range(6):
        h = torch.randn(T, values["h"].shape[1], generator=g).to(values["h"])
        values["h"].copy_(h)
        serial["h"].copy_(h)
        _stale_routing(serial)
        _chain(runner, plain, serial, weights, T, P, sync_each=True)
        _stale_routing(values)
        if run % 2:
            graph.replay()
        else:
            _chain(runner, pdl, values, weights, T, P)
        torch.cuda.synchronize()
        assert torch.equal(values["a"], serial["a"]), f"run {run}: a differs from the serial run"
    ids = serial["ids"].cpu()
    assert (ids[:, 6:] == torch.arange(S)).all(), "the route lays its shared pairs last"
    from ir.ops.moe import align_ref
    routing = align_ref(ids, 64 + S)
    base._record("moe_gate_up_silu fp8 shared", dtype, serial["a"],
                 base._gate_up_silu_rounded(Gg, ng, serial["h"].cpu(), routing, ref_w, TORCH_DTYPES[dtype]))


@st.composite
def ahead_cases(draw):
    return {**draw(fp8_cases(KDS, NS + (1408, 2048))), "op": draw(st.sampled_from(("moe_gate_up_silu", "moe_gate_up",
                                                                                     "moe_down")))}


@given(case=ahead_cases())
@example(case={**case_of("bf16", one_token(64, (0, 3, 9, 17, 40, 63)), 6, 2048, 1408), "op": "moe_gate_up_silu"})
@example(case={**case_of("bf16", one_token(64, (0, 3, 9, 17, 40, 63)), 6, 1408, 2048), "op": "moe_down"})
@example(case={**case_of("fp16", (15, 16, 17, 31, 32, 33), 2, 144, 37), "op": "moe_gate_up"})   # both tile widths
@example(case={**case_of("bf16", (9, 8, 7, 1), 1, 64, 200, "outputs"), "op": "moe_down"})      # one K slice
@kernel_test(12)
def test_moe_fp8_widen_ahead(runner, case):
    """moe.fp8_widen_ahead: each box widened while the box before it is on the tensor core (16-pair tiles;
    the 32-pair ones keep the plain tile) matches the reference as the plain tile does, every op, one and
    many K slices (the next slice's first box from the next ring stage, wrapping the ring)."""
    run_case(runner, case["op"], case, fp8_widen_ahead=True)


@given(case=one_token_cases())
@example(case=case_of("bf16", one_token(66, (0, 1, 5, 17, 30, 41, 50, 65)), 8, 1408, 2048))
@kernel_test(4)
def test_moe_down_fp8_one_token_launch_widen_ahead(runner, case):
    """The one-token launch's 16-stage ring with the widen-ahead tiles."""
    run_case(runner, "moe_down", case, expect=_moe_fp8.ONE_TOKEN_VARIANT, fp8_one_token_down=True,
             fp8_widen_ahead=True)
