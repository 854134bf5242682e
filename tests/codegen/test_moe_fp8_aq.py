"""gate_up_silu's FP8 x FP8 epilogue handing down its e4m3 activations on the CPU (Tuning.moe.fp8_act_epilogue,
codegen/families/_moe_aq.py, templates/include/moe_gemm_fp8.cuh AQ): off by default, and off the launches are
today's; on, where gate_up_silu and down both run the FP8 x FP8 GEMM over the same token counts, gate_up_silu's
GEMM is the 128-column-group variant writing a's storage and down runs without its quantiser, reading a's
storage (the expert FFN's workspace, or prefill's value a); elsewhere nothing changes.  NVRTC compiles both
variants for sm_90a without spills."""
from __future__ import annotations

import json

import pytest

from codegen import dispatch, families, sizes
from codegen.families import _moe_aq, _moe_gemm_fp8, moe_expert_ffn
from codegen.kernel import KernelLaunch, Options, SizeRef, ValueRef, WorkspaceRef
from codegen.tuning import MoeTuning, Tuning
from ir.formats import FP8
from sass import cuobjdump, opcodes
from test_moe_gemm_fp8 import FIRST, _running
from tiny import ROOT

AQ = Tuning(moe=MoeTuning(fp8_act_epilogue=True))
AQ_STAGE = _moe_gemm_fp8.AQ_VARIANT


def ffn_node(D: int = 272, M: int = 144, E: int = 8, K: int = 2, fp8=("gate", "up", "down")):
    from ir.formats import set_format
    from ir.ops import TType
    from tests.gpu.harness import single_op_graph, tiny_model
    G, nid = single_op_graph(tiny_model(), "moe_expert_ffn", {"num_experts": E, "inner_dim": M, "out_dim": D},
                             {"x": TType(("T", D), "act"), "R": TType((f"T*{K}", E), "routing")},
                             {"gate": "e.{expert}.gate", "up": "e.{expert}.up", "down": "e.{expert}.down"})
    for role in fp8:
        set_format(G.graph["weights"], G.nodes[nid]["weights"][role], FP8)
    return G, nid


def test_the_knob_is_off_by_default():
    assert Tuning().moe.fp8_act_epilogue is False
    assert AQ.flags() == ["--tune moe.fp8_act_epilogue=true"]
    assert Tuning().to_json()["moe"]["fp8_act_epilogue"] is False and AQ.to_json()["moe"]["fp8_act_epilogue"] is True


def test_the_expert_ffn_hands_a_down_in_e4m3_without_downs_quantiser():
    G, nid = ffn_node()
    off = [s for s in moe_expert_ffn.lower(nid, G, Options(dtype="bf16")) if _running([s], FIRST, 2)]
    assert [s.stage for s in off] == ["quant_x", "wgmma_fp8", "quant_x", "wgmma_fp8"]
    steps = moe_expert_ffn.lower(nid, G, Options(dtype="bf16", tuning=AQ))
    on = [s for s in steps if _running([s], FIRST, 2)]
    assert [s.stage for s in on] == ["quant_x", AQ_STAGE, AQ_STAGE]
    for T in (1, 16, 256):    # decode's range: the 16-bit a, as without the knob
        assert AQ_STAGE not in _running(steps, T, 2)
    x_q, gu, dn = on
    assert x_q.nodes == gu.nodes == dn.nodes == (nid,)
    assert {a.name: a.ref for a in x_q.args}["x"] == ValueRef("x")
    gu_refs, dn_refs = {a.name: a.ref for a in gu.args}, {a.name: a.ref for a in dn.args}
    # a's storage (the node's workspace) carries the e4m3 rows and scales from one to the other
    assert gu_refs["out"] == dn_refs["a"] == WorkspaceRef(moe_expert_ffn.WORKSPACE)
    assert gu_refs["NP"] == dn_refs["NP"] == SizeRef("NP")
    assert "xq" not in dn_refs and {w.name for w in dn.workspace} == {moe_expert_ffn.WORKSPACE}
    assert gu_refs["xq"] == WorkspaceRef(_moe_gemm_fp8.WORKSPACES[False][0])
    assert gu.name.endswith("wgmma_fp8_aq") and dn.name.endswith("wgmma_fp8_aq")
    assert gu.params["cols"] == 128 and dn.params["cols"] == 128 and gu.params["variant"] == AQ_STAGE
    # 144 columns: two 128-column groups (the second partial); NP = 600 pairs: <= 4 + 8 row tiles
    assert sizes.evaluate(gu.grid[0], {"T": 300, "NP": 600, "SMS": 132}) == 2 * (600 // 128 + 8)
    assert gu.smem == dn.smem == _moe_gemm_fp8.smem()


def prefill_plan(tuning: Tuning):
    import ir
    from codegen.bundle import plan_spec
    from ir.config_to_spec import spec_from_config
    from ir.formats import weight_formats_yaml
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    spec = ir.load_spec(spec_from_config(tiny, name="tiny") + "\n"
                        + weight_formats_yaml(("model.layers.*.mlp.*_proj.weight",), FP8), file="t.yaml")
    return plan_spec(spec, Options(tuning=tuning)).plans["prefill"]


def _by_node(plan, family):
    out: dict = {}
    for la in plan.launches:
        if la.family == family or (la.stage == "quant_x" and la.nodes[0] in out):
            out.setdefault(la.nodes[0], []).append(la)
    return out


def test_prefills_gate_up_silu_and_down_pass_a_in_e4m3():
    """The tiny FP8 model's prefill: each MoE layer's moe_gate_up_silu writes a's storage in e4m3, its
    moe_down reads it there without a quantiser launch; without the knob the plan is today's."""
    import json as _json
    from codegen.manifest import phase_from_json, phase_to_json
    off, on = prefill_plan(Tuning()), prefill_plan(AQ)
    assert not any(la.stage == AQ_STAGE for la in off.launches)
    gates, downs = _by_node(on, "moe_gate_up_silu"), _by_node(on, "moe_down")
    assert gates and len(gates) == len(downs)
    for nid, steps in gates.items():
        stages = [s.stage for s in steps]
        assert stages[-2:] == ["quant_x", AQ_STAGE], stages
        (a,) = on.nodes[nid].outputs
        assert {x.name: x.ref for x in steps[-1].args}["out"] == ValueRef(a)
    for nid, steps in downs.items():
        stages = [s.stage for s in steps]
        assert "quant_x" not in stages and stages[-1] == AQ_STAGE, stages
        assert not steps[-1].workspace
        assert any(x.ref in ({ValueRef(on.nodes[g].outputs[0]) for g in gates}) for x in steps[-1].args)
    back = phase_from_json("prefill", _json.loads(_json.dumps(phase_to_json(on))))
    assert [(s.name, s.args, s.grid) for s in back.launches] == [(s.name, s.args, s.grid) for s in on.launches]
    # the rest of the step is the same launches
    rest = lambda plan: [la.name for la in plan.launches if la.family not in ("moe_gate_up_silu", "moe_down")
                         and not (la.stage == "quant_x" and la.nodes[0] in {**gates, **downs})]
    assert rest(off) == rest(on)


def _params(N: int, *, fp8=True, KD: int = 272, down=False) -> dict:
    from codegen.families._moe import grouped_params
    p = grouped_params("n", Options(), E=8, N=N, KD=KD, K=1 if down else 2, rows_per_warp=2)
    return {**p, "fp8": True} if fp8 else p


@pytest.mark.parametrize("why,tuning,gu,dn", [
    ("the knob off", Tuning(), _params(144), _params(272, KD=144, down=True)),
    ("activations kept 16-bit", Tuning(moe=MoeTuning(fp8_act_epilogue=True, fp8_activations=False)),
     _params(144), _params(272, KD=144, down=True)),
    ("down's weight bf16", AQ, _params(144), _params(272, KD=144, down=True, fp8=False)),
    ("a's rows not whole 16-byte chunks of e4m3", AQ, _params(200), _params(272, KD=200, down=True)),
    ("no FP8 x FP8 rows", Tuning(moe=MoeTuning(fp8_act_epilogue=True, prefill_wgmma_above=None)),
     _params(144), _params(272, KD=144, down=True))])
def test_no_hand_off_where_the_two_ends_do_not_both_run_the_fp8_gemm(why, tuning, gu, dn):
    opts = Options(dtype="bf16", tuning=tuning)
    assert not _moe_aq.hands_off(opts, gu, dn), why
    assert _moe_aq.hands_off(Options(dtype="bf16", tuning=AQ), _params(144), _params(272, KD=144, down=True))


def test_an_a_nothing_pairs_with_keeps_its_16_bit_form():
    """moe_gate_up_silu whose a is the graph's output (no moe_down reads it): no hand-off, either end."""
    from test_moe_fp8_lowering import _node
    for op in ("moe_gate_up_silu", "moe_down"):
        G, nid = _node(op, 272, 144)
        assert _moe_aq.pair(G, nid) is None and not _moe_aq.prefill_hands_off(G, nid, Options(tuning=AQ))
        stages = [s.stage for s in families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=AQ))]
        assert AQ_STAGE not in stages and stages[-2:] == ["quant_x", "wgmma_fp8"], stages


def test_the_dispatch_rows_do_not_read_the_knob():
    facts = {"dtype": "bf16", "weight_format": FP8.name, "sm_90a": True, "tma_rows": True, "decode_wgmma_fits": True,
             "prefill_wgmma_fits": True, "fp8_rows": True, "fp8_fits": True, "fp8x_fits": True, "one_token": False,
             "fp8_activations": True}
    for op in ("moe_gate_up_silu", "moe_down"):
        for T in (1, FIRST - 1, FIRST, 16384):
            assert dispatch.select(op, T, facts, AQ).variant == dispatch.select(op, T, facts).variant


@pytest.mark.slow
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("D,M,E,K,dtype", [(2048, 1408, 66, 8, "bf16"),     # V2-Lite
                                           (7168, 2048, 257, 9, "fp16"),    # V3
                                           (272, 144, 8, 2, "bf16")])       # a partial last group
def test_the_hand_off_compiles_without_spills(D, M, E, K, dtype):
    from codegen.arch import kernel_target
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    G, nid = ffn_node(D, M, E, K)
    gu, dn = [s for s in moe_expert_ffn.lower(nid, G, Options(dtype=dtype, tuning=AQ)) if s.stage == AQ_STAGE]
    for la in (gu, dn):
        assert isinstance(la, KernelLaunch)
        res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                            options=("--ptxas-options=-v",))
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        ops = opcodes(res.cubin)
        assert ops["QGMMA.64x128x32.F32.E4M3.E4M3"] > 0 and not any(o.startswith(("LDL", "STL")) for o in ops)
        # the e4m3 conversions are the epilogue's (gate_up_silu), none in down
        cvt = sum(v for o, v in ops.items() if o.startswith("F2FP") and "E4M3" in o)
        assert (cvt > 0) == (la is gu), sorted(ops)
