"""The experts' FP8 x FP8 GEMM on clusters of two with multicast weight boxes (Tuning.moe.fp8_multicast,
templates/include/moe_gemm_fp8.cuh MC) on the CPU: the table's wgmma_fp8_mc row above decode's range (decode's
sizes keep a CTA a tile), its launch (an even grid, __cluster_dims__(2, 1, 1), one quantiser launch for both
GEMMs), the knob off leaving every launch as it was, NVRTC for sm_90a at V2-Lite's and V3's shapes (no spills,
registers as the plain kernel's, multicast TMA, remote arrivals and the cluster barrier in the SASS), and a
Python model of the cluster walk (every (expert, row tile, column tile) once, the two ranks in step)."""
from __future__ import annotations

import random

import pytest

from codegen import dispatch, families, sizes
from codegen.families import _moe_gemm_fp8
from codegen.kernel import Options
from codegen.tuning import LinearTuning, MoeTuning, Tuning
from sass import cuobjdump, opcodes
from test_moe_fp8_lowering import FP8_FACTS, _node

OPS = ("moe_gate_up_silu", "moe_gate_up", "moe_down")
# the quantiser before each GEMM (the norm's e4m3 rows off) and down's launches at every T
PLAIN = MoeTuning(fp8_one_token_down=False)
OFF = Tuning(moe=PLAIN, linear=LinearTuning(norm_fp8=False))
ON = Tuning(moe=MoeTuning(fp8_one_token_down=False, fp8_multicast=True), linear=LinearTuning(norm_fp8=False))
UPPER = Tuning().moe.prefill_wgmma_above       # decode's range ends here (256)


def _lower(op, tuning, KD=144, N=200, E=8, K=2):
    G, nid = _node(op, KD, N, E=E, K=K)
    return families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=tuning))


def _running(steps, T, K=2, sms=132):
    env = {"T": T, "NP": T * K, "SMS": sms}
    return [(s, sizes.evaluate(s.grid[0], env)) for s in steps if all(sizes.evaluate(g, env) > 0 for g in s.grid)]


def test_the_knob_is_off_by_default_and_in_the_cache_key():
    assert Tuning().moe.fp8_multicast is False
    assert Tuning(moe=MoeTuning(fp8_multicast=True)).flags() == ["--tune moe.fp8_multicast=true"]


@pytest.mark.parametrize("op", OPS)
def test_the_dispatch_rows_with_the_knob(op):
    if op == "moe_gate_up":
        return                                   # moe_gate_up shares gate_up_silu's table
    facts = {**FP8_FACTS, "fp8x_fits": True}
    on = Tuning(moe=MoeTuning(fp8_multicast=True))
    assert [dispatch.select(op, t, facts).variant for t in (17, 257, 16384)] == ["wgmma_fp8"] * 3
    assert [dispatch.select(op, t, facts, on).variant for t in (17, 256, 257, 16384)] == \
        ["wgmma_fp8", "wgmma_fp8", "wgmma_fp8_mc", "wgmma_fp8_mc"]
    assert "no multicast" in dispatch.select(op, 256, facts, on).reason
    assert "multicasting half" in dispatch.select(op, 257, facts, on).reason
    # decode's range reaching past the FP8 x FP8 row's start: the multicast row alone
    late = Tuning(moe=MoeTuning(fp8_multicast=True, fp8_activations_above=None))
    assert [r.variant for r in dispatch.rows(op, facts, late)][-1:] == ["wgmma_fp8_mc"]
    assert "wgmma_fp8" not in [r.variant for r in dispatch.rows(op, facts, late)]
    # no sm_90a: neither GEMM (the table's other cases)
    assert dispatch.select(op, 16384, {**facts, "sm_90a": False}, on).variant == dispatch.NONE


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("T", [4096, 16384])
def test_the_launches_with_the_knob_off_and_on(op, T):
    off, on = _lower(op, OFF), _lower(op, ON)
    q_off, g_off = _running(off, T)
    q_on, g_on = _running(on, T)
    assert q_on[0].stage == q_off[0].stage == "quant_x" and q_on[0].name == q_off[0].name
    assert [s.stage for s in on].count("quant_x") == 1, "one quantiser for both GEMMs"
    a, b = g_off[0], g_on[0]
    assert "multicast" not in a.params and "__mc__" not in a.name
    assert b.name == a.name.replace("__wgmma_fp8", "__mc__wgmma_fp8") and b.params == {**a.params, "multicast": True}
    assert (b.block, b.smem, b.args, b.workspace, b.stage) == (a.block, a.smem, a.args, a.workspace, a.stage)
    for sms in (132, 131, 114):
        (grid,) = [n for s, n in _running(on, T, sms=sms) if s.name == b.name]
        assert grid % 2 == 0 and grid <= sms, (sms, grid)
    from codegen.render import render_launch
    src = render_launch(b)
    assert "__cluster_dims__(2, 1, 1)" in src and src.count(", true>(") == 1 and ", true, true>(" in src
    assert "__cluster_dims__" not in render_launch(a)


@pytest.mark.parametrize("op", OPS)
def test_decode_sizes_keep_the_plain_gemm(op):
    on = _lower(op, ON)
    for T in (17, 100, UPPER):
        stages = [(s.stage, "multicast" in s.params) for s, _ in _running(on, T)]
        assert stages == [("quant_x", False), ("wgmma_fp8", False)], (T, stages)
    assert [("multicast" in s.params) for s, _ in _running(on, UPPER + 1) if s.stage == "wgmma_fp8"] == [True]


@pytest.mark.parametrize("op", OPS)
def test_the_knob_off_launches_are_todays(op):
    """Off: the launches are those of a tuning without the knob (names, parameters, grids, sources)."""
    from codegen.render import render_launch
    off, default = _lower(op, OFF), _lower(op, Tuning(moe=PLAIN, linear=LinearTuning(norm_fp8=False)))
    assert [(s.name, s.params, s.grid, render_launch(s)) for s in off] == \
        [(s.name, s.params, s.grid, render_launch(s)) for s in default]
    assert all("multicast" not in s.params for s in off)


def test_the_knob_reaches_the_expert_ffns_two_launch_path():
    from test_moe_gemm_fp8 import _fp8_expert_ffn
    from codegen.families import moe_expert_ffn
    G, nid = _fp8_expert_ffn()
    gemms = [s for s in moe_expert_ffn.lower(nid, G, Options(dtype="bf16", tuning=ON)) if s.stage == "wgmma_fp8"]
    assert sorted("__mc__" in s.name for s in gemms) == [False, False, True, True], [s.name for s in gemms]


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op,KD,N,E,K", [("moe_gate_up_silu", 2048, 1408, 66, 8),   # V2-Lite
                                          ("moe_down", 1408, 2048, 66, 8),
                                          ("moe_gate_up_silu", 7168, 2048, 257, 9),  # V3
                                          ("moe_down", 2048, 7168, 257, 9)])
def test_the_multicast_gemm_compiles_without_spills(op, KD, N, E, K):
    """sm_90a: no spills, no more registers than the plain kernel; the SASS multicasts the weight boxes
    (UTMALDG.3D.MULTICAST, no plain UTMALDG), arrives on the peer's barrier (SYNCS.ARRIVE...RED) and meets
    the peer at the cluster barrier (UCGABAR_ARV / UCGABAR_WAIT); the plain kernel has none of them."""
    import re

    from codegen.arch import kernel_target
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    regs, ops = {}, {}
    for mc, tuning in ((False, OFF), (True, ON)):
        la = [s for s in _lower(op, tuning, KD, N, E, K) if s.stage == "wgmma_fp8"][-1]
        assert ("multicast" in la.params) == mc
        res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                            options=("--ptxas-options=-v",))
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        regs[mc] = int(re.search(r"Used (\d+) registers", res.log).group(1))
        ops[mc] = opcodes(res.cubin)
        assert not any(o.startswith(("LDL", "STL")) for o in ops[mc]), "no local memory"
    assert regs[True] <= regs[False], regs
    assert "UTMALDG.3D.MULTICAST" in ops[True] and "UTMALDG.3D" not in ops[True], sorted(ops[True])
    assert any(o.startswith("SYNCS.ARRIVE") and ".RED" in o for o in ops[True]), sorted(ops[True])
    assert {"UCGABAR_ARV", "UCGABAR_WAIT"} <= set(ops[True]), sorted(ops[True])
    assert not any("MULTICAST" in o or "UCGABAR" in o or (o.startswith("SYNCS.ARRIVE") and ".RED" in o)
                   for o in ops[False]), sorted(ops[False])


# -- the walk, as moe_gemm_fp8.cuh computes it (wgmma_row_tiles, wgmma_tile, fp8x_tile) ---------------------

def _row_tiles(offsets, bm):
    """wgmma_row_tiles: tiles[e] = row tiles (of bm pairs) of experts before e, tiles[E] all of them."""
    out = [0]
    for e in range(len(offsets) - 1):
        out.append(out[-1] + (offsets[e + 1] - offsets[e] + bm - 1) // bm)
    return out


def _tile(tiles, offsets, t, nct, bm):
    """wgmma_tile: (e, pbeg, rows, column tile) of item t."""
    rt = t // nct
    e = max(i for i in range(len(offsets) - 1) if tiles[i] <= rt)
    pbeg = offsets[e] + (rt - tiles[e]) * bm
    return e, pbeg, min(bm, offsets[e + 1] - pbeg), t % nct


def _walk(offsets, nct, ctas, mc, bm=128):
    """Each CTA's tiles in walk order: MC, cluster blockIdx / 2 takes items of two row tiles, rank r the r-th."""
    tiles = _row_tiles(offsets, 2 * bm if mc else bm)
    out = {}
    for cta in range(ctas):
        first, stride = (cta // 2, ctas // 2) if mc else (cta, ctas)
        seq = []
        for t in range(first, tiles[-1] * nct, stride):
            e, pbeg, rows, n = _tile(tiles, offsets, t, nct, 2 * bm if mc else bm)
            if mc:
                r = cta % 2
                pbeg, rows = pbeg + r * bm, max(0, min(bm, rows - r * bm))
            seq.append((e, pbeg, rows, n))
        out[cta] = seq
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_cluster_walk_covers_every_tile_once_and_keeps_the_ranks_in_step(seed):
    g = random.Random(seed)
    E, nct, ctas = g.choice([3, 8, 64]), g.choice([1, 2, 11]), g.choice([2, 8, 132])
    # experts of 0, 1, 2, 3 and many row tiles, partial last tiles
    counts = [g.choice([0, 1, 127, 128, 129, 256, 300, 385, g.randrange(2000)]) for _ in range(E)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    plain, mc = _walk(offsets, nct, ctas, False), _walk(offsets, nct, ctas, True)
    want = sorted((e, p, r, n) for s in plain.values() for (e, p, r, n) in s)
    got = sorted(x for s in mc.values() for x in s if x[2] > 0)
    assert got == want, "every (expert, row tile, column tile) exactly once"
    for c in range(0, ctas, 2):
        a, b = mc[c], mc[c + 1]
        assert [(e, n) for e, _, _, n in a] == [(e, n) for e, _, _, n in b], "peers walk the same (e, n)"
        assert all(pb == pa + 128 for (_, pa, _, _), (_, pb, _, _) in zip(a, b))
    # an expert with an odd count of row tiles: its last item's second tile is empty (rank 1 stores nothing)
    odd = [e for e, c in enumerate(counts) if (c + 127) // 128 % 2 == 1]
    empties = {(e, n) for s in mc.values() for (e, _, r, n) in s if r == 0}
    assert empties == {(e, n) for e in odd for n in range(nct)}


def test_the_knob_reaches_a_tiny_models_prefill_plan():
    """With moe.fp8_multicast on, the tiny FP8 model's prefill plan holds each expert GEMM twice -- the plain one
    (decode's sizes) and the mc one -- and every other launch as the knob-off plan's."""
    import json

    import ir
    from codegen.bundle import plan_spec
    from ir.config_to_spec import spec_from_config
    from ir.formats import FP8, weight_formats_yaml
    from tiny import ROOT
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    spec = ir.load_spec(spec_from_config(tiny, name="tiny") + "\n"
                        + weight_formats_yaml(("model.layers.*.mlp.*_proj.weight",), FP8), file="t.yaml")
    off, on = (plan_spec(spec, Options(tuning=Tuning(moe=MoeTuning(fp8_multicast=m)))).plans["prefill"].launches
               for m in (False, True))
    mc = [la.name for la in on if "multicast" in la.params]
    assert mc and all("__mc__" in n for n in mc), mc
    assert [la.name for la in on if "multicast" not in la.params] == [la.name for la in off]
    assert sorted(n.replace("__mc__", "__") for n in mc) == sorted(la.name for la in off if la.stage == "wgmma_fp8")


def test_explain_names_the_multicast_row(capsys):
    """`dsgraph explain` with the knob: prefill above decode's range runs the mc GEMMs for the wgmma_fp8_mc row's
    reason; at decode's sizes the plain GEMM, its row saying why no multicast."""
    from runtime.cli import main
    assert main(["explain", "--weights", "fp8", "--phase", "prefill", "--tokens", "200,16384",
                 "--tune", "moe.fp8_multicast=true"]) == 0
    out = capsys.readouterr().out
    small = out.split("prefill, T = 200 ", 1)[1].split("\n\n", 1)[0]
    big = out.split("prefill, T = 16384 ", 1)[1].split("\n\n", 1)[0]
    assert "__mc__" not in small and "wgmma_fp8 [tokens 17..256]" in small and "no multicast" in small
    assert "moe_down__bf16_wfp8_afp8__e66__d2048_m1408__ovl__mc__wgmma_fp8" in big
    assert "wgmma_fp8_mc [tokens 257..inf]" in big and "multicasting half" in big
