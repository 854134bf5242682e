"""The MoE kernel families lower, render deterministically and compile to sm_90 CUBINs (no GPU).

Shapes: DeepSeek-V2-Lite (E 64, K 6, D 2048, M 1408), V2 (E 160, K 6, groups 8/3, D 5120,
M 1536), V3 (E 256, K 8, groups 8/4, D 7168, M 2048) and a small odd one, in bf16/fp16/fp32;
plus the shipped specs through the pass pipeline (every MoE node lowers by its family).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import single_op_graph, tiny_model  # noqa: E402

import ir  # noqa: E402
import ir.passes  # noqa: E402
from codegen import families  # noqa: E402
from codegen.tuning import SECTIONS, MoeTuning, Tuning  # noqa: E402
from codegen.arch import kernel_target  # noqa: E402
from codegen.kernel import KernelLaunch, Options  # noqa: E402
from codegen.kernel import SizeRef, WorkspaceRef  # noqa: E402
from codegen.render import render_launch  # noqa: E402
from ir.ops import TType  # noqa: E402

MOE_OPS = ("moe_route", "moe_topk", "moe_align", "moe_gate_up_silu", "moe_gate_up", "moe_down",
           "moe_combine", "moe_combine_residual", "moe_combine_residual_rms_norm")

# name: (E, K, groups, topk_groups, D, M, scoring, method, bias, norm, scaling)
DIMS = {
    "v2_lite": (64, 6, 1, 1, 2048, 1408, "softmax", "greedy", False, False, 1.0),
    "v2": (160, 6, 8, 3, 5120, 1536, "softmax", "group_limited_greedy", False, False, 16.0),
    "v3": (256, 8, 8, 4, 7168, 2048, "sigmoid", "noaux_tc", True, True, 2.5),
    "odd": (12, 3, 4, 2, 40, 36, "sigmoid", "noaux_tc", True, True, 2.5),
}


def moe_graphs(E, K, G, TG, D, M, scoring, method, bias, norm, scaling):
    """One single-op graph per MoE op at these dims: [(G, nid)]."""
    model = tiny_model()
    topk = {"scoring": scoring, "method": method, "top_k": K, "groups": G, "topk_groups": TG,
            "norm_topk_prob": norm, "routed_scaling_factor": scaling}
    routing = TType((f"T*{K}", E), "routing")
    experts = {"gate": "e.{expert}.gate", "up": "e.{expert}.up"}
    pairs = {"eo": TType((f"T*{K}", D), "act"), "w": TType(("T", K), "f32")}
    return [
        single_op_graph(model, "moe_route", {**topk, "num_experts": E}, {"x": TType(("T", D), "act")},
                        {"gate": "router.weight", **({"bias": "router.bias"} if bias else {})}),
        single_op_graph(model, "moe_topk", topk, {"logits": TType(("T", E), "f32")},
                        {"bias": "router.bias"} if bias else {}),
        single_op_graph(model, "moe_align", {"num_experts": E}, {"ids": TType(("T", K), "i64")}, {}),
        single_op_graph(model, "moe_gate_up_silu", {"num_experts": E, "out_dim": M},
                        {"x": TType(("T", D), "act"), "R": routing}, experts),
        single_op_graph(model, "moe_gate_up", {"num_experts": E, "out_dim": M},
                        {"x": TType(("T", D), "act"), "R": routing}, experts),
        single_op_graph(model, "moe_down", {"num_experts": E, "out_dim": D},
                        {"a": TType((f"T*{K}", M), "act"), "R": routing}, {"weight": "e.{expert}.down"}),
        single_op_graph(model, "moe_combine", {}, pairs, {}),
        single_op_graph(model, "moe_combine_residual", {},
                        {**pairs, "shared": TType(("T", D), "act"), "residual": TType(("T", D), "act")}, {}),
        single_op_graph(model, "moe_combine_residual_rms_norm", {},
                        {**pairs, "shared": TType(("T", D), "act"), "residual": TType(("T", D), "act")},
                        {"weight": "norm.weight"}),
    ]


def lower(G, nid, dtype, tuning=None) -> list[KernelLaunch]:
    fam = families.family_for_op(G.nodes[nid]["op"])
    assert fam is not None, f"no family claims {G.nodes[nid]['op']}"
    return fam.lower(nid, G, Options(dtype=dtype, tuning=tuning))


def tuned(**sections) -> Tuning:
    """A Tuning with these sections' knobs set: tuned(moe={"decode_wgmma": False})."""
    return Tuning(**{k: SECTIONS[k](**v) for k, v in sections.items()})


DECODE_WGMMA_OFF = tuned(moe={"decode_wgmma": False})


def test_every_moe_op_has_a_family():
    claimed = families.claimed_ops()
    assert {op: claimed.get(op) for op in MOE_OPS} == {op: op for op in MOE_OPS}


@pytest.mark.parametrize("dims", sorted(DIMS))
def test_lowering_is_deterministic_and_names_are_readable(dims):
    for dtype in ("bf16", "fp16", "fp32"):
        for G, nid in moe_graphs(*DIMS[dims]):
            a, b = lower(G, nid, dtype), lower(G, nid, dtype)
            assert a == b
            for launch in a:
                assert launch.name.startswith(launch.family + "__")
                assert launch.nodes == (nid,)
                src = render_launch(launch)
                assert src == render_launch(launch)
                assert f'extern "C" __global__' in src and f"{launch.name}(" in src
                assert "/work" not in src and "/home" not in src


def test_kernel_names():
    # decode's wgmma off: the GEMV and the mma launch (then: below)
    by_op = {G.nodes[nid]["op"]: [x.name for x in lower(G, nid, "bf16", DECODE_WGMMA_OFF)]
             for G, nid in moe_graphs(*DIMS["v3"])}
    assert by_op["moe_route"] == ["moe_route__bf16__d7168__e256_k8__g8_tg4__sigmoid_noaux_tc__norm__rsf2p5__bias__fused_t256",
                                  "moe_route__bf16__e256_d7168__gemm",
                                  "moe_route__e256_k8__g8_tg4__sigmoid_noaux_tc__norm__rsf2p5__bias__topk",
                                  "moe_route__e256__align", "moe_route__e256__align_count",
                                  "moe_route__e256__align_scan", "moe_route__e256__align_scatter"]
    assert by_op["moe_gate_up_silu"] == ["moe_gate_up_silu__bf16__e256_k8__m2048_d7168",
                                         "moe_gate_up_silu__bf16__e256_k8__m2048_d7168__mma",
                                         "moe_gate_up_silu__bf16__e256_k8__m2048_d7168__wgmma"]
    assert by_op["moe_down"] == ["moe_down__bf16__e256__d7168_m2048", "moe_down__bf16__e256__d7168_m2048__mma",
                                 "moe_down__bf16__e256__d7168_m2048__wgmma"]
    # the default: decode's wgmma in their place
    on = {G.nodes[nid]["op"]: [x.name for x in lower(G, nid, "bf16")] for G, nid in moe_graphs(*DIMS["v3"])}
    assert on["moe_down"] == ["moe_down__bf16__e256__d7168_m2048__wgmma_skinny",
                              "moe_down__bf16__e256__d7168_m2048__wgmma_skinny_t1",     # one token
                              "moe_down__bf16__e256__d7168_m2048__wgmma"]
    fp32 = {G.nodes[nid]["op"]: [x.name for x in lower(G, nid, "fp32")] for G, nid in moe_graphs(*DIMS["v3"])}
    assert fp32["moe_down"] == ["moe_down__fp32__e256__d7168_m2048"]     # no tensor-core path for fp32
    assert by_op["moe_combine_residual"] == ["moe_combine_residual__bf16__k8_d7168"]
    assert by_op["moe_combine_residual_rms_norm"] == ["moe_combine_residual_rms_norm__bf16__k8_d7168"]
    v2 = {G.nodes[nid]["op"]: [x.name for x in lower(G, nid, "fp16")] for G, nid in moe_graphs(*DIMS["v2"])}
    assert v2["moe_topk"] == ["moe_topk__e160_k6__g8_tg3__softmax_group_limited_greedy__rsf16p0"]


def _worst_tiles(NP: int, thr: int) -> int:
    """Row tiles needed by the split of NP pairs over 64 experts with the most tiles: many small
    heavy experts (thr + 1 pairs each) and one taking the rest."""
    heavy = NP // (thr + 1)
    worst = [thr + 1] * min(63, heavy) if heavy else []
    worst.append(NP - sum(worst))
    return sum(-(-c // 128) for c in worst if c > thr)


def test_grouped_launch_covers_every_expert_and_row():
    """Exactly one of the launches runs at each T, and it covers every expert with pairs.  With
    decode's wgmma off: the GEMV while T <= moe.gemv_upto (a slot per expert that can have
    pairs), the one-grid mma launch above (the same light slots, then a bound on the row tiles), up
    to moe.prefill_wgmma_above, and the wgmma launch above that (its grid: test_wgmma_lowering.py).
    With it on (the default): the decode wgmma up to moe.prefill_wgmma_above, then the prefill wgmma."""
    from codegen import sizes
    GEMM_WGMMA_TOKENS, GEMV_ONLY_TOKENS = MoeTuning().prefill_wgmma_above, MoeTuning().gemv_upto
    Ts = (1, 2, 3, GEMV_ONLY_TOKENS, GEMV_ONLY_TOKENS + 1, 64, 128, GEMM_WGMMA_TOKENS, GEMM_WGMMA_TOKENS + 1, 16384)
    for G, nid in moe_graphs(*DIMS["v2_lite"]):
        op = G.nodes[nid]["op"]
        if op not in ("moe_gate_up_silu", "moe_gate_up", "moe_down"):
            continue
        launch, gemm, wgmma = lower(G, nid, "bf16", DECODE_WGMMA_OFF)
        p, q = launch.params, gemm.params
        assert launch.grid[1] * p["warps"] * p["rpw"] >= p["N"]
        assert p["vec"] * 2 == 16                         # 16-byte weight loads
        bn = 128 if op == "moe_down" else 64
        assert gemm.grid[0] * bn >= q["N"]                # the column tiles cover N
        assert any(a.name == "num_pairs" for a in gemm.args)   # where the tiles start (moe_grouped.cuh 4b)
        for T in Ts:
            NP = 6 * T
            env = {"NP": NP, "T": T, "SMS": 132}
            gemv_x, mma_y = sizes.evaluate(launch.grid[0], env), sizes.evaluate(gemm.grid[1], env)
            wg = sizes.evaluate(wgmma.grid[0], env)
            if T <= GEMV_ONLY_TOKENS:
                assert (gemv_x, mma_y, wg) == (min(64, NP), 0, 0), (T, gemv_x, mma_y, wg)
            elif T <= GEMM_WGMMA_TOKENS:
                assert gemv_x == 0 and wg == 0, T
                assert mma_y >= min(64, NP) + _worst_tiles(NP, q["thr"]), (T, mma_y)
            else:
                assert gemv_x == 0 and mma_y == 0 and wg > 0, (T, wg)
        skinny, *one, wgmma = lower(G, nid, "bf16")
        assert (skinny.stage, wgmma.stage) == ("wgmma_skinny", "wgmma")
        assert [o.stage for o in one] == ["wgmma_skinny_t1"] * (op == "moe_down")   # down at one token
        assert skinny.params["cols"] == bn
        for T in Ts:
            env = {"NP": 6 * T, "T": T, "SMS": 132}
            sk, wg = sizes.evaluate(skinny.grid[0], env), sizes.evaluate(wgmma.grid[0], env)
            t1 = sum(sizes.evaluate(o.grid[0], env) for o in one)
            # a persistent grid walks every tile: any CTAs at all cover them; at most two per SM (the
            # one-token launch's deeper ring: one)
            assert (sk + t1 > 0, wg > 0) == (T <= GEMM_WGMMA_TOKENS, T > GEMM_WGMMA_TOKENS), (T, sk, wg)
            assert sk <= 2 * 132 and t1 <= 132 and (t1 > 0) == (bool(one) and T == 1), (T, sk, t1)
        # fp32 has no tensor-core launch: its GEMV takes every expert at every T
        (f32,) = lower(G, nid, "fp32")
        for T in (1, GEMV_ONLY_TOKENS + 1, 16384):
            assert sizes.evaluate(f32.grid[0], {"NP": 6 * T, "T": T}) == min(64, 6 * T)


def test_route_needs_no_host_sync():
    """Every size the route launches read is host-known (T, NP, and the device's SM count, which the
    router GEMM's split of D reads), none a device count."""
    from codegen import sizes
    for G, nid in moe_graphs(*DIMS["v3"])[:3]:
        for launch in lower(G, nid, "bf16"):
            used = set()
            for g in (*launch.grid, launch.smem, *(d for ws in launch.workspace for d in ws.shape)):
                used |= sizes.names(g)
            for a in launch.args:
                if isinstance(a.ref, SizeRef):
                    used |= sizes.names(a.ref.expr)
            assert used <= {"T", "NP", "SMS"}, (launch.name, used)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["deepseek_v2_lite", "deepseek_v2", "deepseek_v3"])
def test_shipped_specs_lower_their_moe_nodes(spec):
    for phase in ("decode", "prefill"):
        G = ir.passes.run_pipeline(ir.build_graph(ir.load_spec(f"model_specs/{spec}.yaml"), phase))
        ops = set()
        for nid, data in G.nodes(data=True):
            if data["op"].startswith("moe_"):
                ops.add(data["op"])
                assert lower(G, nid, "bf16")
        # every MoE layer's output meets the next norm (the final one after the last layer); decode
        # runs the expert FFN as one op (ir/passes/fuse_expert_ffn.py), prefill as two
        experts = {"moe_expert_ffn"} if phase == "decode" else {"moe_gate_up_silu", "moe_down"}
        assert {"moe_route", *experts, "moe_combine_residual_rms_norm"} <= ops
        assert not ({"moe_expert_ffn", "moe_gate_up_silu", "moe_down"} - experts) & ops, ops


def _nvrtc_or_skip():
    try:
        from codegen.nvrtc import compile_cubin, nvrtc_version
        nvrtc_version()
    except Exception as e:  # no cuda-bindings / libnvrtc on this machine
        pytest.skip(f"NVRTC unavailable: {e}")
    return compile_cubin


@pytest.mark.slow
@pytest.mark.parametrize("dims", sorted(DIMS))
def test_compiles_to_sm90_cubin(dims, tmp_path):
    compile_cubin = _nvrtc_or_skip()
    seen = set()
    for dtype in ("bf16", "fp16", "fp32"):
        for G, nid in moe_graphs(*DIMS[dims]):
            for launch in lower(G, nid, dtype):
                if launch.name in seen:       # dtype-free kernels (top-k, align) compile once
                    continue
                seen.add(launch.name)
                src = render_launch(launch)
                # the wgmma launch requires sm_90a (codegen/arch.py): the bundle builds it for that
                out = compile_cubin(src, launch.name, arch=kernel_target("sm_90", launch.requires),
                                    template=launch.template,
                                    nodes=launch.nodes, log_dir=str(tmp_path))
                assert out.cubin[:4] == b"\x7fELF", launch.name


@pytest.mark.parametrize("op", ["moe_align", "moe_route"])
def test_parallel_align_takes_over_above_its_pair_count(op):
    """With moe.align_parallel_above set, the one-CTA align runs up to that many pairs and the
    count / scan / scatter launches above it (each grid 0 otherwise); the chunks cover NP, the
    scan is one CTA, and all three share one hist workspace of a row per chunk."""
    from codegen import sizes
    tuning = tuned(moe={"align_parallel_above": 512})
    # moe_route aligns in its fused launch while T <= route.fused_upto: its align launches then
    # have grid 0 (test_route_runs_one_form_at_each_t); here T is past that bound.
    T = tuning.route.fused_upto + 1 if op == "moe_route" else None
    for G, nid in moe_graphs(*DIMS["v2_lite"]):
        if G.nodes[nid]["op"] != op:
            continue
        launches = [la for la in lower(G, nid, "bf16", tuning) if "align" in la.name]
        assert [la.stage.removeprefix("align").lstrip("_") for la in launches] == ["", "count", "scan", "scatter"]
        one, count, scan, scatter = launches
        for NP in (1, 511, 512, 513, 2048, 2049, 98304):
            env = {"NP": NP, "T": T or NP}
            grids = [sizes.evaluate(la.grid[0], env) for la in launches]
            if NP <= 512:
                assert grids == [1, 0, 0, 0], (NP, grids)
            else:
                assert grids[0] == 0 and grids[2] == 1 and grids[1] == grids[3], (NP, grids)
                assert grids[1] * count.params["chunk"] >= NP > (grids[1] - 1) * count.params["chunk"]
                (ws,) = count.workspace
                assert sizes.evaluate(ws.shape[0], env) == grids[1] and ws.shape[1] == count.params["E"]
        assert count.workspace == scan.workspace == scatter.workspace
        assert "align_count" in render_launch(count) and "align_scatter" in render_launch(scatter)
        return
    raise AssertionError(f"no {op} node")


def test_align_default_is_parallel_above_the_measured_pair_count():
    """One CTA up to 6144 pairs (1024 tokens at K 6), the count / scan / scatter launches above;
    off (none) only the one CTA."""
    assert MoeTuning().align_parallel_above == 6144
    for G, nid in moe_graphs(*DIMS["v2_lite"]):
        if G.nodes[nid]["op"] == "moe_route":
            assert [la.stage for la in lower(G, nid, "bf16")] == ["fused", "router_gemm", "topk", "align",
                                                                 "align_count", "align_scan", "align_scatter"]
            off = tuned(moe={"align_parallel_above": None})
            assert [la.stage for la in lower(G, nid, "bf16", off)] == ["fused", "router_gemm", "topk", "align"]


# T at the bounds' edges (255, 256, 257 with the default 256), at a fused tile's (7, 8, 9) and a GEMM
# tile's (63, 64, 65), and prefill's (2048: 1 x 2048, 16384: 32 x 512).
def _route_tokens(*bounds):
    edges = {b + d for b in bounds if b for d in (-1, 0, 1)}
    return sorted(t for t in {1, 2, 7, 8, 9, 31, 33, 63, 64, 65, 128, 2048, 16384} | edges if t >= 1)


def _check_gemm_grid(gemm, E, D, T, env):
    """The GEMM's grid covers every expert and token; its split of D is within the cap, fills at
    most the SMs, fits the tickets, and has its workspace rows (one per thread of every split)."""
    from codegen import sizes
    from codegen.families import moe_route
    p = gemm.params
    gx, gy, S = (sizes.evaluate(g, env) for g in gemm.grid)
    assert gx * p["bn"] >= E > (gx - 1) * p["bn"], (T, gx)
    assert gy * p["bm"] >= T > (gy - 1) * p["bm"], (T, gy)
    assert 1 <= S <= moe_route.gemm_split_cap(D), (T, S)
    if S > 1:
        assert gx * gy <= p["tickets"] and gx * gy * S <= env["SMS"], (T, gx, gy, S)
    else:
        assert gx * gy * 2 > min(env["SMS"], p["tickets"]) or moe_route.gemm_split_cap(D) == 1, (T, gx, gy)
    (logits, partials) = gemm.workspace
    rows = sizes.evaluate(partials.shape[0], env)
    assert rows == (S * gx * gy * p["threads"] if S > 1 else 0) and partials.shape[1] == p["tm"] * p["tn"]
    assert sizes.evaluate(logits.shape[0], env) == T and logits.shape[1] == E
    assert sizes.evaluate(gemm.smem, env) == p["smem"] == moe_route.gemm_smem(p["bm"], p["bn"], p["bk"])


@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("ft", ["default", 0, 1, 8, 100])
@pytest.mark.parametrize("gt", ["default", None, 0, 8, 300])
def test_route_runs_one_form_at_each_t(dims, ft, gt):
    """Exactly one form of the route runs at each T: the fused launch while T <= route.fused_upto
    (its grid covers every expert and token, and stays within its tickets' tiles), the three
    launches above it (their grids 0 below it), their logits from the GEMV while T <= route.gemm_above
    and from the GEMM above (its grid: _check_gemm_grid); a launch whose range of T is empty is not
    emitted.  ft 0: the three launches alone, at every T; gt None: no GEMM.  The alignment is
    the one-CTA launch up to moe.align_parallel_above pairs, count / scan / scatter above."""
    from codegen import sizes
    ap = MoeTuning().align_parallel_above
    parallel = ["align_count", "align_scan", "align_scatter"] if ap is not None else []
    knobs = {**({} if ft == "default" else {"fused_upto": ft}), **({} if gt == "default" else {"gemm_above": gt})}
    tuning = tuned(route=knobs)
    ft, gt = tuning.route.fused_upto or None, tuning.route.gemm_above
    E, K, D = DIMS[dims][0], DIMS[dims][1], DIMS[dims][4]
    G, nid = moe_graphs(*DIMS[dims])[0]
    launches = lower(G, nid, "bf16", tuning)
    gemv = gt is None or gt > (ft or 0)
    assert [la.stage for la in launches] == ((["fused"] if ft is not None else []) + (["router_gemv"] if gemv else [])
                                             + (["router_gemm"] if gt is not None else []) + ["topk", "align"]
                                             + parallel)
    for T in _route_tokens(ft, gt):
        for sms in (132, 16, 4096):
            env = {"T": T, "NP": T * K, "SMS": sms}
            extents = {la.stage: [sizes.evaluate(g, env) for g in la.grid] for la in launches}
            running = {stage for stage, grid in extents.items() if 0 not in grid}
            if ft is not None and T <= ft:
                assert running == {"fused"}, (T, extents)
                fused = next(la for la in launches if la.stage == "fused")
                p = fused.params
                gx, gy, _ = extents["fused"]
                assert gx * p["epb"] >= E > (gx - 1) * p["epb"], (T, gx)
                assert gy * p["tt"] >= T > (gy - 1) * p["tt"] and gy <= p["tiles"], (T, gy)
                assert sizes.evaluate(fused.smem, env) == p["smem"] >= max(2 * p["warps"] * E * 4, T * K * 4)
                assert p["warps"] == p["tt"] == p["threads"] // 32       # one warp per token of a tile
                continue
            logits = "router_gemv" if gt is None or T <= gt else "router_gemm"
            one_cta = ap is None or T * K <= ap
            assert running == {logits, "topk", *(["align"] if one_cta else parallel)}, (T, extents)
            if logits == "router_gemm":
                _check_gemm_grid(next(la for la in launches if la.stage == "router_gemm"), E, D, T, env)
            topk = next(la for la in launches if la.stage == "topk")
            assert extents["topk"][0] * topk.params["warps"] >= T
            if one_cta:
                assert extents["align"][0] == 1


def test_route_gemm_splits_d_only_while_the_tiles_are_few():
    """V2-Lite on 132 SMs: prefill 32 x 512 (256 tiles) runs unsplit, 1 x 2048 (32 tiles) in 4
    splits of D, T = 257 (5 tiles) in the most (8), so every T above the fused bound fills the SMs."""
    from codegen import sizes
    G, nid = moe_graphs(*DIMS["v2_lite"])[0]
    (gemm,) = [la for la in lower(G, nid, "bf16") if la.stage == "router_gemm"]
    split = {T: sizes.evaluate(gemm.grid[2], {"T": T, "SMS": 132}) for T in (257, 2048, 4096, 16384)}
    assert split == {257: 8, 2048: 4, 4096: 2, 16384: 1}, split


def test_fused_route_keeps_the_three_launch_interface():
    """The fused launch writes the same outputs as the three launches (ids, weights, the routing's
    order and offsets) and the same router_logits workspace (tests read it), with the gate and
    bias bound alike, so the buffer plan does not depend on which form runs.  The GEMM's split
    workspace is its own (the partial sums of its CTAs)."""
    G, nid = moe_graphs(*DIMS["v3"])[0]
    fused, gemm, topk, align = lower(G, nid, "bf16")[:4]   # (the parallel alignment's launches follow)
    refs = lambda las: {a.ref for la in las for a in la.args}                  # noqa: E731
    partials = WorkspaceRef("router_partials")
    assert partials in refs([gemm])
    assert refs([fused]) == refs([gemm, topk, align]) - {SizeRef("NP"), partials}
    assert fused.workspace == topk.workspace == gemm.workspace[:1]
    assert [ws.name for ws in gemm.workspace] == ["router_logits", "router_partials"]


def _route_launches_of_shipped_specs():
    """Every moe_route launch of the shipped specs' decode and prefill graphs (bf16), once by name."""
    seen = {}
    for spec in ("deepseek_v2_lite", "deepseek_v2", "deepseek_v3"):
        for phase in ("decode", "prefill"):
            G = ir.passes.run_pipeline(ir.build_graph(ir.load_spec(f"model_specs/{spec}.yaml"), phase))
            for nid, data in G.nodes(data=True):
                if data["op"] == "moe_route":
                    for launch in lower(G, nid, "bf16"):
                        seen.setdefault(launch.name, launch)
    return [seen[k] for k in sorted(seen)]


@pytest.mark.slow
def test_route_of_shipped_specs_compiles_without_spills():
    """Every route kernel of the shipped specs builds for sm_90 with no spills; where cuobjdump is
    installed, each waits for the previous kernel and lets the next one launch (PDL: griddepcontrol
    is ACQBULK / PREEXIT in SASS), and the fused one takes its tickets with acquire-release global
    atomics (MEMBAR.ALL.GPU, no fence.sc's MEMBAR.SC.GPU: tickets.cuh) and reads
    the logits and ids that other CTAs wrote past L1 (LDG.E.STRONG.GPU, not the read-only path); the
    router GEMM is fp32 FFMA fed by 16-byte shared loads, with the same tickets for its split of D."""
    _nvrtc_or_skip()
    from codegen.nvrtc import compile_cubin
    from sass import cuobjdump, opcodes
    launches = _route_launches_of_shipped_specs()
    assert sum(la.stage == "fused" for la in launches) == 3       # V2-Lite, V2, V3
    assert sum(la.stage == "router_gemm" for la in launches) == 3
    for launch in launches:
        res = compile_cubin(render_launch(launch), launch.name, arch="sm_90", options=("--ptxas-options=-v",))
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, (launch.name, res.log)
        if cuobjdump() is None:
            continue
        ops = opcodes(res.cubin)
        assert ops["ACQBULK"] >= 1 and ops["PREEXIT"] >= 1, (launch.name, "PDL wait / launch_dependents")
        if launch.stage == "fused":
            assert ops["ATOMG.E.ADD.STRONG.GPU"] == 2 and ops["MEMBAR.ALL.GPU"] >= 2, launch.name
            assert ops["MEMBAR.SC.GPU"] == 0 and ops["ATOMG.E.EXCH.STRONG.GPU"] == 0, launch.name
            assert ops["LDG.E.STRONG.GPU"] >= 2, launch.name
        if launch.stage == "router_gemm":
            # fp32 FMAs on CUDA cores, never tensor cores (TF32 would move the logits' near-ties);
            # per stage BK * TM * TN of them against BK / 4 * (TM + TN) 16-byte shared loads, in
            # both instantiations (16-byte staging, and element staging for misaligned bases)
            p = launch.params
            assert not [op for op in ops if op.startswith(("HMMA", "HGMMA"))], launch.name
            assert ops["FFMA"] >= 2 * p["bk"] * p["tm"] * p["tn"], (launch.name, ops["FFMA"])
            assert ops["LDS.128"] >= 2 * p["bk"] // 4 * (p["tm"] + p["tn"]), (launch.name, ops["LDS.128"])
            assert ops["LDG.E.128"] >= 1 and ops["STS.128"] >= 1, launch.name      # x: 16-byte loads, stores
            # the split of D: tickets, and the other splits' partials read past L1
            assert ops["ATOMG.E.ADD.STRONG.GPU"] == 2 and ops["LDG.E.128.STRONG.GPU"] >= 2, launch.name
