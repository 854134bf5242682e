"""moe_combine_residual_rms_norm's streaming launches (Tuning.moe.combine_stream_above; codegen/families/
_combine_stream.py) on the CPU: off by default, and off the lowering is today's; on, the plain launches keep T up
to the knob and the streaming ones ("__st") serve above it, one of them at every T, for the plain rows and the
int8 / e4m3 ones; their grid is the CTAs the SMs hold at once, their stage the token's rows; rows not of whole
16-byte slices or a stage past a CTA's shared memory keep the plain launch, and so do decode plans; no
persistent-segment member; a bundle keeps them through its manifest; V2-Lite's
and V3's variants (the dispatch tables unchanged) render and compile for sm_90a without spills within the
registers their CTAs an SM leave, keeping the PDL contract, with 16-byte cp.async (LDGSTS) for the stage."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions, opcodes  # noqa: E402
from tiny import ROOT  # noqa: E402

import ir  # noqa: E402
from codegen import dispatch, sizes  # noqa: E402
from codegen.families import _combine_stream, _norm_quant, family_for_op  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.tuning import LinearTuning, MoeTuning, Tuning, parse_tune  # noqa: E402
from ir.ops import TType  # noqa: E402
from ir.passes.norm_rows import give_rows  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import single_op_graph  # noqa: E402

OP = "moe_combine_residual_rms_norm"
V2_LITE, V3, W4A8 = (2048, 8, 2), (7168, 9, 1), (7168, 8, 0)   # D, K, S of the prefill combines
ROWS = (None, "int8", "fp8")


def _graph(D: int, K: int, S: int, rows: str | None):
    m = ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model
    ins = {"eo": TType((f"T*{K}", D), "act"), "w": TType(("T", K), "f32"),
           **({} if S else {"sh": TType(("T", D), "act")}), "res": TType(("T", D), "act")}
    G, nid = single_op_graph(m, OP, {"shared_experts": S} if S else {}, ins, {"weight": "w"})
    return G, (give_rows(G, nid, rows) if rows else nid)


def _lower(shape=V2_LITE, rows=None, above=None, dtype="bf16", monkeypatch=None):
    """The node's launches; with e4m3 rows, as a reader multiplying FP8 x FP8 from T = 1 on makes them."""
    if rows == "fp8":
        monkeypatch.setattr(_norm_quant, "fp8_from", lambda G, nid, o: 1)
    G, nid = _graph(*shape, rows)
    t = Tuning(moe=MoeTuning(combine_stream_above=above),
               linear=LinearTuning(norm_int8=rows == "int8", norm_fp8=rows == "fp8"))
    return family_for_op(OP).lower(nid, G, Options(dtype=dtype, arch="sm_90a", tuning=t))


def _running(launches, T: int, sms: int = 132) -> list:
    return [la for la in launches if sizes.evaluate(la.grid[0], {"T": T, "SMS": sms}) > 0]


def test_the_knob_is_off_by_default_and_a_knob_of_the_cache_key():
    assert Tuning().moe.combine_stream_above is None
    assert parse_tune(["moe.combine_stream_above=256"]).moe.combine_stream_above == 256
    assert parse_tune(["moe.combine_stream_above=none"]) == Tuning()
    assert Tuning(moe=MoeTuning(combine_stream_above=256)) != Tuning()


@pytest.mark.parametrize("rows", ROWS)
def test_off_the_launches_are_todays(rows, monkeypatch):
    (la,) = _lower(rows=rows, monkeypatch=monkeypatch)
    suffix = {None: "", "int8": "__qi8", "fp8": "__qf8"}[rows]
    assert la.name == f"{OP}__bf16__k8_d2048__shared2{suffix}" and la.grid == ("T", 1, 1) and la.smem == 0
    assert la.template == "moe_combine_residual_rms_norm.cu.j2" and "stream" not in la.params


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [V2_LITE, V3, W4A8])
def test_on_the_plain_launch_keeps_t_up_to_the_knob_and_the_stream_serves_above(shape, rows, monkeypatch):
    plain, stream = _lower(shape, rows, 256, monkeypatch=monkeypatch)
    assert stream.name == plain.name + "__st" and stream.template == _combine_stream.TEMPLATE
    assert stream.block == plain.block and stream.args == plain.args   # same layout, same bindings
    assert {k: v for k, v in stream.params.items() if k != "stream"} == plain.params
    for T in (1, 2, 255, 256, 257, 300, 4096, 16384):
        assert _running([plain, stream], T) == [plain if T <= 256 else stream], T


@pytest.mark.parametrize("shape, threads, cps, smem", [(V2_LITE, 256, 4, 9 * 4096), (V3, 896, 1, 10 * 14336),
                                                       (W4A8, 896, 1, 10 * 14336), ((2048, 6, 0), 256, 4, 8 * 4096),
                                                       ((5120, 8, 2), 640, 1, 9 * 10240)])
def test_the_streams_grid_is_the_ctas_the_sms_hold_and_its_stage_a_tokens_rows(shape, threads, cps, smem):
    (stream,) = _lower(shape, above=0)
    assert stream.block == (threads, 1, 1) and stream.params["stream"] == {"cps": cps, "smem": smem}
    assert stream.smem == smem
    for T, sms in ((1, 132), (300, 132), (16384, 132), (16384, 114), (5, 1)):
        assert sizes.evaluate(stream.grid[0], {"T": T, "SMS": sms}) == min(T, sms * cps)


@pytest.mark.parametrize("shape, dtype", [((45, 3, 0), "bf16"), ((2052, 4, 1), "fp16"), ((16384, 8, 0), "bf16")])
def test_rows_of_partial_slices_or_a_stage_past_shared_memory_keep_the_plain_launch(shape, dtype):
    (la,) = _lower(shape, above=256, dtype=dtype)
    assert "stream" not in la.params and la.grid == ("T", 1, 1)


def test_the_stream_is_no_segment_member_and_moves_no_dispatch_row():
    from codegen import families
    plain, stream = _lower(above=256)
    fam = families.family_named(OP)
    assert fam.segment_body(plain) is not None and fam.segment_body(stream) is None
    G, nid = _graph(*V2_LITE, None)
    G.graph["phase"] = "decode"      # decode plans keep the plain launch alone: their segments unchanged
    (la,) = family_for_op(OP).lower(nid, G, Options(tuning=Tuning(moe=MoeTuning(combine_stream_above=0))))
    assert la.grid == ("T", 1, 1) and "stream" not in la.params
    on = Tuning(moe=MoeTuning(combine_stream_above=0))
    for op in sorted(dispatch.TABLES):
        assert dispatch.table(op, on) == dispatch.table(op, Tuning()), op


def test_the_stream_renders_its_stage_and_bounds(monkeypatch):
    from codegen.render import render_launch
    (stream,) = _lower(V2_LITE, "fp8", 0, monkeypatch=monkeypatch)
    src = render_launch(stream)
    assert "__launch_bounds__(THREADS, 4)" in src and "static_assert(Stream::BYTES == 36864" in src
    assert "dsg::quant::norm_rows_fp8<D, 16, L>(v, hq, hs, t);" in src
    assert "for (int t = blockIdx.x; t < T; t += gridDim.x)" in src


def _compile(launch):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    return compile_cubin(render_launch(launch), launch.name, arch="sm_90a", options=("--ptxas-options=-v",))


def _slow(*args):
    return pytest.param(*args, marks=pytest.mark.slow)


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("shape, rows", [(V2_LITE, "fp8"), _slow(V2_LITE, None), _slow((2048, 6, 0), "fp8"),
                                         _slow((2048, 6, 0), "int8"), _slow(V3, "fp8"), _slow(W4A8, "fp8"),
                                         _slow(W4A8, "int8")])
def test_the_stream_compiles_without_spills_in_its_register_budget(shape, rows, monkeypatch):
    import re
    from test_sass_pdl import wait_problem
    (stream,) = _lower(shape, rows, 0, monkeypatch=monkeypatch)
    res = _compile(stream)
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
    regs = int(re.search(r"Used (\d+) registers", res.log).group(1))
    assert regs * stream.block[0] * stream.params["stream"]["cps"] <= 65536, res.log
    ops = opcodes(res.cubin)
    assert any(o.startswith("LDGSTS") for o in ops), sorted(ops)      # the stage's 16-byte cp.async
    assert any(o.startswith("LDGDEPBAR") or o.startswith("DEPBAR") for o in ops), sorted(ops)
    assert wait_problem(instructions(res.cubin)[stream.name], weight_loads=True) is None


def test_explain_says_where_the_stream_runs():
    from runtime.cli_explain import _norm_writes
    plain, stream = _lower(above=256)
    assert _norm_writes([plain]) == ""
    assert _norm_writes([stream]).startswith("streamed (moe.combine_stream_above)")


@pytest.mark.slow
def test_a_bundle_keeps_the_streaming_launches_through_the_manifest(tmp_path, monkeypatch):
    """compile_bundle with the knob (NVRTC stubbed: the machine code is tested above) writes the streaming
    launches, their stage bytes and grids, and load_bundle reads back the same plans."""
    import dataclasses
    import hashlib

    import codegen.nvrtc as nvrtc
    from codegen.bundle import compile_bundle, load_bundle
    from codegen.kernel import KernelLaunch
    from codegen.lower import lower_graph, pipeline_knobs
    from ir.passes import run_pipeline
    from test_norm_fp8 import _spec
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, **kw: nvrtc.CompileResult(
        cubin=b"CUBIN:" + hashlib.sha256(source.encode()).digest(), log=""))
    on = Tuning(moe=MoeTuning(combine_stream_above=256))
    path = tmp_path / "tiny.yaml"
    path.write_text(_spec().text)
    compile_bundle(str(path), tmp_path / "bundle", arch="sm_90a", cache_dir=tmp_path / "cache", progress=False,
                   tuning=on)
    loaded = load_bundle(tmp_path / "bundle", arch="sm_90a")

    def plain(steps):
        return [dataclasses.replace(s, origins=()) if isinstance(s, KernelLaunch) else s for s in steps]

    for phase in ir.PHASES:
        opts = Options(arch="sm_90a", tuning=on)
        want = lower_graph(run_pipeline(ir.build_graph(_spec(), phase), knobs=pipeline_knobs(opts)), opts)
        got = loaded.plans[phase]
        assert plain(got.steps) == plain(want.steps), phase
        streams = [s for s in got.steps if isinstance(s, KernelLaunch) and "stream" in s.params]
        assert all(s.smem == s.params["stream"]["smem"] > 0 for s in streams), phase
        assert bool(streams) == (phase == "prefill"), phase    # decode: the plain launches alone
