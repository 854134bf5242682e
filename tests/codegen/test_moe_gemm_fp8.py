"""The grouped experts' FP8 x FP8 prefill GEMM on the CPU (codegen/families/_moe_gemm_fp8.py,
templates/include/moe_gemm_fp8.cuh): above decode's range FP8 expert weights lower to the quantiser's
launch (gemm_fp8's, over x once a token for gate_up, over a once a pair for down) and the wgmma_fp8 GEMM,
Tuning.moe.fp8_activations off keeps the weight-only kernel there, the launches bind the node's
workspaces and the weights as [64 x 128-byte] tensor maps (128B swizzle) with their block scales, the
expert FFN's two-launch path keeps both its own workspace and the quantisers', a tiny FP8 model's
prefill plan lowers to them, and NVRTC makes FP8 wgmma (QGMMA ... E4M3.E4M3), 3-D TMA boxes and the
gathered rows' cp.async for sm_90a without spills."""
from __future__ import annotations

import json

import pytest

from codegen import dispatch, families, sizes
from codegen.families import _moe_fp8, _moe_gemm_fp8, gemm_fp8
from codegen.kernel import KernelLaunch, Options, SizeRef, TensorMapRef, ValueRef, WeightRef, WorkspaceRef
from codegen.tuning import LinearTuning, MoeTuning, Tuning
from ir.formats import FP8
from sass import cuobjdump, opcodes
from test_moe_fp8_lowering import FP8_FACTS, _node
from tiny import ROOT

FIRST = Tuning().moe.fp8_activations_above + 1  # the first T on the FP8 x FP8 GEMM at the default tuning (17)
WEIGHT_ONLY = Tuning(moe=MoeTuning(fp8_activations=False, fp8_one_token_down=False))
# the quantiser's launch before every FP8 x FP8 GEMM and down's one launch at every decode T (the norms' rows and
# the one-token down, both on by default, have their own tests)
QX = Tuning(moe=MoeTuning(fp8_one_token_down=False), linear=LinearTuning(norm_fp8=False))


def _running(steps, T, K):
    env = {"T": T, "NP": T * K, "SMS": 132}
    return [s.stage for s in steps if all(sizes.evaluate(g, env) > 0 for g in s.grid)]


@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_gate_up", "moe_down"])
def test_above_decode_the_quantiser_and_the_fp8_gemm_run(op):
    down = op == "moe_down"
    G, nid = _node(op, 144, 200, E=8, K=2)
    steps = families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=QX))
    assert [s.stage for s in steps] == [_moe_fp8.VARIANT, "quant_x", "wgmma_fp8"]
    for T in (1, 8, FIRST - 1):
        assert _running(steps, T, 2) == [_moe_fp8.VARIANT]
    for T in (FIRST, 1000, 16384):
        assert _running(steps, T, 2) == ["quant_x", "wgmma_fp8"]
    _, quant, la = steps
    rows = "NP" if down else "T"
    q_ws, s_ws = _moe_gemm_fp8.WORKSPACES[down]
    assert quant.family == gemm_fp8.FAMILY and quant.name == "gemm_fp8__bf16__k144__quant_x"
    assert quant.grid[0].startswith(f"cdiv({rows} * 2, 8)")
    assert {w.name: (w.shape, w.dtype) for w in quant.workspace} == {q_ws: ((rows, 36), "i32"), s_ws: ((rows, 2), "f32")}
    refs = {a.name: a.ref for a in quant.args}
    assert refs["x"] == ValueRef("a" if down else "x") and refs["T"] == SizeRef(rows) and refs["x_stride"] == SizeRef("144")
    assert refs["xq"] == WorkspaceRef(q_ws) and refs["xs"] == WorkspaceRef(s_ws)
    assert la.family == op and la.name.endswith("wgmma_fp8") and "bf16_wfp8_afp8" in la.name
    assert la.requires == ("sm_90a",) and la.smem == _moe_gemm_fp8.smem() and la.workspace == quant.workspace
    assert la.params["cols"] == (128 if down else 64)
    refs = {a.name: a.ref for a in la.args}
    assert refs["xq"] == WorkspaceRef(q_ws) and refs["xs"] == WorkspaceRef(s_ws)
    maps = [a.ref for a in la.args if isinstance(a.ref, TensorMapRef)]
    scales = [a.ref for a in la.args if isinstance(a.ref, WeightRef)]
    assert maps and all(m.box == (64, 128) and m.swizzle == 128 for m in maps)
    assert sorted(s.name for s in scales) == sorted(m.weight + "_scale_inv" for m in maps)
    # 200 columns: 4 column tiles of 64 (gate_up) or 2 of 128 (down); NP = 600 pairs: <= 4 + 8 row tiles
    assert sizes.evaluate(la.grid[0], {"T": 300, "NP": 600, "SMS": 132}) == (2 if down else 4) * (600 // 128 + 8)


def test_the_knob_off_keeps_the_weight_only_kernel_at_every_t():
    for op in ("moe_gate_up_silu", "moe_down"):
        G, nid = _node(op, 144, 200)
        steps = families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=WEIGHT_ONLY))
        assert [s.stage for s in steps] == [_moe_fp8.VARIANT]
        assert _running(steps, 16384, 2) == [_moe_fp8.VARIANT]
    assert Tuning().to_json()["moe"]["fp8_activations"] is True
    assert WEIGHT_ONLY.flags() == ["--tune moe.fp8_activations=false", "--tune moe.fp8_one_token_down=false"]


def test_the_dispatch_rows_and_their_bounds():
    for op in ("moe_gate_up_silu", "moe_down"):
        facts = {**FP8_FACTS, "fp8x_fits": True}
        row = dispatch.select(op, FIRST, facts)
        assert row.variant == "wgmma_fp8" and "promotion per 128-K block" in row.reason and row.span == f"{FIRST}..inf"
        assert dispatch.select(op, FIRST - 1, facts).variant == _moe_fp8.VARIANT
        moved = Tuning(moe=MoeTuning(fp8_activations_above=64))
        assert [dispatch.select(op, t, facts, moved).variant for t in (64, 65)] == [_moe_fp8.VARIANT, "wgmma_fp8"]
        # none: the FP8 x FP8 GEMM from where bf16's prefill wgmma starts
        follows = Tuning(moe=MoeTuning(fp8_activations_above=None, prefill_wgmma_above=64))
        assert [dispatch.select(op, t, facts, follows).variant for t in (64, 65)] == [_moe_fp8.VARIANT, "wgmma_fp8"]
        assert dispatch.select(op, 16384, facts, Tuning(moe=MoeTuning(prefill_wgmma_above=None))).variant \
            == _moe_fp8.VARIANT
        assert dispatch.select(op, FIRST, {**facts, "sm_90a": False}).variant == dispatch.NONE
    # bf16 experts are untouched
    bf16 = {"dtype": "bf16", "weight_format": "same", "sm_90a": True, "tma_rows": True, "decode_wgmma_fits": True,
            "prefill_wgmma_fits": True, "fp8x_fits": True}
    assert [dispatch.select("moe_down", t, bf16).variant for t in (FIRST, 256, 257)] == \
        ["wgmma_skinny", "wgmma_skinny", "wgmma"]


def test_the_shared_memory_bound_takes_v3s_experts():
    assert _moe_gemm_fp8.fits(Options(), 257) and _moe_gemm_fp8.fits(Options(), 480)
    assert not _moe_gemm_fp8.fits(Options(), 1024)


def _fp8_expert_ffn():
    """(graph, node) of a lone moe_expert_ffn node (8 experts, 272 -> 144 -> 272, top-2) with FP8 weights."""
    from tests.gpu.harness import single_op_graph, tiny_model
    from ir.formats import set_format
    from ir.ops import TType
    G, nid = single_op_graph(tiny_model(), "moe_expert_ffn", {"num_experts": 8, "inner_dim": 144, "out_dim": 272},
                             {"x": TType(("T", 272), "act"), "R": TType(("T*2", 8), "routing")},
                             {"gate": "e.{expert}.gate", "up": "e.{expert}.up", "down": "e.{expert}.down"})
    for name in G.nodes[nid]["weights"].values():
        set_format(G.graph["weights"], name, FP8)
    return G, nid


def test_the_expert_ffn_keeps_its_workspace_and_the_quantisers():
    from codegen.families import moe_expert_ffn
    G, nid = _fp8_expert_ffn()
    steps = moe_expert_ffn.lower(nid, G, Options(dtype="bf16", tuning=QX))
    prefill = [s for s in steps if _running([s], FIRST, 2)]
    assert [s.stage for s in prefill] == ["quant_x", "wgmma_fp8", "quant_x", "wgmma_fp8"]
    gu_q, gu, dn_q, dn = prefill
    for s in prefill:
        assert moe_expert_ffn.WORKSPACE in {w.name for w in s.workspace}
    assert {a.name: a.ref for a in dn_q.args}["x"] == WorkspaceRef(moe_expert_ffn.WORKSPACE)
    assert {a.name: a.ref for a in gu.args}["out"] == WorkspaceRef(moe_expert_ffn.WORKSPACE)
    assert {w.name for w in gu_q.workspace} >= set(_moe_gemm_fp8.WORKSPACES[False])
    assert {w.name for w in dn.workspace} >= set(_moe_gemm_fp8.WORKSPACES[True])


def test_a_tiny_fp8_models_prefill_plan_lowers_to_the_fp8_x_fp8_launches():
    """The tiny config with FP8 experts (V3's MLP globs): its prefill plan holds, for each MoE layer's
    experts, the quantisers and the FP8 GEMMs with their workspaces alive at their node alone; decode's
    plan has them too (one plan serves every T), with no work below 257 tokens."""
    import ir
    from codegen.bundle import plan_spec
    from codegen.manifest import phase_from_json, phase_to_json
    from codegen.memplan import workspace_slot
    from ir.config_to_spec import spec_from_config
    from ir.formats import weight_formats_yaml
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    spec = ir.load_spec(spec_from_config(tiny, name="tiny") + "\n"
                        + weight_formats_yaml(("model.layers.*.mlp.*_proj.weight",), FP8), file="t.yaml")
    plan = plan_spec(spec, Options(tuning=QX)).plans["prefill"]
    gemms = [la for la in plan.launches if la.stage == "wgmma_fp8"]
    assert {la.family for la in gemms} == {"moe_gate_up_silu", "moe_down"}, [la.name for la in gemms]
    slots = {s.name: s for s in plan.arena}
    for la in gemms:
        nid = la.nodes[0]
        stages = [s.stage for s in plan.launches if s.nodes[0] == nid]
        assert stages[stages.index("wgmma_fp8") - 1] == "quant_x", (nid, stages)
        for ws in la.workspace:
            s = slots[workspace_slot(nid, ws.name)]
            assert s.first == s.last, (nid, s)
    back = phase_from_json("prefill", json.loads(json.dumps(phase_to_json(plan))))   # the manifest's form
    assert [(s.name, s.args, s.workspace, s.grid) for s in back.launches] == \
        [(s.name, s.args, s.workspace, s.grid) for s in plan.launches]


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op,KD,N,E,K,dtype", [("moe_gate_up_silu", 2048, 1408, 66, 8, "bf16"),   # V2-Lite
                                                ("moe_down", 1408, 2048, 66, 8, "bf16"),
                                                ("moe_gate_up_silu", 7168, 2048, 257, 9, "fp16"),  # V3
                                                ("moe_down", 2048, 7168, 257, 9, "bf16"),
                                                ("moe_gate_up", 144, 200, 8, 2, "bf16")])
def test_the_fp8_gemm_compiles_to_fp8_wgmma_without_spills(op, KD, N, E, K, dtype):
    from codegen.arch import kernel_target
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    G, nid = _node(op, KD, N, E=E, K=K)
    (la,) = [s for s in families.family_for_op(op).lower(nid, G, Options(dtype=dtype)) if s.stage == "wgmma_fp8"]
    assert isinstance(la, KernelLaunch)
    res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                        options=("--ptxas-options=-v",))
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
    ops = opcodes(res.cubin)
    assert ops["QGMMA.64x128x32.F32.E4M3.E4M3"] % 4 == 0 and ops["QGMMA.64x128x32.F32.E4M3.E4M3"] > 0, sorted(ops)
    assert any(o.startswith("UTMALDG.3D") for o in ops) and ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0, sorted(ops)
    assert not any(o.startswith("HGMMA") for o in ops), "the product runs on FP8 operands, not widened ones"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "no local memory"


OVERLAP = Tuning(moe=MoeTuning(fp8_overlap=True))
NO_OVERLAP = Tuning(moe=MoeTuning(fp8_overlap=False))


def _gemm_launches(op, KD, N, E, K, tuning):
    G, nid = _node(op, KD, N, E=E, K=K)
    return [s for s in families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=tuning))
            if s.stage == "wgmma_fp8"]


@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_gate_up", "moe_down"])
def test_fp8_overlap_reaches_the_kernel_only_when_on(op):
    """moe.fp8_overlap off: the GEMM's name, parameters and source as without the knob; on: name
    part ovl, parameter `overlap`, the template's OVL argument, and nothing else changed (the quantiser's launch
    neither)."""
    from codegen.render import render_launch
    assert Tuning().moe.fp8_overlap is True and NO_OVERLAP.flags() == ["--tune moe.fp8_overlap=false"]
    G, nid = _node(op, 144, 200)
    off, on = (families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=t)) for t in (NO_OVERLAP, OVERLAP))
    assert [s.stage for s in off] == [s.stage for s in on]
    (a,) = [s for s in off if s.stage == "wgmma_fp8"]
    (b,) = [s for s in on if s.stage == "wgmma_fp8"]
    assert "overlap" not in a.params and "__ovl__" not in a.name and ", true>(" not in render_launch(a)
    assert b.name == a.name.replace("__wgmma_fp8", "__ovl__wgmma_fp8") and b.params == {**a.params, "overlap": True}
    assert (b.grid, b.block, b.smem, b.args, b.workspace) == (a.grid, a.block, a.smem, a.args, a.workspace)
    assert render_launch(b).count(", true>(") == 1
    assert [(s.name, s.params) for s in off if s.stage != "wgmma_fp8"] == \
        [(s.name, s.params) for s in on if s.stage != "wgmma_fp8"]


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op,KD,N,E,K", [("moe_gate_up_silu", 2048, 1408, 66, 8),   # V2-Lite: 16 K blocks
                                          ("moe_down", 1408, 2048, 66, 8),          # 11
                                          ("moe_gate_up", 720, 200, 8, 2)])         # 6, a ceil block
def test_fp8_overlap_compiles_to_one_group_in_flight_without_spills(op, KD, N, E, K):
    """moe.fp8_overlap for sm_90a: acc + two fp32 tiles (192 registers) fit the consumers' setmaxnreg budget
    without spills; ptxas neither serialises the wgmmas (C7514) nor injects waits (C7517) -- either would
    undo the overlap; the consumer waits for all but the newest group (WARPGROUP.DEPBAR.LE gsb0, 0x1) where
    the plain loop waits for all (0x0) only; the loop issues 4 QGMMA a block at four sites (the first block,
    two a trip, the last two blocks' second)."""
    from codegen.arch import kernel_target
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    from sass import instructions
    depbars = {}
    for overlap in (False, True):
        (la,) = _gemm_launches(op, KD, N, E, K, OVERLAP if overlap else NO_OVERLAP)
        res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                            options=("--ptxas-options=-v",))
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        assert "C7514" not in res.log and "C7517" not in res.log, res.log
        (body,) = instructions(res.cubin).values()
        depbars[overlap] = {i.operands.split(",")[-1].strip() for i in body if i.opcode == "WARPGROUP.DEPBAR.LE"}
        # (the opcode pattern stops at the shape's lower-case x: whole text)
        assert sum((i.opcode + i.operands).startswith("QGMMA.64x128x32.F32.E4M3.E4M3") for i in body) == \
            (16 if overlap else 4)
        assert not any(i.opcode.startswith(("LDL", "STL")) for i in body), "no local memory"
    assert depbars == {False: {"0x0"}, True: {"0x0", "0x1"}}, depbars


def test_fp8_overlap_reaches_every_fp8_x_fp8_gemm_of_a_tiny_models_plan():
    """With moe.fp8_overlap on, every FP8 x FP8 GEMM of the tiny FP8 model's prefill plan is the ovl kernel: the
    experts' (gate / up reading the norm's e4m3 rows included: linear.norm_fp8 is on by default) and the dense
    MLP's gemm_fp8; the rest of the plan's launches are the knob-off plan's."""
    import ir
    from codegen.bundle import plan_spec
    from ir.config_to_spec import spec_from_config
    from ir.formats import weight_formats_yaml
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    spec = ir.load_spec(spec_from_config(tiny, name="tiny") + "\n"
                        + weight_formats_yaml(("model.layers.*.mlp.*_proj.weight",), FP8), file="t.yaml")
    # the dense GEMMs' other name part, ew (linear.gemm_weights_early, on by default), off: their names end in ovl
    plain = LinearTuning(gemm_weights_early=False)
    off, on = (plan_spec(spec, Options(tuning=Tuning(moe=MoeTuning(fp8_overlap=o), linear=plain))).plans["prefill"]
               .launches for o in (False, True))
    experts = [la.name for la in on if la.stage == "wgmma_fp8"]
    assert experts and all("__ovl__" in n for n in experts), experts
    dense = [la.name for la in on if la.stage == "fp8_wgmma"]
    assert dense and all(n.endswith("__ovl") for n in dense), dense
    assert [la.name.replace("__ovl__", "__").removesuffix("__ovl") for la in on] == [la.name for la in off]


def test_fp8_overlap_reaches_the_expert_ffns_two_launch_path():
    """moe_expert_ffn above decode's range runs gate_up_silu's and down's FP8 x FP8 GEMMs: both take the knob."""
    from codegen.families import moe_expert_ffn
    G, nid = _fp8_expert_ffn()
    for ovl in (False, True):
        tuning = Tuning(moe=MoeTuning(fp8_one_token_down=False, fp8_overlap=ovl), linear=LinearTuning(norm_fp8=False))
        gemms = [s for s in moe_expert_ffn.lower(nid, G, Options(dtype="bf16", tuning=tuning)) if s.stage == "wgmma_fp8"]
        assert len(gemms) == 2 and all(("__ovl__" in s.name) == ovl for s in gemms), [s.name for s in gemms]
