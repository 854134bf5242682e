"""gemm_fp8 on the CPU: which kernel serves an FP8 linear at which T (the dispatch rows and the launches'
token ranges), what the launches bind (the quantiser's workspaces, the weight's tensor map and scale
companion), where the dequantising library call is left (no sm_90a, K % 16 != 0), and the machine code
NVRTC makes for sm_90a: the FP8 wgmma (QGMMA ... E4M3.E4M3: SASS's name for wgmma .e4m3), weight boxes by
TMA, no spills, the quantiser's saturating e4m3 conversion; at decode batches the split of K (grid,
the kernel's `splits`, the partials workspace at several T) and its ticket in the SASS."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, opcodes  # noqa: E402
from test_linear_fp8 import _node  # noqa: E402

from codegen import dispatch, sizes  # noqa: E402
from codegen.arch import kernel_target  # noqa: E402
from codegen.families import _gemm_split as gemm_split  # noqa: E402
from codegen.families import gemm_fp8, linear_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, LibraryCall, Options, TensorMapRef, WeightRef, WorkspaceRef  # noqa: E402
from codegen.tuning import LinearTuning, MoeTuning, Tuning  # noqa: E402
from ir.formats import FP8  # noqa: E402

# every FP8 x FP8 GEMM with its own quantiser launch (the norms' rows, on by default, have their own tests)
# the FP8 x FP8 GEMM from T = 17: the skinny kernel's 16-token chunks (on at 64 by default) off; its plain K loop
# (moe.fp8_overlap, on by default, has its own tests below)
# (gemm_weights_early and gemm_split_min_kb, on by default, have their tests in test_gemm_early.py and below)
PLAIN = dict(fp8_chunks_upto=0, gemm_weights_early=False, gemm_split_min_kb=1)
GEMM_FROM_17 = Tuning(linear=LinearTuning(**PLAIN), moe=MoeTuning(fp8_overlap=False))
NO_NORM_ROWS = Tuning(linear=LinearTuning(norm_fp8=False, **PLAIN), moe=MoeTuning(fp8_overlap=False))

FIRST = linear_skinny.SKINNY_MAX_TOKENS + 1


def _running(steps, T):
    env = {"T": T, "SMS": 132}
    return [s.stage for s in steps if isinstance(s, KernelLaunch) and all(sizes.evaluate(g, env) > 0 for g in s.grid)]


@pytest.mark.parametrize("op", ["linear", "multi_linear", "gate_up_silu"])
def test_above_the_skinny_range_the_quantiser_and_the_fp8_gemm_run(op):
    G, nid = _node(op, (FP8.name, FP8.name))
    steps = linear_skinny.lower(nid, G, Options(tuning=GEMM_FROM_17))
    assert not any(isinstance(s, LibraryCall) for s in steps)
    gemms = 2 if op == "multi_linear" else 1
    assert [s.stage for s in steps] == [op, "quant_x", *["fp8_wgmma"] * gemms]
    for T in (1, 16):
        assert _running(steps, T) == [op]
    for T in (FIRST, 128, 16384):
        assert _running(steps, T) == ["quant_x", *["fp8_wgmma"] * gemms]
    quant, *launches = steps[1:]
    assert quant.name == "gemm_fp8__bf16__k2048__quant_x" and quant.grid[0].startswith("cdiv(T * 16, 8)")
    ws = {w.name: (w.shape, w.dtype) for w in quant.workspace}
    assert ws == {gemm_fp8.XQ: (("T", 512), "i32"), gemm_fp8.XS: (("T", 16), "f32")}
    for la in launches:
        assert la.requires == ("sm_90a",) and la.smem == gemm_fp8.smem(gemm_fp8.STAGES) <= 227 * 1024
        assert {w.name for w in la.workspace} == set(ws) | {gemm_fp8.PARTIALS}
        refs = {a.name: a.ref for a in la.args}
        assert refs["xq"] == WorkspaceRef(gemm_fp8.XQ) and refs["xs"] == WorkspaceRef(gemm_fp8.XS)
    if op == "gate_up_silu":
        (la,) = launches
        refs = {a.name: a.ref for a in la.args}
        assert la.name == "gemm_fp8__bf16_wfp8__k2048__silu10944" and la.params["cols"] == 64
        assert refs["wg"] == TensorMapRef("g", (64, 128), 128) and refs["wu"] == TensorMapRef("u", (64, 128), 128)
        assert refs["sg"] == WeightRef("g_scale_inv") and refs["su"] == WeightRef("u_scale_inv")
        assert sizes.evaluate(la.grid[0], {"T": 300, "SMS": 132}) == min(132, 3 * 171)
    elif op == "multi_linear":
        assert [la.name for la in launches] == ["gemm_fp8__bf16_wfp8__k2048__o3072", "gemm_fp8__bf16_wfp8__k2048__o576"]
        assert [{a.name: a.ref for a in la.args}["sw"] for la in launches] == [WeightRef("q_scale_inv"),
                                                                              WeightRef("kv_a_scale_inv")]
        # kv_a's 576 rows: 5 column tiles (the last one 64 rows, a ceil scale block), K split 8 ways
        assert sizes.evaluate(launches[1].grid[0], {"T": 17, "SMS": 132}) == 5 * 8


def _geometry(la, T, sms=132):
    """(grid, the kernel's splits, partial rows of the node's workspace) of a GEMM launch at T."""
    env = {"T": T, "SMS": sms}
    (S,) = [a.ref.expr for a in la.args if a.name == "splits"]
    (partials,) = [w for w in la.workspace if w.name == gemm_fp8.PARTIALS]
    assert partials.shape[1] == gemm_split.PARTIAL_WORDS and partials.dtype == "f32"
    return sizes.evaluate(la.grid[0], env), sizes.evaluate(S, env), sizes.evaluate(partials.shape[0], env)


@pytest.mark.parametrize("op", ["linear", "multi_linear", "gate_up_silu"])
def test_at_decode_batches_k_splits_until_the_tiles_fill_the_sms(op):
    """V2-Lite's linears at decode batches: where the tiles are fewer than half the SMs the grid is
    tiles x splits (splits = SMS // tiles, at most SPLIT_MAX and one K block each) and the kernel's
    `splits` argument is the same number; from there on one CTA a tile (a persistent walk past the SM
    count), splits 1 and no partials.  The node's one partials workspace holds the largest GEMM's."""
    G, nid = _node(op, (FP8.name, FP8.name))
    launches = [s for s in linear_skinny.lower(nid, G, Options(tuning=GEMM_FROM_17)) if s.stage == "fp8_wgmma"]
    # (tiles at T <= 128, weight rows) per GEMM: q 3072 / 128, kv_a 576 (a 64-row ceil tile), o_proj
    # 2048, gate_up_silu's 10944 output columns in 64-column tiles
    tiles = {"multi_linear": [24, 5], "linear": [16], "gate_up_silu": [171]}[op]
    for T in (FIRST, 32, 64, 128, 129, 256, 257, 1000, 16384):
        rows = []
        for la, n in zip(launches, tiles):
            t = -(-T // 128) * n
            S = max(1, min(gemm_split.SPLIT_MAX, 16, 132 // t))
            grid, splits, partial_rows = _geometry(la, T)
            assert splits == S and grid == (t * S if S > 1 else min(132, t)), (la.name, T, grid, splits)
            rows.append(t * S if S > 1 else 0)
        assert partial_rows == max(rows), (T, partial_rows, rows)
    split = {la.name: _geometry(la, 32)[1] for la in launches}
    assert {"multi_linear": {"gemm_fp8__bf16_wfp8__k2048__o3072": 5, "gemm_fp8__bf16_wfp8__k2048__o576": 8},
            "linear": {"gemm_fp8__bf16_wfp8__k2048__o2048": 8},
            "gate_up_silu": {"gemm_fp8__bf16_wfp8__k2048__silu10944": 1}}[op] == split
    # more SMs than tickets: the tiles bound the split at TICKETS
    for la, n in zip(launches, tiles):
        grid, splits, _ = _geometry(la, 16384, sms=4096)
        t = 128 * n
        S = max(1, min(gemm_split.SPLIT_MAX, 16, gemm_split.TICKETS // t))
        assert splits == S and grid == (t * S if S > 1 else min(4096, t))


@pytest.mark.parametrize("min_kb", [2, 4, 8])
def test_the_split_keeps_gemm_split_min_kb_blocks_each(min_kb):
    """Tuning.linear.gemm_split_min_kb caps the splits at KB // min_kb (V2-Lite's K = 2048: 16 blocks), so
    the tile's last CTA sums fewer partials; a K of fewer blocks than min_kb is not split; the grid, the
    kernel's `splits` and the partials workspace follow; the kernels themselves are the knob-off ones."""
    tuning = Tuning(linear=LinearTuning(**{**PLAIN, "gemm_split_min_kb": min_kb}), moe=MoeTuning(fp8_overlap=False))
    G, nid = _node("multi_linear", (FP8.name, FP8.name))
    off = [s for s in linear_skinny.lower(nid, G, Options(tuning=GEMM_FROM_17)) if s.stage == "fp8_wgmma"]
    on = [s for s in linear_skinny.lower(nid, G, Options(tuning=tuning)) if s.stage == "fp8_wgmma"]
    assert [la.name for la in on] == [la.name for la in off] and [la.params for la in on] == [la.params for la in off]
    cap = 16 // min_kb
    for T in (FIRST, 32, 128, 129, 256):
        rows = []
        for la, n in zip(on, (24, 5)):                       # q's and kv_a's tiles at T <= 128
            t = -(-T // 128) * n
            S = max(1, min(cap, 132 // t))
            grid, splits, partial_rows = _geometry(la, T)
            assert splits == S and grid == (t * S if S > 1 else min(132, t)), (la.name, T, min_kb, grid, splits)
            rows.append(t * S if S > 1 else 0)
        assert partial_rows == max(rows)
    G, nid = _node("linear", (FP8.name,), K=256)             # two K blocks: split only where min_kb allows
    (la,) = [s for s in linear_skinny.lower(nid, G, Options(tuning=tuning)) if s.stage == "fp8_wgmma"]
    assert _geometry(la, 32)[1] == (2 if min_kb == 1 else 1)


def test_a_short_k_splits_at_most_once_a_block():
    G, nid = _node("linear", (FP8.name,), K=256)             # two K blocks
    (la,) = [s for s in linear_skinny.lower(nid, G, Options(tuning=GEMM_FROM_17)) if s.stage == "fp8_wgmma"]
    assert _geometry(la, 32) == (16 * 2, 2, 16 * 2)
    G, nid = _node("linear", (FP8.name,), K=112)             # one (ceil) K block: never split
    (la,) = [s for s in linear_skinny.lower(nid, G, Options(tuning=GEMM_FROM_17)) if s.stage == "fp8_wgmma"]
    assert _geometry(la, 32) == (16, 1, 0)


def test_the_dequantising_library_call_stays_where_the_fp8_gemm_cannot_run():
    G, nid = _node("linear", (FP8.name,))
    for opts in (Options(arch="sm_80", tuning=GEMM_FROM_17), Options(arch="sm_89", tuning=GEMM_FROM_17)):
        (call,) = [s for s in linear_skinny.lower(nid, G, opts) if isinstance(s, LibraryCall)]
        assert call.from_tokens == FIRST and call.attrs["weight_format"] == FP8.name
    G, nid = _node("linear", (FP8.name,), K=300)            # not whole 16-byte chunks
    (call,) = [s for s in linear_skinny.lower(nid, G, Options(tuning=GEMM_FROM_17)) if isinstance(s, LibraryCall)]
    assert call.attrs["weight_format"] == FP8.name
    G, nid = _node("linear", (None,))                      # bf16 weights: cuBLAS as before
    assert not any(s.family == gemm_fp8.FAMILY for s in linear_skinny.lower(nid, G, Options(tuning=GEMM_FROM_17))
                   if isinstance(s, KernelLaunch))


def test_without_the_skinny_kernel_the_fp8_gemm_serves_every_t():
    from codegen.tuning import LinearTuning, Tuning
    G, nid = _node("linear", (FP8.name,))
    steps = linear_skinny.lower(nid, G, Options(tuning=Tuning(linear=LinearTuning(skinny_upto=0))))
    assert [s.stage for s in steps] == ["quant_x", "fp8_wgmma"] and _running(steps, 1) == ["quant_x", "fp8_wgmma"]


def test_the_dispatch_row_names_the_fp8_gemm():
    facts = {"precision": "act", "weight_format": FP8.name, "sm_90a": True, "fp8_rows": True, "fp8_fits": True}
    row = dispatch.select("linear", FIRST, facts, GEMM_FROM_17)
    assert row.variant == "fp8_wgmma" and "promotion per 128-K block" in row.reason and row.span == f"{FIRST}..inf"


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op, K, dtype", [("multi_linear", 2048, "bf16"), ("gate_up_silu", 2048, "bf16"),
                                          ("linear", 10944, "fp16")])
def test_the_fp8_gemm_compiles_to_fp8_wgmma_without_spills(op, K, dtype):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    G, nid = _node(op, (FP8.name, FP8.name), K=K)
    quant, *launches = [s for s in linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=GEMM_FROM_17)) if isinstance(s, KernelLaunch)
                        and s.family == gemm_fp8.FAMILY]
    for la in launches:
        res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                            options=("--ptxas-options=-v",))
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        ops = opcodes(res.cubin)
        assert ops["QGMMA.64x128x32.F32.E4M3.E4M3"] == 4, sorted(ops)     # one K block: 4 x k32
        assert ops["UTMALDG.2D"] == 2 and ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0, sorted(ops)
        assert not any(o.startswith("HGMMA") for o in ops), "the product runs on FP8 operands, not widened ones"
        # split K: the tile's ticket (one acquire-release add) and the partials past L1 (16-byte .cg
        # stores and loads, 16 a thread each)
        assert ops["ATOMG.E.ADD.STRONG.GPU"] == 1, sorted(ops)
        assert ops["STG.E.128.STRONG.GPU"] == 16 and ops["LDG.E.128.STRONG.GPU"] == 16, sorted(ops)
    res = compile_cubin(render_launch(quant), quant.name, options=("--ptxas-options=-v",))
    assert "0 bytes spill" in res.log
    assert opcodes(res.cubin)["F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C"] == 2


def test_a_spec_with_fp8_linears_plans_the_quantiser_and_the_gemm_with_their_workspaces():
    """The tiny config's attention linears and dense MLP in FP8 (its experts and kv_b stay bf16): in the prefill
    plan every FP8 linear node runs the skinny kernel, then the quantiser and the GEMM, its workspaces
    placed in the arena over that node alone; the plan survives the manifest's JSON."""
    import json
    from pathlib import Path

    import ir
    from codegen.bundle import plan_spec
    from codegen.manifest import phase_from_json, phase_to_json
    from codegen.memplan import workspace_slot
    from ir.config_to_spec import spec_from_config
    from ir.formats import weight_formats_yaml
    root = Path(__file__).resolve().parents[2]
    tiny = json.loads((root / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    globs = ("model.layers.*.self_attn.q*_proj.weight", "model.layers.*.self_attn.kv_a_proj_with_mqa.weight",
             "model.layers.*.self_attn.o_proj.weight", "model.layers.0.mlp.*_proj.weight")   # not kv_b: attention's
    spec = ir.load_spec(spec_from_config(tiny, name="tiny") + "\n" + weight_formats_yaml(globs, FP8), file="t.yaml")
    plan = plan_spec(spec, Options(tuning=NO_NORM_ROWS)).plans["prefill"]
    fp8_nodes = {la.nodes[0] for la in plan.launches if la.family == linear_skinny.FAMILY and "_wfp8" in la.name}
    assert len(fp8_nodes) >= 4                    # q / kv_a, o_proj per layer, the dense gate_up and down
    for nid in fp8_nodes:
        stages = [la.stage for la in plan.launches if la.nodes[0] == nid]
        assert stages[1:2] == ["quant_x"] and set(stages[2:]) == {"fp8_wgmma"}, (nid, stages)
        slots = {s.name: s for s in plan.arena}
        for ws in (gemm_fp8.XQ, gemm_fp8.XS):
            s = slots[workspace_slot(nid, ws)]
            assert s.first == s.last, (nid, s)     # alive during its node only
    assert not [c for c in plan.library_calls if c.attrs.get("weight_format") == FP8.name]
    back = phase_from_json("prefill", json.loads(json.dumps(phase_to_json(plan))))
    assert [s.name for s in back.launches] == [s.name for s in plan.launches]
    assert [s.workspace for s in back.launches] == [s.workspace for s in plan.launches]


def test_the_family_lowers_one_node_alone_at_every_t_and_says_what_it_cannot_serve():
    from codegen.errors import LoweringError
    G, nid = _node("gate_up_silu", (FP8.name, FP8.name))
    steps = gemm_fp8.lower(nid, G, Options(tuning=GEMM_FROM_17))
    assert [s.stage for s in steps] == ["quant_x", "fp8_wgmma"] and _running(steps, 1) == ["quant_x", "fp8_wgmma"]
    assert [s.name for s in steps] == [s.name for s in linear_skinny.lower(nid, G, Options(tuning=GEMM_FROM_17))[1:]]
    G, nid = _node("linear", (None,), K=300)
    with pytest.raises(LoweringError, match="gemm_fp8 cannot serve linear .*: o is bf16; K = 300 is not a multiple "
                                            "of 16; target sm_80 lacks sm_90a"):
        gemm_fp8.lower(nid, G, Options(arch="sm_80"))


def test_explain_shows_the_fp8_gemm_above_the_skinny_range(capsys, tmp_path):
    import json
    from pathlib import Path

    from ir.config_to_spec import spec_from_config
    from ir.formats import weight_formats_yaml
    from runtime.cli import main
    root = Path(__file__).resolve().parents[2]
    tiny = json.loads((root / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    spec = tmp_path / "tiny_fp8.yaml"
    spec.write_text(spec_from_config(tiny, name="tiny") + "\n"
                    + weight_formats_yaml(("model.layers.*.self_attn.o_proj.weight",), FP8))
    assert main(["explain", str(spec), "--tokens", "16,17", "--phase", "prefill", "--tune", "linear.fp8_chunks_upto=0"]) == 0
    out = capsys.readouterr().out
    at16, at17 = out.split("prefill, T = 16 ", 1)[1].split("prefill, T = 17 ", 1)
    assert "linear_skinny__bf16_wfp8__k128__o128" in at16 and "gemm_fp8" not in at16
    assert "gemm_fp8__bf16__k128__quant_x, gemm_fp8__bf16_wfp8__k128__o128" in at17
    assert f"fp8_wgmma [tokens {FIRST}..inf]: FP8 x FP8 wgmma + TMA" in at17


# the dense GEMMs' other name part, ew (linear.gemm_weights_early, on by default), off: the names end in ovl or not
OVERLAP = Tuning(moe=MoeTuning(fp8_overlap=True), linear=LinearTuning(gemm_weights_early=False))
NO_OVERLAP = Tuning(moe=MoeTuning(fp8_overlap=False), linear=LinearTuning(gemm_weights_early=False))


@pytest.mark.parametrize("op", ["multi_linear", "gate_up_silu", "linear"])
def test_fp8_overlap_reaches_the_gemms_only_when_on(op):
    """moe.fp8_overlap covers gemm_fp8 too: off, the GEMMs' names, parameters and source as without the knob;
    on, name part ovl, parameter `overlap` and the template's OVL argument, nothing else changed (the
    quantiser's launch neither)."""
    from codegen.render import render_launch
    G, nid = _node(op, (FP8.name, FP8.name), K=2048)
    off, on = ([s for s in linear_skinny.lower(nid, G, Options(tuning=t)) if isinstance(s, KernelLaunch)
                and s.family == gemm_fp8.FAMILY] for t in (NO_OVERLAP, OVERLAP))
    assert on[0].name == off[0].name and on[0].params == off[0].params and len(on) == len(off) > 1
    for a, b in zip(off[1:], on[1:]):
        assert "overlap" not in a.params and not a.name.endswith("__ovl") and ", true>(" not in render_launch(a)
        assert b.name == a.name + "__ovl" and b.params == {**a.params, "overlap": True}
        assert (b.grid, b.block, b.smem, b.args, b.workspace) == (a.grid, a.block, a.smem, a.args, a.workspace)
        assert render_launch(b).count(", true>(") == 1


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op, K", [("multi_linear", 2048), ("gate_up_silu", 2048), ("linear", 10944)])
def test_fp8_overlap_gemm_compiles_without_spills_or_serialised_wgmma(op, K):
    """moe.fp8_overlap on gemm_fp8 (split K included) for sm_90a: acc + two fp32 tiles without spills, no
    serialised wgmma (C7514) or injected wait (C7517), one group left in flight (WARPGROUP.DEPBAR.LE gsb0, 0x1)."""
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    from sass import instructions
    G, nid = _node(op, (FP8.name, FP8.name), K=K)
    launches = [s for s in linear_skinny.lower(nid, G, Options(tuning=OVERLAP)) if isinstance(s, KernelLaunch)
                and s.family == gemm_fp8.FAMILY and s.stage == "fp8_wgmma"]
    for la in launches:
        res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                            options=("--ptxas-options=-v",))
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        assert "C7514" not in res.log and "C7517" not in res.log, res.log
        (body,) = instructions(res.cubin).values()
        assert {i.operands.split(",")[-1].strip() for i in body if i.opcode == "WARPGROUP.DEPBAR.LE"} == {"0x0", "0x1"}
