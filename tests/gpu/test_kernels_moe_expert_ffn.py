"""Decode's expert FFN (moe_expert_ffn: gate_up_silu then down, codegen/families/moe_expert_ffn.py)
against the op's reference, rounded where the kernels round.

The fused launch (sm_90a, 16-bit, D and M multiples of 8; templates/include/
moe_expert_ffn.cuh; the lowering runs it for moe.expert_ffn_from <= T <= moe.expert_ffn_upto, this test at every T
from 1 to 256) walks gate_up_silu's tiles and then down's in one grid; a down tile gathers
its rows of the intermediate `a` once its row tile's counter says every gate_up_silu tile of it is
stored, and the row tile's last down tile sets the counter back to 0.  So each example runs the
node three times in a row, on new inputs and freshly poisoned outputs each time: a counter left
above 0 lets the next launch's down tiles read `a` before it is written (stale rows: wrong
results), one left short hangs it, and a walk counter (the next tile to take) left past 0 leaves
the next launch's tiles undone.  CTAs take tiles in order from that counter, so the walk must also
finish on one CTA and on more CTAs than the GPU holds at once (test_moe_expert_ffn_fused_any_grid).  Checked each time: out [NP, D] against the reference
(silu(g) * u rounded as moe_gate_up_silu rounds, a rounded to the activation type, then a Wd^T in
float64), element-wise (harness tolerance) and norm-wise (assert_strict: catches a 1% error), and
the workspace `a` itself.

Pair counts per expert sit around the tile edges (0, 1, 2, 7-9, 15-17, 31-33, 63-65, 100, 129,
256: row tiles of 64 pairs, wgmma N of 16 / 32 / 64), T from 1 (every expert one pair) to 256;
widths D (gate_up_silu's K, down's rows) and M (gate_up_silu's rows, down's K) multiples of 8 but
not of the 64-wide K slice or the 64 / 128-row column tiles; x and the output one element past an
aligned base.  The node's other path (the moe_gate_up_silu and moe_down launches passing `a`
through the same workspace) serves the T outside the fused launch's window (the lowering's choice,
PERF_NOTES v20), fp32, odd widths and T > 256: each is run through the lowering as it stands.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_kernels_moe as base  # noqa: E402
import test_kernels_moe_wgmma as wgmma_tests  # noqa: E402
from harness import GPU_MARKS, TORCH_DTYPES, kernel_test, poison, shifted, single_op_graph, tiny_model  # noqa: E402

from codegen import families, sizes  # noqa: E402
from codegen.families import _moe, _moe_wgmma_skinny, moe_expert_ffn  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402
from ir.ops import TType  # noqa: E402
from ir.ops.moe import align_ref, grouped_linear  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ONE = _moe_wgmma_skinny.ONE_TOKEN_STAGE   # down's one-token launch

_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                             reason="the fused launch needs a compute capability 9.0 GPU (sm_90a)")
pytestmark = [*GPU_MARKS, _HOPPER]
DEV = "cuda"
COUNTS = (0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 129, 256)
RUNS = 3                      # launches in a row: the counters must be back at 0 after each

runner = wgmma_tests.runner_fixture("expert ffn")


def _graph(E, K, D, M):
    r = TType((f"T*{K}", E), "routing")
    return single_op_graph(tiny_model(), "moe_expert_ffn", {"num_experts": E, "inner_dim": M, "out_dim": D},
                           {"x": TType(("T", D), "act"), "R": r},
                           {"gate": "e.{expert}.gate", "up": "e.{expert}.up", "down": "e.{expert}.down"})


def _reference(x, routing, w, tdt, NP):
    """(a, out) in float64: a = silu(g) * u rounded where moe_gate_up_silu rounds (g, u and silu(g)
    to the activation type, then the product), out = a (as stored) Wd^T."""
    def rnd(t):
        return t.to(tdt).double() if tdt != torch.float32 else t.double()
    xd = x.double()
    g = rnd(grouped_linear(xd, False, routing, w["gate"].double(), NP))
    u = rnd(grouped_linear(xd, False, routing, w["up"].double(), NP))
    a = rnd(rnd(torch.nn.functional.silu(g)) * u)
    return a, grouped_linear(a, True, routing, w["down"].double(), NP)


def _lower(G, nid, dtype, window, shared=0, **moe):
    """The family's launches with the fused launch serving T in `window` (None: the lowering's) and
    `moe` knobs set, lowered as if the routing came from a route with `shared` shared experts (the
    test's graph takes the routing as an input: _moe.routing_shared would say 0)."""
    if window is not None:
        moe.update(expert_ffn_from=window[0], expert_ffn_upto=window[1])
    saved = _moe.routing_shared
    _moe.routing_shared = lambda G, routing: shared
    try:
        return families.family_for_op("moe_expert_ffn").lower(nid, G, Options(dtype=dtype,
                                                                              tuning=Tuning(moe=MoeTuning(**moe))))
    finally:
        _moe.routing_shared = saved


def _route_layout(ids: torch.Tensor, shared: int) -> torch.Tensor:
    """ids [T, K] with each token's row as moe_route writes it when its first `shared` experts are
    shared ones (every token one pair of each): the routed pairs first, then shared expert s at slot
    K - shared + s (moe_router.cuh topk_scored), which decode's gate / up relies on to find a shared tile's
    pairs before its wait (moe_wgmma_skinny.cuh SH)."""
    if not shared:
        return ids
    T = ids.shape[0]
    routed = ids[ids >= shared].view(T, -1)               # (row-major: each row keeps its routed pairs)
    return torch.cat([routed, torch.arange(shared).expand(T, shared)], dim=1).contiguous()


def _run(runner, case, *, expect: list, window=None, fused_grid=None, **moe):
    """`expect`: the stages of the launches that run at the case's T (grid > 0).  `fused_grid`: the
    fused launch's CTAs in place of the lowering's (an expression of T, NP and SMS).  A case's
    "shared" (default 0): its first experts are shared ones (T pairs each), lowered as such."""
    dtype, E, K, D, M, counts = (case[k] for k in ("dtype", "E", "K", "D", "M", "counts"))
    tdt = TORCH_DTYPES[dtype]
    T, NP = sum(counts) // K, sum(counts)
    G, nid = _graph(E, K, D, M)
    launches = _lower(G, nid, dtype, window, case.get("shared", 0), **moe)
    if fused_grid is not None:
        launches = [dataclasses.replace(la, grid=(fused_grid, 1, 1)) if la.stage == "fused" else la
                    for la in launches]
    env = {"T": T, "NP": NP, "SMS": torch.cuda.get_device_properties(0).multi_processor_count}
    running = [la.stage for la in launches if sizes.evaluate(la.grid[0], env) > 0]
    assert running == expect, (T, running)
    g = torch.Generator(device=DEV).manual_seed(case["seed"])
    mis = case.get("misalign", "none")
    for run in range(RUNS):
        ids = _route_layout(base._ids_with_counts(counts, K, torch.Generator().manual_seed(case["seed"] + run)),
                            case.get("shared", 0))
        ref_r = align_ref(ids, E)
        routing = {"order": ref_r["order"].to(DEV, torch.int32), "offsets": ref_r["offsets"].to(DEV, torch.int32)}
        ref_dev = {**ref_r, "order": ref_r["order"].to(DEV), "offsets": ref_r["offsets"].to(DEV)}
        x = torch.randn(T, D, generator=g, device=DEV).to(tdt)
        w = {"gate": (torch.randn(E, M, D, generator=g, device=DEV) / D ** 0.5).to(tdt),
             "up": (torch.randn(E, M, D, generator=g, device=DEV) / D ** 0.5).to(tdt),
             "down": (torch.randn(E, D, M, generator=g, device=DEV) / M ** 0.5).to(tdt)}
        out = poison(shifted(torch.empty(NP, D, dtype=tdt, device=DEV), mis == "outputs"))
        a_ws = poison(torch.empty(NP, M, dtype=tdt, device=DEV))
        values = {"x": shifted(x, mis == "inputs"), "R": routing, "out": out}
        got = runner.run_all(launches, values=values, weights={f"e.*.{k}": v for k, v in w.items()},
                             sizes={"T": T, "NP": NP}, workspaces={moe_expert_ffn.WORKSPACE: a_ws})
        torch.cuda.synchronize()
        assert got[moe_expert_ffn.WORKSPACE] is a_ws
        a_ref, out_ref = _reference(x, ref_dev, w, tdt, NP)
        base._record("moe_expert_ffn.a", dtype, a_ws, a_ref)
        base._record("moe_expert_ffn", dtype, out, out_ref)


@st.composite
def ffn_cases(draw):
    """Every expert's pair count from COUNTS (the last one evening out whole tokens), K as large as
    distinct experts per token allow, 1 <= T <= 256."""
    E = draw(st.sampled_from((1, 2, 3, 5, 8, 66)))
    counts = [draw(st.sampled_from(COUNTS)) if E <= 8 or i < 8 else draw(st.sampled_from((0, 0, 1, 2, 3)))
              for i in range(E)]
    if sum(counts) == 0:
        counts[0] = 1
    for K in sorted({min(E, k) for k in (1, 2, 6, 8, draw(st.sampled_from((2, 3, 6))))}, reverse=True):
        c = counts[:-1] + [counts[-1] + (-sum(counts)) % K]
        if max(c) <= sum(c) // K:
            counts = c
            break
    T = sum(counts) // K
    assume(1 <= T <= 256 and max(counts) <= T)
    return {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "E": E, "K": K, "counts": counts,
            "D": draw(st.sampled_from((40, 64, 136, 264))), "M": draw(st.sampled_from((40, 64, 136, 200))),
            "misalign": draw(st.sampled_from(("none", "none", "inputs", "outputs"))),
            "seed": draw(st.integers(0, 2**31 - 1))}


def _case(dtype, counts, K, D, M, misalign="none", seed=5):
    assert sum(counts) % K == 0 and max(counts) <= sum(counts) // K, (counts, K)
    return {"dtype": dtype, "E": len(counts), "K": K, "counts": list(counts), "D": D, "M": M, "misalign": misalign,
            "seed": seed}


def _lite(T, shared=2, routed=6, E=64):
    """V2-Lite's decode at batch T: `shared` always-selected experts (T pairs each, numbered first
    as fuse_shared_experts numbers them), then T * routed pairs spread over E routed experts."""
    per, extra = divmod(T * routed, E)
    return [T] * shared + [per + (1 if i < extra else 0) for i in range(E)]


@given(case=ffn_cases())
@example(case=_case("bf16", [1] * 8 + [0] * 58, 8, 2048, 1408))              # V2-Lite b=1
@example(case=_case("bf16", _lite(8), 8, 2048, 1408))                        # b=8
@example(case=_case("bf16", _lite(128), 8, 2048, 1408))                      # b=128: shared experts 2 row tiles
@example(case=_case("fp16", _lite(256), 8, 2048, 1408, "outputs"))           # b=256, the fused range's top
@example(case=_case("bf16", (256, 129, 100, 27, 0, 0), 2, 136, 200))          # several row tiles an expert
@example(case=_case("fp16", (15, 16, 17, 31, 32, 33), 2, 40, 40, "inputs"))   # one column tile each; x misaligned
@kernel_test(10)
def test_moe_expert_ffn_fused(runner, case):
    """The fused kernel at every T it can serve (1 to 256; the lowering's window is narrower)."""
    _run(runner, case, expect=["fused"], window=(1, 256))


@pytest.mark.parametrize("ctas", ["1", "6 * SMS"])
def test_moe_expert_ffn_fused_any_grid(runner, ctas):
    """CTAs take the walk's tiles in order from a counter, so it finishes on any number of them: on
    one CTA, and on three times what the GPU holds at once (V2-Lite's b=64, 2508 tiles on 6 SMS
    CTAs: most wait for a slot while the first ones' down tiles wait for their rows of `a`)."""
    _run(runner, _case("bf16", _lite(64), 8, 2048, 1408), expect=["fused"], window=(1, 256), fused_grid=ctas)


@pytest.mark.parametrize("case,expect", [
    (_case("bf16", [1] * 8 + [0] * 58, 8, 2048, 1408), ["wgmma_skinny", ONE]),     # V2-Lite b=1: below the window
                                                                                   # (down's one-token launch)
    (_case("bf16", _lite(3), 8, 2048, 1408), ["wgmma_skinny"] * 2),                # b=3: below it
    (_case("bf16", _lite(4), 8, 2048, 1408), ["fused"]),                           # b=4: its bottom
    (_case("bf16", _lite(64), 8, 2048, 1408), ["fused"]),                          # b=64: in it
    (_case("fp16", _lite(256), 8, 2048, 1408), ["fused"]),                         # b=256: its top
    (_case("fp32", (3, 0, 2, 1), 2, 40, 40), ["gemv"] * 2),                         # fp32: the GEMVs
    (_case("bf16", (9, 17, 29, 5), 2, 41, 40), ["mma", "wgmma_skinny"]),            # odd D: gate_up_silu's mma
    (_case("bf16", (300, 0, 17, 283), 2, 64, 136), ["wgmma"] * 2),                  # T = 300: the prefill wgmma
])
def test_moe_expert_ffn_lowering_window(runner, case, expect):
    """The lowering's own choice by T and dtype, each path through the node's workspace."""
    _run(runner, case, expect=expect)


@pytest.mark.parametrize("staged", [0, 16])
@pytest.mark.parametrize("case", [
    _case("bf16", _lite(8), 8, 2048, 1408),                      # V2-Lite b=8: tiles of 8 and 1 pairs
    _case("bf16", _lite(128), 8, 2048, 1408),                    # b=128: 128-pair shared experts, 12-pair routed
    _case("fp16", _lite(256), 8, 2048, 1408, "outputs"),          # b=256, outputs misaligned: element stores
    _case("bf16", (256, 129, 100, 27, 0, 0), 2, 136, 200),        # partial column tiles (N % 128, M % 64)
    _case("fp16", (15, 16, 17, 31, 32, 33, 63, 64, 65), 3, 40, 40, "inputs"),   # odd widths, every BP
])
def test_moe_expert_ffn_fused_staged_epilogue(runner, case, staged):
    """The fused launch's epilogue knob (moe.expert_ffn_staged_from, 32 by default, which every
    other test here runs) at its other settings: tiles of at least `staged` pairs store their
    outputs, `a` and out alike, through their last ring stage in 16-byte chunks; 0, none does."""
    _run(runner, case, expect=["fused"], window=(1, 256), expert_ffn_staged_from=staged)


@st.composite
def shared_cases(draw):
    """Decode with S shared experts (numbered first, T pairs each, as fuse_shared_experts makes
    them) and T * routed pairs over the routed experts, 1 <= T <= 256."""
    T, S = draw(st.integers(1, 256)), draw(st.integers(1, 3))
    E = draw(st.sampled_from((2, 5, 64)))
    routed = draw(st.integers(1, min(E, 6)))
    case = _case(draw(st.sampled_from(("bf16", "fp16"))), _lite(T, shared=S, routed=routed, E=E), S + routed,
                 draw(st.sampled_from((40, 136, 2048))), draw(st.sampled_from((40, 200, 1408))),
                 draw(st.sampled_from(("none", "none", "inputs", "outputs"))), draw(st.integers(0, 2**31 - 1)))
    return {**case, "shared": S}


@given(case=shared_cases())
@example(case={**_case("bf16", [1] * 8 + [0] * 58, 8, 2048, 1408), "shared": 2})   # V2-Lite b=1
@example(case={**_case("bf16", _lite(3), 8, 2048, 1408), "shared": 2})             # b=3
@example(case={**_case("fp16", _lite(130), 8, 2048, 1408, "outputs"), "shared": 2})  # 3 row tiles a shared expert
@example(case={**_case("bf16", (5, 4, 3, 3, 0), 3, 136, 200, "inputs"), "shared": 1})   # 3 K slices (< 4 stages), partial column tiles
@kernel_test(8)
def test_moe_expert_ffn_shared_experts_start_before_the_wait(runner, case):
    """Decode's two launches with the shared experts among the pairs, laid out as moe_route lays
    them (moe_wgmma_skinny.cuh SH): gate_up_silu's CTAs whose
    first tile is a shared expert's run that whole tile before their PDL wait, from T alone (its
    pairs from the route's layout, not from `order`), then the rest of their walk from the offsets,
    past it (a wrong pair, a tile done twice or not at all: wrong or poisoned rows)."""
    T = sum(case["counts"]) // case["K"]
    _run(runner, case, expect=["wgmma_skinny", ONE if T == 1 else "wgmma_skinny"], window=(257, 256))
