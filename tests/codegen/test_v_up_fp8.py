"""mla_v_up writing o_proj's e4m3 rows (Tuning.linear.v_up_fp8; ir/passes/fuse_v_up_fp8_quant.py,
templates/include/v_up_rows.cuh) on the CPU: with the knob off V2-Lite's FP8 decode plan is today's; with it on,
mla_v_up runs its plain launch below the first T at which o_proj multiplies FP8 x FP8 (gemm_fp8, 65 with the
FP8 chunks at 64) and its "qf8" launch (a CTA a whole head) from there, o_proj binds the rows and runs no
quantiser, and nothing else changes; at T = 17 and 32 (the chunks read the 16-bit o) nothing changes at all; the
rows live in the memory plan from v_up to o_proj; V != 128 keeps the quantiser (explain says why); prefill is
untouched; the qf8 variants compile for sm_90a (ptxas -v, SASS: e4m3 conversions, the half-warp max, coherent
read-back of o), keeping the PDL contract."""
from __future__ import annotations

import os
import sys
from functools import lru_cache

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions, opcodes  # noqa: E402
from tiny import ROOT  # noqa: E402

import ir  # noqa: E402
from codegen import sizes  # noqa: E402
from codegen.families import _norm_quant, family_for_op, mla_v_up  # noqa: E402
from codegen.kernel import KernelLaunch, Options, ValueRef  # noqa: E402
from codegen.lower import lower_graph, pipeline_knobs  # noqa: E402
from codegen.tuning import LinearTuning, Tuning  # noqa: E402
from ir.formats import FP8, set_format  # noqa: E402
from ir.ops import TType  # noqa: E402
from ir.passes import run_pipeline  # noqa: E402
from ir.passes.norm_rows import give_rows, row_names  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import single_op_graph, tiny_model  # noqa: E402
from test_norm_fp8 import _bound, _launches, rows_live_to_their_readers  # noqa: E402

ON = Tuning(linear=LinearTuning(v_up_fp8=True))
OFF = Tuning()
SIZES = (1, 16, 17, 32, 64, 65, 128, 256, 300)
LAYERS = 27


@lru_cache(maxsize=None)
def _spec():
    from runtime.bench import bench_spec
    return bench_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml"), "fp8")


@lru_cache(maxsize=None)
def _plan(phase: str, tuning: Tuning = OFF, arch: str = "sm_90a"):
    opts = Options(arch=arch, tuning=tuning)
    G = run_pipeline(ir.build_graph(_spec(), phase), knobs=pipeline_knobs(opts))
    return G, lower_graph(G, opts)


def _running(plan, T: int) -> list:
    env = {"T": T, "B": T, "NP": 8 * T, "MAXQ": 1, "MAXCTX": 512, "TK": T, "W": 8, "SMS": 132}
    return [s for s in _launches(plan) if all(sizes.evaluate(g, env) > 0 for g in s.grid)]


def _o_proj_quantisers(G, run) -> list:
    """The quantiser launches of the linears reading an mla_v_up's output."""
    o = {d["outputs"][0] for _, d in G.nodes(data=True) if d["op"] == "mla_v_up"}
    readers = {n for n, d in G.nodes(data=True) if d["inputs"] and d["inputs"][0] in o}
    return [s for s in run if s.stage == "quant_x" and set(s.nodes) & readers]


def test_the_knob_is_off_by_default_and_switches_the_pass():
    assert not Tuning().linear.v_up_fp8
    assert "linear.v_up_fp8" in pipeline_knobs(Options(tuning=ON))
    assert "linear.v_up_fp8" not in pipeline_knobs(Options())
    assert ON.flags() == ["--tune linear.v_up_fp8=true"]


def test_off_the_plan_is_todays():
    for phase in ir.PHASES:
        G, plan = _plan(phase)
        assert not any(d["attrs"].get("quant") for _, d in G.nodes(data=True) if d["op"] == "mla_v_up")
        assert not any(s.name.endswith("__qf8") for s in _launches(plan) if s.family == "mla_v_up")


@pytest.mark.parametrize("T", SIZES)
def test_on_the_same_launches_run_less_o_projs_quantisers(T):
    """At each T the launches are the knob-off ones, but from 65 on (gemm_fp8's row) each layer's plain v_up
    is its qf8 launch and o_proj's quantiser is gone; at 17-64 (the FP8 chunks read the 16-bit o) and below,
    exactly today's launches and grids."""
    G, off = _plan("decode")
    H, on = _plan("decode", ON)
    run_off, run_on = _running(off, T), _running(on, T)
    quant = _o_proj_quantisers(G, run_off)
    assert len(quant) == (LAYERS if T >= 65 else 0)
    assert not _o_proj_quantisers(H, run_on)
    kept = [s for s in run_off if s not in quant]
    names_on = [s.name.replace("mma_t16_m8__qf8", "mma_t32_m2") for s in run_on]
    assert names_on == [s.name for s in kept], T
    qf8 = [s for s in run_on if s.family == "mla_v_up" and s.name.endswith("__qf8")]
    assert len(qf8) == (LAYERS if T >= 65 else 0)
    if T < 65:   # the same kernels on the same grids (v_up's grid expression carries its range)
        env = {"T": T, "B": T, "NP": 8 * T, "MAXQ": 1, "MAXCTX": 512, "TK": T, "W": 8, "SMS": 132}
        grids = [[(s.name, [sizes.evaluate(g, env) for g in s.grid]) for s in run] for run in (run_on, run_off)]
        assert grids[0] == grids[1]


@pytest.mark.parametrize("T", (65, 128, 256))
def test_o_proj_binds_v_ups_rows_and_workspaces_go(T):
    G, plan = _plan("decode", ON)
    run = _running(plan, T)
    for s in run:
        if s.family != "mla_v_up" or not s.name.endswith("__qf8"):
            continue
        (node,) = s.nodes
        o = G.nodes[node]["outputs"][0]
        q, sc = row_names(o, "fp8")
        assert (_bound(s, "hq").name, _bound(s, "hs").name) == (q, sc)
        assert G.graph["values"][q] == TType(("T", 2048 // 4), "i32") and G.graph["values"][sc] == TType(("T", 16), "f32")
        assert s.grid[1:] == (16, 1) and s.block == (1024, 1, 1)
        readers = [r for r in run if r.family == "gemm_fp8" and isinstance(_bound(r, "xq"), ValueRef)
                   and _bound(r, "xq").name == q]
        assert len(readers) == 1 and _bound(readers[0], "xs").name == sc
        assert not any(w.name == "fp8_xq" for w in readers[0].workspace)


def test_the_rows_live_from_v_up_to_o_proj():
    G, plan = _plan("decode", ON)
    nodes = rows_live_to_their_readers(G, plan)   # the norms' with qf8 launches too
    assert sum(G.nodes[n]["op"] == "mla_v_up" for n in nodes) == LAYERS


def test_prefill_and_plans_without_the_fp8_gemm_are_untouched():
    G, plan = _plan("prefill", ON)
    assert not any(d["attrs"].get("quant") for _, d in G.nodes(data=True) if d["op"] == "mla_v_up")
    # without FP8 activations o_proj never runs FP8 x FP8: the rows are never read, so never written
    _, off = _plan("decode", Tuning(linear=LinearTuning(fp8_activations=False)))
    _, on = _plan("decode", Tuning(linear=LinearTuning(fp8_activations=False, v_up_fp8=True)))
    assert [(s.name, s.grid) for s in _launches(on)] == [(s.name, s.grid) for s in _launches(off)]


def test_a_qf8_launch_is_no_segment_member(monkeypatch):
    """A persistent segment's v_up task body writes o only: the qf8 launch gives none (16-bit kv_b's plain
    tensor-core launch keeps its body)."""
    G, nid = _graph(False)
    (plain,) = family_for_op("mla_v_up").lower(nid, G, Options(arch="sm_90a", tuning=ON))
    assert mla_v_up.segment_body(plain) is not None
    assert mla_v_up.segment_body(_qf8_launch(False, monkeypatch)) is None


def test_a_v_other_than_128_keeps_the_quantiser_and_explain_says_why(capsys, tmp_path):
    """test_norm_fp8's tiny FP8 model (V = 16): the pass refuses, o_proj keeps its quantiser, explain says why."""
    from ir.config_to_spec import spec_from_config
    from runtime.cli import main
    from test_norm_fp8 import TINY
    path = tmp_path / "tiny.yaml"
    path.write_text(spec_from_config(TINY, name="tiny"))
    assert main(["explain", str(path), "--phase", "decode", "--tokens", "128", "--arch", "sm_90a",
                 "--tune", "linear.v_up_fp8=true"]) == 0
    out = capsys.readouterr().out
    assert "__qf8\n" not in out.split("mla_v_up ", 1)[1].split("\n  ", 2)[1]
    assert "o_proj keeps its quantiser: cannot fuse L0.mla.o (mla_v_up) with" in out
    assert "a 128-column group of o is not one head's V columns (V = 16)" in out


def _graph(fp8: bool, H: int = 16, C: int = 512):
    """A lone mla_v_up with o's rows: V2-Lite's (H 16, C 512), else test_e2e_v_up_fp8.py's dims (H 3, C 192)."""
    if (H, C) == (16, 512):
        m = ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model
    else:
        m = tiny_model(hidden=144, heads=H, kv_lora_rank=C, qk_rope_head_dim=16, qk_nope_head_dim=48, v_head_dim=128,
                       intermediate=208, moe_intermediate=176)
    G, nid = single_op_graph(m, "mla_v_up", {}, {"o_lat": TType(("T", H, C), "act")}, {"kv_b": "kvb"},
                             phase="decode")
    if fp8:
        set_format(G.graph["weights"], "kvb", FP8)
    return G, give_rows(G, nid, "fp8")


def _qf8_launch(fp8: bool, monkeypatch, H: int = 16, C: int = 512, **opts):
    """The qf8 launch alone: a reader multiplying FP8 x FP8 from T = 1 on (no real reader here)."""
    monkeypatch.setattr(_norm_quant, "fp8_from", lambda G, nid, o: 1)
    G, nid = _graph(fp8, H=H, C=C)
    (launch,) = family_for_op("mla_v_up").lower(nid, G, Options(arch="sm_90a", tuning=ON, **opts))
    return launch


def test_the_qf8_tiling_keeps_the_plain_kernels_k_slices():
    """A CTA a whole head (8 m16 tiles), the plain kernel's 4 k slices of 4 chunks (so the same fp32 sums in the
    same order: o bit-equal), 16-token tiles (4 partial tiles of 128 rows fit the static 48 KB)."""
    plain, rows = mla_v_up.tensor_core_params(128, 512, "bf16"), mla_v_up.rows_params(128, 512, "bf16")
    assert (plain["ks"], plain["cps"]) == (rows["ks"], rows["cps"]) == (4, 4)
    assert rows["mt"] * 16 == 128 and rows["TN"] == 16 and rows["threads"] == 1024
    assert rows["smem_bytes"] == 4 * 16 * (128 + 4) * 4 <= mla_v_up.STATIC_SMEM
    assert mla_v_up.rows_params(128, 512, "fp32") is None and mla_v_up.rows_params(120, 512, "bf16") is None


def test_without_an_fp8_x_fp8_reader_v_up_writes_no_rows():
    G, nid = _graph(True)
    (launch,) = family_for_op("mla_v_up").lower(nid, G, Options(arch="sm_90a", tuning=ON))
    assert launch.name == "mla_v_up__bf16_wfp8__h16_n128_v128_c512__mma_t32_m2"
    assert not mla_v_up.writes_fp8_rows(G, nid, Options(tuning=OFF))
    assert mla_v_up.writes_fp8_rows(G, nid, Options(tuning=ON))


def test_the_variant_renders_the_rows_call(monkeypatch):
    from codegen.render import render_launch
    launch = _qf8_launch(True, monkeypatch)
    src = render_launch(launch)
    assert launch.name == "mla_v_up__bf16_wfp8__h16_n128_v128_c512__mma_t16_m8__qf8"
    assert launch.grid == ("min(cdiv(T, 16), 8)", 16, 1) and launch.block == (1024, 1, 1)
    assert '#include "v_up_rows.cuh"' in src
    assert "dsg::absorb::v_up_rows_fp8<act_t, 16, 128, 16, VUp::THREADS>(out, hq, hs, T);" in src
    assert "unsigned char* __restrict__ hq," in src and "float* __restrict__ hs)" in src


def _compile(launch):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    return compile_cubin(render_launch(launch), launch.name, arch="sm_90a", options=("--ptxas-options=-v",))


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("fp8, dtype, H, C, spill", [(True, "bf16", 16, 512, 0), (True, "fp16", 16, 512, 0),
                                                     (False, "bf16", 16, 512, 8), (True, "bf16", 3, 192, 0)])
def test_the_qf8_variants_compile_and_read_o_back_coherently(fp8, dtype, H, C, spill, monkeypatch):
    """FP8 kv_b (V2-Lite's; and test_e2e_v_up_fp8.py's C = 192: 512 threads): no spills.  16-bit kv_b at C = 512:
    8 bytes spilled, in AbsorbVUp's own loop (the same 8 bytes without the rows' call): 1024 threads leave 64
    registers a thread and the 16-bit weight slice takes 32.  The rows: e4m3 conversions, true divisions, the
    half-warp max, 8-byte stores; o read back with coherent 16-byte loads (not LDG.CONSTANT: this kernel wrote o)."""
    from test_sass_pdl import wait_problem
    launch = _qf8_launch(fp8, monkeypatch, H=H, C=C, dtype=dtype)
    res = _compile(launch)
    assert f"{spill} bytes spill stores" in res.log, res.log
    ops = opcodes(res.cubin)
    assert any(o.startswith("F2FP") and "E4M3" in o for o in ops), sorted(ops)
    assert ops["FCHK"] > 0 and ops["MUFU.RCP"] > 0 and ops["SHFL.BFLY"] >= 4 and ops["STG.E.64"] > 0, sorted(ops)
    instrs = instructions(res.cubin)[launch.name]
    # the kernel's last 16-byte load is the read-back of o, coherent (the weights' are .CONSTANT: read-only)
    assert [i.opcode for i in instrs if i.opcode.startswith("LDG") and ".128" in i.opcode][-1] == "LDG.E.128"
    assert wait_problem(instrs, weight_loads=True) is None


def test_explain_names_the_rows_and_their_maker(capsys):
    from runtime.cli import main
    lite = str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")
    assert main(["explain", lite, "--weights", "fp8", "--phase", "decode", "--tokens", "32,128", "--arch",
                 "sm_90a", "--tune", "linear.v_up_fp8=true"]) == 0
    out = capsys.readouterr().out
    d32, d128 = out.split("decode, T = 32 ", 1)[1].split("\n\n")[0], out.split("decode, T = 128 ", 1)[1]
    assert "__qf8" not in d32.split("mla_v_up ", 1)[1].split("\n  ", 2)[1] and "v_up also writes" not in d32
    assert "runs   mla_v_up__bf16_wfp8__h16_n128_v128_c512__mma_t16_m8__qf8\n" in d128
    assert "here v_up also writes o's e4m3 rows and scales (linear.v_up_fp8)" in d128
    assert "runs   gemm_fp8__bf16_wfp8__k2048__o2048__ovl__ew\n" in d128
    assert "x's e4m3 rows and scales come from mla_v_up, which makes x (linear.v_up_fp8" in d128
    assert "gemm_fp8__bf16__k2048__quant_x" not in d128 and "gemm_fp8__bf16__k10944__quant_x" in d128


def test_the_task_graph_orders_o_proj_after_the_heads_that_write_its_rows():
    """The decode task graph at b = 128 (codegen/tasks.py): the qf8 tiles declare head h's e4m3 words and scale
    too, so codegen/taskcheck.py's own bookkeeping finds every reader of the rows after their writers."""
    from codegen.taskcheck import problems
    from codegen.tasks import build_task_graph
    _, plan = _plan("decode", ON)
    g = build_task_graph(plan, 128)
    assert problems(g, g.tiling) == []
    rows = [(w.value, w.box) for t in g.tasks for w in t.writes if w.value.endswith((".qf8", ".sf8"))
            and w.value.startswith("L0.mla.o")]
    assert sorted(rows) == sorted([("L0.mla.o.qf8", ((0, 128), (32 * h, 32 * h + 32))) for h in range(16)]
                                  + [("L0.mla.o.sf8", ((0, 128), (h, h + 1))) for h in range(16)])
