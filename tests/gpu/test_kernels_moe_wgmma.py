"""The wgmma + TMA grouped expert GEMM (templates/include/moe_wgmma.cuh; built for sm_90a, above
moe.prefill_wgmma_above tokens by default) against the ops' references, switched on here for every
T above the GEMV's 8 tokens.

Each example lowers a one-node graph (the default target, sm_90) with the variant on, checks that
the wgmma launch is the one that runs at its T (the table lowers no mma launch there), runs every launch on
poisoned outputs through the tests' KernelRunner (which builds the wgmma kernel for sm_90a, as a
bundle does), and compares with the op's reference rounded where the kernel rounds
(test_kernels_moe._grouped: element-wise and norm-wise, assert_strict).

Pair counts per expert sit around the tile's edges: 0 (no tile), 1, 63 / 64 / 65 (a consumer
warpgroup's 64 rows), 127 / 128 / 129 (the 128-pair row tile), 255 .. 257, and 1000+ (many row
tiles; the persistent CTAs then walk several tiles and the stage ring wraps many times).  Widths:
KD a multiple of 8 (the variant's condition) but not of the 64-wide K slice, N not a multiple of the
column tile (and odd: element stores), the V2-Lite shapes in fixed examples.  Operands one element
past an aligned base: x (element loads into the same swizzled layout) and the outputs (element
stores); a misaligned weight cannot be described by a tensor map and is refused at launch.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_kernels_moe as base  # noqa: E402
from harness import GPU_MARKS, kernel_test  # noqa: E402

from codegen import families, sizes  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                             reason="the wgmma variant needs a compute capability 9.0 GPU (sm_90a)")
pytestmark = [*GPU_MARKS, _HOPPER]

WG_COUNTS = (0, 1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 1500)


def runner_fixture(label: str):
    """A module's KernelRunner fixture that prints "EXAMPLES <family> (<label>) ..." at its end, as
    test_kernels_moe prints them (run_isolated: one test a process)."""
    @pytest.fixture(scope="module")
    def runner():
        from runtime.launcher import KernelRunner
        r = KernelRunner()
        yield r
        r.close()
        for fam in sorted(base.STATS):
            per = base.STATS[fam]
            detail = " ".join(f"{dt}:n={v[0]},max_abs={v[2]:.3g},norm={v[1]:.3g},rel={base.REL[fam][dt]:.3g}"
                              for dt, v in sorted(per.items()))
            print(f"\nEXAMPLES {fam} ({label}) {sum(v[0] for v in per.values())} "
                  f"worst_err {max(v[1] for v in per.values()):.3g}  ({detail})")
    return runner


runner = runner_fixture("wgmma")


def _lower_wgmma(G, nid, dtype, ran: list | None = None):
    """The family's launches with the wgmma variant above 8 tokens (the GEMV's; decode's wgmma off:
    its own test file).  The mma rows' token range is then empty, so the table lowers no mma launch."""
    tuning = Tuning(moe=MoeTuning(prefill_wgmma_above=8, decode_wgmma=False))
    launches = families.family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(dtype=dtype, tuning=tuning))
    assert [la.stage for la in launches] == ["gemv", "wgmma"], [la.stage for la in launches]
    if ran is not None:
        ran.extend(launches)
    return launches


def _check_wgmma_ran(launches, T, K):
    env = {"T": T, "NP": T * K, "SMS": torch.cuda.get_device_properties(0).multi_processor_count}
    gemv, wg = launches
    assert sizes.evaluate(wg.grid[0], env) > 0
    assert sizes.evaluate(gemv.grid[0], env) == 0


def _run(runner, op, case):
    ran: list = []
    base._grouped(runner, op, case, lower=lambda G, nid, dtype: _lower_wgmma(G, nid, dtype, ran))
    _check_wgmma_ran(ran, case["T"], case["K"])


@st.composite
def wgmma_cases(draw, KDS, NS):
    """Every expert's pair count from WG_COUNTS (the last one evening out whole tokens), K as
    large as distinct experts per token allow, T above the GEMV's 8 tokens."""
    E = draw(st.sampled_from((1, 2, 3, 5, 8)))
    counts = [draw(st.sampled_from(WG_COUNTS)) for _ in range(E)]
    if sum(counts) == 0:
        counts[0] = 129
    for K in sorted({min(E, k) for k in (1, 2, 6, draw(st.sampled_from((2, 3, 6))))}, reverse=True):
        c = counts[:-1] + [counts[-1] + (-sum(counts)) % K]
        if max(c) <= sum(c) // K:
            counts = c
            break
    T = sum(counts) // K
    assume(T > 8)
    KD, N = draw(st.sampled_from(KDS)), draw(st.sampled_from(NS))
    return {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "T": T, "E": E, "K": K, "counts": counts,
            "KD": KD, "N": N, "misalign": draw(st.sampled_from(("none", "none", "inputs", "outputs"))),
            "seed": draw(st.integers(0, 2**31 - 1))}


def _gate_up(case):
    """case in (KD, N) terms -> _grouped's (D, M) for the gate/up families: D = KD, M = N."""
    return {**case, "D": case["KD"], "M": case["N"]}


def _down(case):
    """... for down: M = KD (the rows a), D = N."""
    return {**case, "D": case["N"], "M": case["KD"]}


def _case(dtype, counts, K, KD, N, misalign="none", seed=21):
    return {"dtype": dtype, "T": sum(counts) // K, "E": len(counts), "K": K, "counts": list(counts), "KD": KD, "N": N,
            "misalign": misalign, "seed": seed}


GATE_UP_KD, GATE_UP_N = (40, 64, 136, 264), (15, 37, 64, 128, 200, 264)
DOWN_KD, DOWN_N = (40, 64, 136, 200), (41, 64, 128, 136, 256, 264, 384)


@given(case=wgmma_cases(GATE_UP_KD, GATE_UP_N))
@example(case=_case("bf16", (130, 64, 1, 0, 129, 128), 1, 2048, 1408))            # V2-Lite widths
@example(case=_case("bf16", (63, 64, 65, 127, 128, 129), 2, 136, 37))             # odd N: element stores
@example(case=_case("fp16", (1500, 1000, 257, 0, 1), 1, 264, 200))                # many tiles a CTA
@example(case=_case("bf16", (255, 256, 257), 1, 40, 264, "inputs"))               # x misaligned: element loads
@example(case=_case("fp16", (129, 65, 1), 1, 64, 200, "outputs"))                 # outputs misaligned
@kernel_test(10)
def test_moe_gate_up_silu_wgmma(runner, case):
    _run(runner, "moe_gate_up_silu", _gate_up(case))


@given(case=wgmma_cases(GATE_UP_KD, GATE_UP_N))
@example(case=_case("fp16", (129, 64, 0, 300), 1, 136, 37))
@kernel_test(4)
def test_moe_gate_up_wgmma(runner, case):
    _run(runner, "moe_gate_up", _gate_up(case))


@given(case=wgmma_cases(DOWN_KD, DOWN_N))
@example(case=_case("bf16", (130, 64, 1, 0, 129, 128), 1, 1408, 2048))            # V2-Lite widths
@example(case=_case("fp16", (63, 64, 65, 127, 128, 129), 2, 200, 41))             # odd N; N - n0 <= 128: one box
@example(case=_case("bf16", (1500, 1000, 257, 0, 1), 1, 136, 384))                # second column tile: one box
@example(case=_case("bf16", (255, 256, 257), 1, 40, 264, "inputs"))
@example(case=_case("fp16", (129, 65, 1), 1, 64, 256, "outputs"))
@kernel_test(10)
def test_moe_down_wgmma(runner, case):
    _run(runner, "moe_down", _down(case))


def test_a_misaligned_weight_is_refused_at_launch(runner):
    """TMA describes only 16-byte aligned bases: a weight one element past one is one LaunchError
    (never a launch reading the wrong rows)."""
    from runtime.launcher import LaunchError
    case = _down(_case("bf16", (129, 64), 1, 64, 128, misalign="weights"))
    with pytest.raises(LaunchError, match="16-byte aligned base"):
        _run(runner, "moe_down", case)
