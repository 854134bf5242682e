"""The timing scripts' variants on the CPU: each is a Tuning in the compile options that lowers to
the launches the script times, a bad spelling stops with one line, and no script assigns a module
constant (the lowering reads Options.tuning, not globals)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from codegen.paths import REPO_ROOT
from codegen.tuning import DEFAULT_TUNING
from ir.ops import TType
from tests.gpu.harness import single_op_graph

BENCH = Path(REPO_ROOT) / "bench"


@pytest.fixture(scope="module")
def lite():
    from bench.perf_decode import lite
    return lite()


def test_no_bench_script_assigns_a_module_constant():
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    assert not (isinstance(el, ast.Attribute) and el.attr.isupper()), \
                        f"{path.name}:{node.lineno} assigns {ast.unparse(el)}"


def test_perf_route_bounds_are_route_fused_upto(lite):
    from bench import perf_route as pr
    G, nid = pr.route_node("deepseek_v2_lite")
    assert pr.options(0).tuning.route.fused_upto == 0 and pr.options(64).tuning.route.fused_upto == 64
    assert "fused" not in {la.stage for la in pr.lower(G, nid, 0)}
    assert {"fused", "topk"} <= {la.stage for la in pr.lower(G, nid, 256)}


def _moe_route_graph(m):
    d = m.dims
    attrs = {"top_k": d["top_k"], "num_experts": d["experts"], "scoring": "softmax", "method": "greedy",
             "groups": 1, "topk_groups": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0}
    return single_op_graph(m, "moe_route", attrs, {"x": TType(("T", d["hidden"]), "act")}, {"gate": "router.weight"})


def _grouped_graph(m, which):
    d = m.dims
    E, K, D, M = d["experts"], d["top_k"], d["hidden"], d["moe_intermediate"]
    r = TType((f"T*{K}", E), "routing")
    if which == "moe_down":
        return single_op_graph(m, which, {"num_experts": E, "out_dim": D},
                               {"a": TType((f"T*{K}", M), "act"), "R": r}, {"weight": "e.{expert}.down"})
    return single_op_graph(m, which, {"num_experts": E, "out_dim": M}, {"x": TType(("T", D), "act"), "R": r},
                           {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})


def test_perf_prefill_variants(lite):
    from bench import perf_prefill as pp
    assert pp.route_variant("default") == DEFAULT_TUNING
    assert pp.route_variant("gemv").route.gemm_above is None
    assert pp.route_variant("align0").moe.align_parallel_above == 0
    assert pp.attention_variant("v2") == DEFAULT_TUNING
    assert pp.attention_variant("v2_m128n32w32s").attention.prefill_tile == "v2_m128n32w32s"
    g = pp.gemm_variant("64x3").moe
    assert (g.gemm_bk, g.gemm_stages, g.decode_wgmma, g.prefill_wgmma_above) == (64, 3, False, None)
    G, nid = _moe_route_graph(lite)
    assert "router_gemm" in {la.stage for la in pp.lower(G, nid, tuning=pp.route_variant("default"))}
    gemv = {la.stage for la in pp.lower(G, nid, tuning=pp.route_variant("gemv"))}
    assert "router_gemm" not in gemv and "router_gemv" in gemv
    for which in ("moe_gate_up_silu", "moe_down"):
        G, nid = _grouped_graph(lite, which)
        mma, wg = pp.wgmma_pair(G, nid)
        assert (mma.stage, wg.stage) == ("mma", "wgmma")
        (la,) = [la for la in pp.lower(G, nid, tuning=pp.gemm_variant("64x3")) if la.stage == "mma"]
        assert (la.params["bk"], la.params["stages"]) == (64, 3)
    for bad in (lambda: pp.route_variant("tile64x64x4x4"), lambda: pp.gemm_variant("7x3"),
                lambda: pp.gemm_variant("64"), lambda: pp.attention_variant("v3")):
        with pytest.raises(SystemExit):
            bad()


def test_perf_moe_variants_lower_to_the_launches_they_time(lite):
    from bench import perf_moe as pm
    from runtime.launcher import KernelRunner
    k = pm.Kernels(lite, KernelRunner(arch="sm_90"))
    stages = {v: {fam: [la.stage for la in k.get(fam, 6, v)] for fam in pm.families_of(v)}
              for v in ("ts8_thr2_skinny64", "ts0_wgs", "thr0_skinny0", "ffn", "ts4_thr2_skinny32_sbk32_sst3")}
    assert stages["ts8_thr2_skinny64"] == {"moe_gate_up_silu": ["gemv", "mma"], "moe_down": ["gemv", "mma"]}
    assert stages["ts0_wgs"]["moe_gate_up_silu"] == ["wgmma_skinny"]
    assert "wgmma" not in stages["ts0_wgs"]["moe_down"]
    assert stages["thr0_skinny0"] == {"moe_gate_up_silu": ["gemv"], "moe_down": ["gemv"]}
    assert stages["ffn"] == {"moe_expert_ffn": ["fused"]}
    (mma,) = [la for la in k.get("moe_down", 6, "ts4_thr2_skinny32_sbk32_sst3") if la.stage == "mma"]
    assert (mma.params["thr"], mma.params["skinny"], mma.params["sbk"], mma.params["sst"]) == (2, 32, 32, 3)
    (gemv,) = k.get("moe_down", 6, "thr0_skinny0")
    assert "T" not in str(gemv.grid[0]), "thr0: the GEMV at every T"
    names = [la.name for v in ("ts8_thr2_skinny64", "ts4_thr2_skinny32_sbk32_sst3") for la in k.get("moe_down", 6, v)]
    assert len(names) == len(set(names)), "variants never share a kernel name"
    assert pm.parse_variant("wgs").tuning.moe.decode_wgmma_from == DEFAULT_TUNING.moe.decode_wgmma_from
    for bad in ("ts8_thr2_skinny64_bulk", "thr2_skinny7", "ts9999_wgs", "x"):
        with pytest.raises(SystemExit):
            pm.parse_variant(bad)


def test_perf_decode_attention_variants(lite):
    from bench import perf_decode as pdc
    d = lite.dims
    H, C, R = d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    G, nid = single_op_graph(lite, "mla_decode_attention", {},
                             {"q_lat": TType(("T", H, C), "act"), "q_rot": TType(("T", H, R), "act"),
                              "kv": TType(("cache",), "state")}, {}, phase="decode")
    variants = pdc.ATTN_VARIANTS.split(",")
    assert pdc.attention_variant(variants[0]) == DEFAULT_TUNING
    names = [tuple(la.name for la in pdc.lower(G, nid, pdc.attention_variant(v))) for v in variants]
    assert len(set(names)) == len(variants)
    assert all(la.block[0] == 128 for la in pdc.lower(G, nid, pdc.attention_variant("w4s3c8")))
    with pytest.raises(SystemExit):
        pdc.attention_variant("w3s3c8")


def test_perf_linear_variants():
    from bench import perf_linear as pl
    from bench import perf_linear_fp8 as pf
    assert pl.parse_variant(pl.DEFAULT_VARIANT) == DEFAULT_TUNING
    t = pl.parse_variant("w8r1u4k2").linear
    assert (t.warps, t.row_tiles, t.unroll, t.ksplit) == (8, 1, 4, 2)
    assert pf.parse_variant("default") == DEFAULT_TUNING
    f = pf.parse_variant("w8r1u1_batch").linear
    assert (f.fp8_unroll, f.fp8_silu_unroll, f.fp8_pipeline, f.fp8_silu_pipeline) == (1, 1, "batch", "batch")
    for bad in (lambda: pl.parse_variant("w3r1u4"), lambda: pf.parse_variant("w8r1u4_other"),
                lambda: pf.parse_variant("w8r3u4")):
        with pytest.raises(SystemExit):
            bad()
