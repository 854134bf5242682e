"""Decode's wgmma + TMA grouped expert GEMM (templates/include/moe_wgmma_skinny.cuh; built for
sm_90a; moe.decode_wgmma) against the ops' references, switched on here for its token range
(the GEMV's 8 < T <= the prefill wgmma's 256).

Each example lowers a one-node graph (the default target, sm_90) with the variant on, checks that
the wgmma_skinny launch is the one that runs at its T (the GEMV's and the prefill wgmma's grids are
0), runs every launch on poisoned outputs through the tests' KernelRunner (which builds the kernel
for sm_90a, as a bundle does), and compares with the op's reference rounded where the kernel rounds
(test_kernels_moe._grouped: element-wise and norm-wise, assert_strict).

Pair counts per expert sit around the tile's edges: 0 (no tile), 1, 2 (the light experts the mma
launch gave the CUDA cores), 7 / 8 / 9, 15 / 16 / 17 (wgmma N = 16), 31 / 32 / 33 (N = 32),
63 / 64 / 65 (N = 64; 65 is two row tiles), 100, 129 and 256 (several row tiles of one expert).
Down's one-token launch (the deeper ring, one CTA an SM) has its own test at T = 1, K of E experts
one pair each.
Widths: KD a multiple of 8 (the variant's condition) but not of the 64-wide K slice, N not a
multiple of the column tile (and odd), the V2-Lite shapes in fixed examples.  Operands one element
past an aligned base: x (element loads into the same swizzled layout) and the outputs.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_kernels_moe as base  # noqa: E402
import test_kernels_moe_wgmma as wgmma_tests  # noqa: E402
from test_kernels_moe_wgmma import _down, _gate_up  # noqa: E402
from harness import GPU_MARKS, kernel_test  # noqa: E402

from codegen import families, sizes  # noqa: E402
from codegen.families import _moe_wgmma_skinny  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                             reason="the wgmma variant needs a compute capability 9.0 GPU (sm_90a)")
pytestmark = [*GPU_MARKS, _HOPPER]

WS_COUNTS = (0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 129, 256)


runner = wgmma_tests.runner_fixture("wgmma_skinny")


ONE = _moe_wgmma_skinny.ONE_TOKEN_STAGE


def _lower_skinny(G, nid, dtype, ran: list | None = None, tuning: Tuning = Tuning()):
    """The family's launches with the decode wgmma variant on (down: its one-token launch too)."""
    launches = families.family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(dtype=dtype, tuning=tuning))
    one = [ONE] * (G.nodes[nid]["op"] == "moe_down" and tuning.moe.one_token_down_stages > _moe_wgmma_skinny.STAGES)
    assert [la.stage for la in launches] == ["wgmma_skinny", *one, "wgmma"], [la.stage for la in launches]
    if ran is not None:
        ran.extend(launches)
    return launches


def _check_skinny_ran(launches, T, K, stage="wgmma_skinny"):
    """`stage` is the one launch whose grid is not 0 at T."""
    env = {"T": T, "NP": T * K, "SMS": torch.cuda.get_device_properties(0).multi_processor_count}
    running = [la.stage for la in launches if sizes.evaluate(la.grid[0], env) > 0]
    assert running == [stage], (T, running)


def _run(runner, op, case, stage="wgmma_skinny", tuning: Tuning = Tuning()):
    ran: list = []
    base._grouped(runner, op, case, lower=lambda G, nid, dtype: _lower_skinny(G, nid, dtype, ran, tuning))
    _check_skinny_ran(ran, case["T"], case["K"], stage)


@st.composite
def skinny_cases(draw, KDS, NS):
    """Every expert's pair count from WS_COUNTS (the last one evening out whole tokens), K as
    large as distinct experts per token allow, 8 < T <= 256."""
    E = draw(st.sampled_from((1, 2, 3, 5, 8, 64)))
    counts = [draw(st.sampled_from(WS_COUNTS)) if E <= 8 or i < 8 else draw(st.sampled_from((0, 0, 1, 2, 3)))
              for i in range(E)]
    if sum(counts) == 0:
        counts[0] = 17
    for K in sorted({min(E, k) for k in (1, 2, 6, draw(st.sampled_from((2, 3, 6))))}, reverse=True):
        c = counts[:-1] + [counts[-1] + (-sum(counts)) % K]
        if max(c) <= sum(c) // K:
            counts = c
            break
    T = sum(counts) // K
    assume(8 < T <= 256)
    KD, N = draw(st.sampled_from(KDS)), draw(st.sampled_from(NS))
    return {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "T": T, "E": E, "K": K, "counts": counts,
            "KD": KD, "N": N, "misalign": draw(st.sampled_from(("none", "none", "inputs", "outputs"))),
            "seed": draw(st.integers(0, 2**31 - 1))}


def _case(dtype, counts, K, KD, N, misalign="none", seed=21):
    T = sum(counts) // K
    assert sum(counts) % K == 0 and max(counts) <= T and 8 < T <= 256, (counts, K)
    return {"dtype": dtype, "T": sum(counts) // K, "E": len(counts), "K": K, "counts": list(counts), "KD": KD, "N": N,
            "misalign": misalign, "seed": seed}


def _lite(counts_head, K=6):
    """64 experts, the given counts first, the rest 0 / 1 / 2 (decode's light experts), whole tokens."""
    counts = list(counts_head) + [(0, 1, 2)[i % 3] for i in range(64 - len(counts_head))]
    counts[-1] += (-sum(counts)) % K
    return counts


GATE_UP_KD, GATE_UP_N = (40, 64, 136, 264), (15, 37, 64, 128, 200)
DOWN_KD, DOWN_N = (40, 64, 136, 200), (41, 64, 128, 136, 200, 264)


@given(case=skinny_cases(GATE_UP_KD, GATE_UP_N))
@example(case=_case("bf16", _lite((17, 33, 65, 9, 16, 32, 64, 40, 50, 60)), 6, 2048, 1408))   # V2-Lite widths
@example(case=_case("bf16", (15, 16, 17, 31, 32, 33), 2, 136, 37))                 # odd N
@example(case=_case("fp16", (256, 129, 100, 27, 0, 0), 2, 264, 200))                # several row tiles an expert
@example(case=_case("bf16", (63, 64, 65), 1, 40, 128, "inputs"))                   # x misaligned: element loads
@example(case=_case("fp16", (9, 8, 7, 1), 1, 64, 200, "outputs"))                  # outputs misaligned
@kernel_test(10)
def test_moe_gate_up_silu_wgmma_skinny(runner, case):
    _run(runner, "moe_gate_up_silu", _gate_up(case))


@given(case=skinny_cases(GATE_UP_KD, GATE_UP_N))
@example(case=_case("fp16", (17, 64, 0, 33), 1, 136, 37))
@kernel_test(4)
def test_moe_gate_up_wgmma_skinny(runner, case):
    _run(runner, "moe_gate_up", _gate_up(case))


@given(case=skinny_cases(DOWN_KD, DOWN_N))
@example(case=_case("bf16", _lite((17, 33, 65, 9, 16, 32, 64, 40, 50, 60)), 6, 1408, 2048))   # V2-Lite widths
@example(case=_case("fp16", (15, 16, 17, 31, 32, 33), 2, 200, 41))                 # odd N; N - n0 <= 64: one box
@example(case=_case("bf16", (256, 129, 100, 27, 0, 0), 2, 136, 200))                # second column tile: one box
@example(case=_case("bf16", (63, 64, 65), 1, 40, 264, "inputs"))
@example(case=_case("fp16", (9, 8, 7, 1), 1, 64, 136, "outputs"))
@kernel_test(10)
def test_moe_down_wgmma_skinny(runner, case):
    _run(runner, "moe_down", _down(case))


@st.composite
def one_token_cases(draw):
    """One token: K of E experts one pair each (a partial row tile an expert, every tile one pair),
    the widths of the two-CTA launch's cases and V2-Lite's / V3's down in the examples."""
    E = draw(st.sampled_from((1, 2, 3, 5, 8, 64, 66)))
    K = draw(st.integers(1, min(E, 9)))
    chosen = draw(st.permutations(range(E)))[:K]
    counts = [int(e in chosen) for e in range(E)]
    return {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "T": 1, "E": E, "K": K, "counts": counts,
            "KD": draw(st.sampled_from(DOWN_KD)), "N": draw(st.sampled_from(DOWN_N)),
            "misalign": draw(st.sampled_from(("none", "none", "inputs", "outputs"))),
            "seed": draw(st.integers(0, 2**31 - 1))}


def _one(dtype, E, experts, KD, N, misalign="none", seed=23):
    counts = [int(e in experts) for e in range(E)]
    return {"dtype": dtype, "T": 1, "E": E, "K": len(experts), "counts": counts, "KD": KD, "N": N,
            "misalign": misalign, "seed": seed}


@given(case=one_token_cases())
@example(case=_one("bf16", 66, (0, 1, 5, 17, 30, 41, 50, 65), 1408, 2048))    # V2-Lite b=1: 128 tiles, one a CTA
@example(case=_one("bf16", 66, (0, 1, 5, 17, 30, 41, 50, 65, 3), 1408, 2048))   # 9 pairs, 144 tiles: some CTAs
                                                                                # of a 132-SM grid walk two
@example(case=_one("fp16", 3, (2, 0), 200, 41))                                 # odd N, one box
@example(case=_one("bf16", 5, (4,), 40, 264, "inputs"))                         # KD under one K slice; a misaligned
@example(case=_one("fp16", 8, (1, 6, 7), 136, 136, "outputs"))                  # partial column tile; outputs misaligned
@kernel_test(10)
def test_moe_down_one_token_launch(runner, case):
    """Down's one-token launch (moe.one_token_down_stages: the deeper ring, one CTA an
    SM, more of its first tile's slices before the wait) is the one that runs at T = 1 and matches
    the reference; 22 K slices at V2-Lite's widths wrap its 8-stage ring almost three times."""
    _run(runner, "moe_down", _down(case), stage=ONE)


@pytest.mark.parametrize("staged", [16, 32])
@pytest.mark.parametrize("op,case", [
    ("moe_gate_up_silu", _case("bf16", _lite((17, 33, 65, 9, 16, 32, 64, 40, 50, 60)), 6, 2048, 1408)),
    ("moe_gate_up_silu", _case("fp16", (15, 16, 17, 31, 32, 33), 2, 136, 37)),        # odd N: element stores
    ("moe_down", _case("bf16", (256, 129, 100, 27, 0, 0), 2, 136, 200)),               # partial column tile
    ("moe_down", _case("fp16", (63, 64, 65, 9), 1, 40, 264, "outputs")),               # outputs misaligned
])
def test_wgmma_skinny_staged_epilogue(runner, op, case, staged):
    """The epilogue through shared memory (moe.decode_staged_from, 0 in these two launches, which
    serve 1-3 tokens: on, b=1 read 3% slower): tiles of at least `staged` pairs store through their
    last ring stage in 16-byte chunks, the narrower ones element by element."""
    _run(runner, op, _gate_up(case) if op != "moe_down" else _down(case),
         tuning=Tuning(moe=MoeTuning(decode_staged_from=staged)))
