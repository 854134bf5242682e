"""gemm_int8 on the CPU: which kernel serves an int8 linear at which T (the dispatch rows and the launches'
token ranges), what the launches bind (the quantiser's workspaces, the weight's tensor map and scale
companion), where the exact library call is left (no sm_90a, K % 16 != 0, K >= 2^17), and the machine code
NVRTC makes for sm_90a: the int8 wgmma (IGMMA ... S8.S8: SASS's name for wgmma .s32.s8.s8), weight boxes by
TMA, no spills, the epilogue's int -> float and two separate multiplies, the quantiser's correctly rounded
division; at decode batches the split of K (grid, the kernel's `splits`, the int32 partials workspace at
several T and SM counts) and its ticket and partial stores in the SASS."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, opcodes  # noqa: E402
from test_linear_int8 import I8, _int8_spec_text, _node  # noqa: E402

from codegen import dispatch, sizes  # noqa: E402
from codegen.arch import kernel_target  # noqa: E402
from codegen.errors import LoweringError  # noqa: E402
from codegen.families import _gemm_split as gemm_split  # noqa: E402
from codegen.families import gemm_int8, linear_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, LibraryCall, Options, TensorMapRef, WeightRef, WorkspaceRef  # noqa: E402
from codegen.tuning import LinearTuning, Tuning  # noqa: E402

FIRST = linear_skinny.SKINNY_MAX_TOKENS + 1
# the int8 readers' own quantiser launches (the prologue and the norms' rows have their own tests)
# ... and gemm_int8 from 17 tokens: the skinny kernel's 16-token chunks (on at 32 by default) off; the knob-off
# GEMMs (gemm_weights_early and gemm_split_min_kb, on by default, have their tests in test_gemm_early.py and below)
QUANT = Tuning(linear=LinearTuning(i8_prologue_upto=0, norm_int8=False, i8_chunks_upto=0, gemm_weights_early=False,
                                    gemm_split_min_kb=1))


def _running(steps, T):
    env = {"T": T, "SMS": 132}
    return [s.stage for s in steps if isinstance(s, KernelLaunch) and all(sizes.evaluate(g, env) > 0 for g in s.grid)]


@pytest.mark.parametrize("op", ["linear", "multi_linear", "gate_up_silu"])
def test_above_the_skinny_range_the_quantiser_and_the_int8_gemm_run(op):
    G, nid = _node(op, (I8, I8))
    steps = linear_skinny.lower(nid, G, Options(tuning=QUANT))
    assert not any(isinstance(s, LibraryCall) for s in steps)
    gemms = 2 if op == "multi_linear" else 1
    assert [s.stage for s in steps] == ["quant_int8", op, "quant_i8", *["i8_wgmma"] * gemms]
    for T in (1, 2, 16):
        assert _running(steps, T) == ["quant_int8", op]
    for T in (FIRST, 128, 129, 16384):
        assert _running(steps, T) == ["quant_i8", *["i8_wgmma"] * gemms]
    quant, *launches = steps[2:]
    assert quant.name == "gemm_int8__bf16__k2048__quant_i8" and quant.grid[0] == "T * min(1, T // 17)"
    assert quant.params["qrow"] == 2048 and quant.params["wfmt"] == I8
    ws = {w.name: (w.shape, w.dtype) for w in quant.workspace}
    assert ws == {gemm_int8.XQ: (("T", 512), "i32"), gemm_int8.XS: (("T",), "f32")}
    qrefs = {a.name: (a.ctype, a.ref) for a in quant.args}
    assert qrefs["q"] == ("signed char*", WorkspaceRef(gemm_int8.XQ))
    assert qrefs["s"] == ("float*", WorkspaceRef(gemm_int8.XS))
    for la in launches:
        assert la.requires == ("sm_90a",) and la.smem == gemm_int8.smem(gemm_int8.STAGES) <= 227 * 1024
        assert {w.name for w in la.workspace} == {*ws, gemm_int8.PARTIALS} and la.params["wfmt"] == I8
        refs = {a.name: (a.ctype, a.ref) for a in la.args}
        assert refs["xq"] == ("const signed char*", WorkspaceRef(gemm_int8.XQ))
        assert refs["xs"] == ("const float*", WorkspaceRef(gemm_int8.XS))
        assert refs["partials"] == ("int*", WorkspaceRef(gemm_int8.PARTIALS))
    if op == "gate_up_silu":
        (la,) = launches
        refs = {a.name: a.ref for a in la.args}
        assert la.name == "gemm_int8__bf16_wi8__k2048__silu10944" and la.params["cols"] == 64
        assert refs["wg"] == TensorMapRef("g", (64, 128), 128) and refs["wu"] == TensorMapRef("u", (64, 128), 128)
        assert refs["sg"] == WeightRef("g_scale") and refs["su"] == WeightRef("u_scale")
        assert sizes.evaluate(la.grid[0], {"T": 300, "SMS": 132}) == min(132, 3 * 171)
    elif op == "multi_linear":
        assert [la.name for la in launches] == ["gemm_int8__bf16_wi8__k2048__o3072", "gemm_int8__bf16_wi8__k2048__o576"]
        assert [{a.name: a.ref for a in la.args}["sw"] for la in launches] == [WeightRef("q_scale"),
                                                                              WeightRef("kv_a_scale")]
        assert {a.name: a.ref for a in launches[0].args}["w"] == TensorMapRef("q", (64, 128), 128)
        # kv_a's 576 rows: 5 column tiles (the last one 64 rows); at 17 tokens fewer tiles than SMs: K split 8 ways
        assert sizes.evaluate(launches[1].grid[0], {"T": FIRST, "SMS": 132}) == 5 * 8
        assert sizes.evaluate(launches[0].grid[0], {"T": 512, "SMS": 132}) == 96


def _geometry(la, T, sms=132):
    """(grid, the kernel's splits, partial rows of the node's workspace) of a GEMM launch at T."""
    env = {"T": T, "SMS": sms}
    (S,) = [a.ref.expr for a in la.args if a.name == "splits"]
    (partials,) = [w for w in la.workspace if w.name == gemm_int8.PARTIALS]
    assert partials.shape[1] == gemm_split.PARTIAL_WORDS and partials.dtype == "i32"
    return sizes.evaluate(la.grid[0], env), sizes.evaluate(S, env), sizes.evaluate(partials.shape[0], env)


@pytest.mark.parametrize("op", ["linear", "multi_linear", "gate_up_silu"])
def test_at_decode_batches_k_splits_until_the_tiles_fill_the_sms(op):
    """V2-Lite's int8 linears at decode batches: where the tiles are fewer than half the SMs the grid is
    tiles x splits (splits = SMS // tiles, at most SPLIT_MAX and one 128-byte K stage each) and the
    kernel's `splits` argument is the same number; from there on one CTA a tile (a persistent walk past
    the SM count), splits 1 and no partials.  The node's one int32 partials workspace holds the largest
    GEMM's.  The same at an H200-like 132 SMs, a smaller part's 78 and a large one's 170."""
    G, nid = _node(op, (I8, I8))
    launches = [s for s in linear_skinny.lower(nid, G, Options(tuning=QUANT)) if s.stage == "i8_wgmma"]
    # (tiles at T <= 128) per GEMM: q 3072 / 128, kv_a 576 (a 64-row ceil tile), o_proj 2048,
    # gate_up_silu's 10944 output columns in 64-column tiles
    tiles = {"multi_linear": [24, 5], "linear": [16], "gate_up_silu": [171]}[op]
    for sms in (132, 78, 170):
        for T in (FIRST, 32, 64, 128, 129, 256, 257, 1000, 16384):
            rows = []
            for la, n in zip(launches, tiles):
                t = -(-T // 128) * n
                S = max(1, min(gemm_split.SPLIT_MAX, 16, sms // t))
                grid, splits, partial_rows = _geometry(la, T, sms)
                assert splits == S and grid == (t * S if S > 1 else min(sms, t)), (la.name, T, sms, grid, splits)
                rows.append(t * S if S > 1 else 0)
            assert partial_rows == max(rows), (T, sms, partial_rows, rows)
    split = {la.name: _geometry(la, 32)[1] for la in launches}
    assert {"multi_linear": {"gemm_int8__bf16_wi8__k2048__o3072": 5, "gemm_int8__bf16_wi8__k2048__o576": 8},
            "linear": {"gemm_int8__bf16_wi8__k2048__o2048": 8},
            "gate_up_silu": {"gemm_int8__bf16_wi8__k2048__silu10944": 1}}[op] == split
    # more SMs than tickets: the tiles bound the split at TICKETS
    for la, n in zip(launches, tiles):
        grid, splits, _ = _geometry(la, 16384, sms=4096)
        t = 128 * n
        S = max(1, min(gemm_split.SPLIT_MAX, 16, gemm_split.TICKETS // t))
        assert splits == S and grid == (t * S if S > 1 else min(4096, t))


def test_the_split_keeps_gemm_split_min_kb_stages_each():
    """Tuning.linear.gemm_split_min_kb reaches the int8 GEMM as the FP8 one (test_gemm_fp8 has the cases):
    o_proj's 16 K stages split at most 4 ways at 4 stages a split, 2 at 8."""
    G, nid = _node("linear", (I8,))
    for min_kb, S in ((1, 8), (4, 4), (8, 2)):
        tuning = Tuning(linear=LinearTuning(i8_prologue_upto=0, norm_int8=False, i8_chunks_upto=0,
                                            gemm_weights_early=False, gemm_split_min_kb=min_kb))
        (la,) = [s for s in linear_skinny.lower(nid, G, Options(tuning=tuning)) if s.stage == "i8_wgmma"]
        assert _geometry(la, 32) == (16 * S, S, 16 * S), (min_kb, _geometry(la, 32))


def test_a_short_k_splits_at_most_once_a_stage():
    G, nid = _node("linear", (I8,), K=256)                  # two 128-byte K stages
    (la,) = [s for s in linear_skinny.lower(nid, G, Options(tuning=QUANT)) if s.stage == "i8_wgmma"]
    assert _geometry(la, 32) == (16 * 2, 2, 16 * 2)
    G, nid = _node("linear", (I8,), K=112)                  # one (partial) K stage: never split
    (la,) = [s for s in linear_skinny.lower(nid, G, Options(tuning=QUANT)) if s.stage == "i8_wgmma"]
    assert _geometry(la, 32) == (16, 1, 0)


def test_the_split_shares_the_fp8_gemms_expressions():
    """One split rule for both GEMMs: the int8 and FP8 launches of the same shape get the same grid and
    splits (one fact in one place: codegen/families/_gemm_split.py)."""
    from codegen.families import gemm_fp8
    assert gemm_int8.BM == gemm_fp8.BM and gemm_int8.BN == gemm_fp8.BN and gemm_int8.BK == gemm_fp8.BK
    assert gemm_int8.grid is gemm_fp8.grid is gemm_split.grid
    assert gemm_int8.splits is gemm_fp8.splits is gemm_split.splits


@pytest.mark.parametrize("opts, K, why", [(Options(arch="sm_89"), 2048, "no sm_90a"),
                                          (Options(arch="sm_80"), 2048, "no sm_90a"),
                                          (Options(tuning=QUANT), 1001, "K % 16 != 0: no tensor map of the weight"),
                                          (Options(tuning=QUANT), 2056, "K % 16 != 0"),
                                          (Options(tuning=QUANT), 1 << 17, "int32 sums could overflow")])
def test_the_exact_library_call_stays_where_the_int8_gemm_cannot_run(opts, K, why):
    G, nid = _node("linear", (I8,), K=K)
    steps = linear_skinny.lower(nid, G, opts)
    (call,) = [s for s in steps if isinstance(s, LibraryCall)]
    assert call.from_tokens == FIRST and call.attrs["weight_format"] == I8, why
    assert not [s for s in steps if isinstance(s, KernelLaunch) and s.family == gemm_int8.FAMILY], why


def test_the_dispatch_facts_follow_the_shape_rules():
    assert gemm_int8.serves(16) and gemm_int8.serves(2048) and gemm_int8.serves(131056)
    assert not gemm_int8.serves(1001) and not gemm_int8.serves(8) and not gemm_int8.serves(1 << 17)
    assert gemm_int8.fits(Options(tuning=QUANT)) and not gemm_int8.fits(Options(arch="sm_80"))
    facts = {"precision": "act", "weight_format": I8, "dtype": "fp16", "sm_90a": True, "i8_rows": True,
             "i8_fits": True}
    assert [(r.variant, r.span) for r in dispatch.rows("gate_up_silu", facts, QUANT)] == \
        [("skinny_wi8", "1..16"), ("i8_wgmma", "17..inf")]
    assert [(r.variant, r.span) for r in dispatch.rows("gate_up_silu", facts)] == \
        [("skinny_wi8", "1..16"), ("skinny_wi8_chunks", "17..32"), ("i8_wgmma", "33..inf")]   # the default chunks
    assert dispatch.select("linear", 1, {**facts, "dtype": "fp32"}).variant == dispatch.NONE


def test_without_the_skinny_kernel_the_int8_gemm_serves_every_t():
    G, nid = _node("linear", (I8,))
    steps = linear_skinny.lower(nid, G, Options(tuning=Tuning(linear=LinearTuning(skinny_upto=0))))
    assert [s.stage for s in steps] == ["quant_i8", "i8_wgmma"]
    assert _running(steps, 1) == _running(steps, 5000) == ["quant_i8", "i8_wgmma"]
    assert steps[1].params["lo"] == 1


def test_the_family_lowers_one_node_alone_at_every_t_and_says_what_it_cannot_serve():
    G, nid = _node("gate_up_silu", (I8, I8))
    quant, gemm = gemm_int8.lower(nid, G, Options(tuning=QUANT))
    assert quant.grid[0] == "T" and gemm.grid[0] == gemm_split.grid(10944, 2048, True)
    assert sizes.evaluate(gemm.grid[0], {"T": 300, "SMS": 132}) == 132
    G, nid = _node("linear", (None,), K=1001)
    with pytest.raises(LoweringError) as info:
        gemm_int8.lower(nid, G, Options(dtype="fp32", arch="sm_89"))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("gemm_int8 cannot serve linear")
    for part in ("o is fp32", "activations are fp32", "K = 1001 is not a multiple of 16", "lacks sm_90a"):
        assert part in msg, (part, msg)


def test_int8_weights_get_byte_tensor_maps():
    """The launcher encodes the weight's map from its torch dtype: int8 weights as bytes (TMA copies them
    unchanged and fills zeros out of bounds)."""
    import torch
    from runtime.cuda_driver import _TMA_DTYPES, tiled_map_params
    assert _TMA_DTYPES[torch.int8] == "CU_TENSOR_MAP_DATA_TYPE_UINT8"
    p = tiled_map_params((576, 2064), (2064, 1), 1, 1 << 20, (64, 128), 128)
    assert p.dims == (2064, 576) and p.strides == (2064,) and p.box == (128, 64)


def test_a_spec_with_int8_linears_plans_the_gemm_workspaces_over_its_node_alone():
    import json

    import ir
    from codegen.bundle import plan_spec
    from codegen.manifest import phase_from_json, phase_to_json
    from codegen.memplan import workspace_slot
    spec = ir.load_spec(_int8_spec_text(), file="t.yaml")
    plan = plan_spec(spec, Options(tuning=QUANT)).plans["prefill"]
    nodes = {la.nodes[0] for la in plan.launches if la.family == gemm_int8.FAMILY}
    assert len(nodes) >= 4
    slots = {s.name: s for s in plan.arena}
    for nid in nodes:
        stages = [la.stage for la in plan.launches if la.nodes[0] == nid]
        assert stages[:2] == ["quant_int8", stages[1]] and stages[2] == "quant_i8", (nid, stages)
        assert set(stages[3:]) == {"i8_wgmma"}, (nid, stages)
        for ws in (gemm_int8.XQ, gemm_int8.XS):
            s = slots[workspace_slot(nid, ws)]
            assert s.first == s.last, (nid, s)     # alive during its node only
    assert not [c for c in plan.library_calls if c.attrs.get("weight_format") == I8]
    back = phase_from_json("prefill", json.loads(json.dumps(phase_to_json(plan))))
    assert [s.name for s in back.launches] == [s.name for s in plan.launches]
    assert [s.args for s in back.launches] == [s.args for s in plan.launches]


def _compile(launch, options=("--ptxas-options=-v",)):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    return compile_cubin(render_launch(launch), launch.name, arch=kernel_target("sm_90", launch.requires),
                         options=options)


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op, K, dtype", [("multi_linear", 2048, "bf16"), ("gate_up_silu", 2048, "bf16"),
                                          ("linear", 10944, "fp16"), ("linear", 18432, "bf16")])
def test_the_int8_gemm_compiles_to_int8_wgmma_without_spills(op, K, dtype):
    from sass import instructions
    from test_sass_pdl import wait_problem
    G, nid = _node(op, (I8, I8), K=K)
    quant, *launches = [s for s in linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=QUANT)) if isinstance(s, KernelLaunch)
                        and s.family == gemm_int8.FAMILY]
    for la in launches:
        res = _compile(la)
        assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
        assert "0 bytes spill loads" in res.log and "serialized" not in res.log, res.log
        ops = opcodes(res.cubin)
        assert ops["IGMMA.64x128x32.S8.S8"] == 4, sorted(ops)              # one 128-byte K stage: 4 x k32
        assert ops["UTMALDG.2D"] == 2 and ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0, sorted(ops)
        assert ops["I2FP.F32.S32"] > 0 and ops["FMUL"] > 0, "the epilogue: int -> float, then the two scales"
        assert not any(o.startswith(("HGMMA", "QGMMA", "LDL", "STL")) for o in ops), sorted(ops)
        if op != "gate_up_silu":
            assert not any(o.startswith("FFMA") for o in ops), "no FMA may merge the epilogue's two products"
        # split K: the tile's ticket (one acquire-release add) and the int32 partials past L1 (16-byte .cg
        # stores and loads, 16 a thread each)
        assert ops["ATOMG.E.ADD.STRONG.GPU"] == 1, sorted(ops)
        assert ops["STG.E.128.STRONG.GPU"] == 16 and ops["LDG.E.128.STRONG.GPU"] == 16, sorted(ops)
        assert wait_problem(instructions(res.cubin)[la.name]) is None
    qres = _compile(quant)
    assert "0 bytes stack frame" in qres.log and "0 bytes spill stores" in qres.log, qres.log
    qops = opcodes(qres.cubin)
    assert qops["FCHK"] > 0 and qops["MUFU.RCP"] > 0 and qops["F2I.NTZ"] > 0, sorted(qops)
    assert qops["LDG.E.128.CONSTANT"] > 0, sorted(qops)
    assert wait_problem(instructions(qres.cubin)[quant.name]) is None
