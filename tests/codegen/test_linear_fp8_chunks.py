"""The FP8 skinny kernel in 16-token chunks (Tuning.linear.fp8_chunks_upto, on at 64 by default; CPU): the linear
table's row, which launches run at each T with the knob off and on (the chunked launch's grid.y, no quantiser
launch in its range, gemm_fp8 above it with its workspaces empty below), `dsgraph explain`, and the chunked
kernels' machine code (NVRTC for sm_90a with ptxas -v: no spills, the registers of the T <= 16 kernel).
The GPU property tests: tests/gpu/test_kernels_linear_fp8_chunks.py."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_linear_fp8 import _node  # noqa: E402
from tiny import ROOT  # noqa: E402

from codegen import dispatch  # noqa: E402
from codegen.families import linear_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, Options  # noqa: E402
from codegen.sizes import evaluate  # noqa: E402
from codegen.tuning import LinearTuning, TuningError, parse_tune  # noqa: E402
from runtime.cli import main  # noqa: E402

FP8_FACTS = {"precision": "act", "weight_format": "fp8_e4m3_block128", "sm_90a": True, "fp8_rows": True,
             "fp8_fits": True}
TOKENS = (1, 16, 17, 32, 64, 65, 128, 129)
OFF = "linear.fp8_chunks_upto=0"


def _lower(op: str, *tune: str, arch: str = "sm_90a", **shape) -> list:
    G, nid = _node(op)
    return linear_skinny.lower(nid, G, Options(arch=arch, tuning=parse_tune(list(tune))), **shape)


def _running(steps, T: int) -> list[tuple[str, tuple]]:
    """(the kernel name's last part, its grid) of each launch with work at T."""
    env = {"T": T, "SMS": 132}
    out = []
    for s in steps:
        grid = tuple(evaluate(g, env) for g in s.grid)
        if all(g > 0 for g in grid):
            out.append((s.name.rsplit("__", 1)[1], grid))
    return out


def test_the_knob_is_on_at_64_by_default_and_takes_its_choices_only():
    assert LinearTuning().fp8_chunks_upto == 64
    assert parse_tune(["linear.fp8_chunks_upto=128"]).linear.fp8_chunks_upto == 128
    with pytest.raises(TuningError, match="must be one of 0, 32, 64, 128, 256, got 48"):
        parse_tune(["linear.fp8_chunks_upto=48"])


@pytest.mark.parametrize("tune, expect", [
    ((OFF,), {16: "skinny", 17: "fp8_wgmma", 128: "fp8_wgmma"}),
    ((), {16: "skinny", 17: "skinny_fp8_chunks", 64: "skinny_fp8_chunks", 65: "fp8_wgmma"}),
    (("linear.fp8_chunks_upto=64",), {16: "skinny", 17: "skinny_fp8_chunks", 64: "skinny_fp8_chunks",
                                      65: "fp8_wgmma"}),
    (("linear.fp8_chunks_upto=128", "linear.skinny_upto=8"), {8: "skinny", 9: "skinny_fp8_chunks",
                                                               128: "skinny_fp8_chunks", 129: "fp8_wgmma"}),
    (("linear.fp8_chunks_upto=128", "linear.skinny_upto=0"), {1: "fp8_wgmma", 64: "fp8_wgmma"}),
])
def test_the_linear_tables_fp8_case_gives_the_chunks_their_range(tune, expect):
    t = parse_tune(list(tune))
    assert {T: dispatch.select("linear", T, FP8_FACTS, t).variant for T in expect} == expect
    # the row is FP8's alone: 16-bit weights keep cuBLAS above the skinny kernel
    assert dispatch.select("linear", 17, {"precision": "act", "weight_format": "same"}, t).variant != \
        "skinny_fp8_chunks"


@pytest.mark.parametrize("op, width", [("multi_linear", "o3072_576"), ("linear", "o2048"),
                                       ("gate_up_silu", "silu10944")])
def test_which_launches_run_at_each_token_count(op, width):
    """Off: the skinny kernel up to 16, the quantiser and gemm_fp8 above (today's launches).  On at 64: the
    chunked kernel at 17-64 with cdiv(T, 16) chunks along y and no quantiser, gemm_fp8 from 65."""
    off, on = _lower(op, OFF), _lower(op, "linear.fp8_chunks_upto=64")
    assert [s.name for s in off] == [s.name for s in on if not s.name.endswith("__c16")]
    gemm = [n for n, _ in _running(off, 17)]
    assert gemm[0] == "quant_x" and len(gemm) == (3 if op == "multi_linear" else 2)
    ctas = {"multi_linear": 228, "linear": 128, "gate_up_silu": 1368}[op]
    for T in TOKENS:
        small = [(width, (ctas, 1, 1))]
        assert _running(off, T) == (small if T <= 16 else [(n, g) for n, g in _running(off, T)]), T
        if T <= 16:
            assert _running(on, T) == small, T
        elif T <= 64:
            assert _running(on, T) == [("c16", (ctas, -(-T // 16), 1))], T
        else:
            assert _running(on, T) == _running(off, T), T
    (chunked,) = [s for s in on if s.name.endswith("__c16")]
    plain = on[0]
    assert chunked.name == f"{plain.name}__c16" and chunked.args == plain.args and not chunked.workspace
    assert chunked.params == {**plain.params, "chunk": linear_skinny.SKINNY_MAX_TOKENS}
    assert chunked.stage == f"{op}_chunks" and chunked.block == plain.block


def test_gemm_fp8s_workspaces_are_empty_where_the_chunks_run():
    off, on = _lower("multi_linear", OFF), _lower("multi_linear", "linear.fp8_chunks_upto=128")
    for a, b in zip([s for s in off if s.workspace], [s for s in on if s.workspace]):
        assert [w.name for w in a.workspace] == [w.name for w in b.workspace] and b.name == a.name
        for wa, wb in zip(a.workspace, b.workspace):
            for T in (17, 64, 128):
                assert evaluate(wb.shape[0], {"T": T, "SMS": 132}) == 0, (wb.name, T)
            for T in (129, 300):
                assert evaluate(wb.shape[0], {"T": T, "SMS": 132}) == evaluate(wa.shape[0], {"T": T, "SMS": 132})
            assert wa.shape[1:] == wb.shape[1:]


def test_clusters_split_k_along_x_and_the_chunks_go_along_y():
    steps = _lower("linear", "linear.fp8_chunks_upto=32", ksplit=2)
    assert [g for _, g in _running(steps, 8)] == [(256, 1, 1)]
    assert _running(steps, 17) == [("c16", (256, 2, 1))] and _running(steps, 32) == [("c16", (256, 2, 1))]
    (chunked,) = [s for s in steps if s.name.endswith("__c16")]
    assert chunked.params["ks"] == 2 and "k2" in chunked.name


def test_off_the_fp8_case_no_chunks():
    """No sm_90a (the library call dequantises above the skinny kernel), skinny_upto 0 (no skinny kernel),
    16-bit weights: the knob moves nothing."""
    for steps in (_lower("linear", "linear.fp8_chunks_upto=64", arch="sm_80"),
                  _lower("linear", "linear.fp8_chunks_upto=64", "linear.skinny_upto=0")):
        assert not any(isinstance(s, KernelLaunch) and "chunk" in s.params for s in steps)
    G, nid = _node("linear", formats=(None,))
    steps = linear_skinny.lower(nid, G, Options(arch="sm_90a", tuning=parse_tune(["linear.fp8_chunks_upto=64"])))
    assert not any(isinstance(s, KernelLaunch) and "chunk" in s.params for s in steps)


def test_explain_names_the_chunks_row(capsys):
    lite = str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")
    assert main(["explain", lite, "--weights", "fp8", "--phase", "decode", "--tokens", "32,128",
                 "--tune", "linear.fp8_chunks_upto=64"]) == 0
    out = capsys.readouterr().out
    d32, d128 = out.split("decode, T = 32 ", 1)[1].split("\n\n")[0], out.split("decode, T = 128 ", 1)[1]
    for name in ("k2048__o3072_576", "k2048__o2048", "k2048__silu10944", "k10944__o2048"):
        assert f"linear_skinny__bf16_wfp8__{name}__c16" in d32, name
    # no dense FP8 GEMM (the experts' down still has gemm_fp8's quantiser: moe.fp8_activations_above)
    assert "skinny_fp8_chunks [tokens 17..64]" in d32 and "gemm_fp8__bf16_wfp8" not in d32
    assert "__c16" not in d128 and "fp8_wgmma [tokens 65..inf]" in d128


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["q+kv_a", "o", "dense gate_up"])
def test_the_chunked_kernels_compile_without_spills_in_the_registers_of_the_small_ones(shape):
    """V2-Lite's FP8 linears (ptxas -v): the chunked kernel adds the chunk's offsets, and its output pointers
    wait in shared memory, so it keeps the T <= 16 kernel's registers.  (The down shapes, K = 10944 and 2816,
    spill 12 bytes in today's T <= 16 kernel and 20 in the chunked one: docs/notes/fp8chunk.md.)"""
    from bench.perf_linear_fp8 import lowered_chunks, shapes
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    import ir
    m = ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model
    K, rows, silu = shapes(m)[shape]
    regs = []
    for la in lowered_chunks(m, K, rows, silu, 128):
        log = compile_cubin(render_launch(la), la.name, options=("--ptxas-options=-v",)).log
        assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, log
        regs.append(int(re.search(r"Used (\d+) registers", log).group(1)))
    assert regs[1] <= regs[0], regs


@pytest.mark.slow
def test_the_chunked_kernel_compiles_in_clusters():
    """K split over clusters of 2 (along x) with the chunks along y: __cluster_dims__(2, 1, 1).  This shape
    (rolling x4 in clusters, not a default) spills in today's T <= 16 kernel too (40 bytes); the chunk's
    token count adds at most a register's worth a thread (12 bytes measured)."""
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    plain, chunked = [s for s in _lower("linear", "linear.fp8_chunks_upto=32", ksplit=2) if s.family == "linear_skinny"]
    src = render_launch(chunked)
    assert "__cluster_dims__(KS, 1, 1)" in src and "linear_fp8_chunk<" in src and '#include "fp8_chunks.cuh"' in src
    spills = [int(re.search(r"(\d+) bytes spill stores", compile_cubin(render_launch(la), la.name,
                                                                        options=("--ptxas-options=-v",)).log).group(1))
              for la in (plain, chunked)]
    assert spills[1] <= spills[0] + 12, spills


def test_the_bench_times_the_chunked_launch():
    import ir
    from bench.perf_linear_fp8 import lowered_chunks, shapes
    m = ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model
    plain, chunked = lowered_chunks(m, *shapes(m)["q+kv_a"], 128)
    assert (plain.name, chunked.name) == ("linear_skinny__bf16_wfp8__k2048__o3072_576",
                                          "linear_skinny__bf16_wfp8__k2048__o3072_576__c16")
    assert evaluate(chunked.grid[1], {"T": 128}) == 8


@pytest.mark.slow
def test_the_decode_arena_holds_no_quantised_x_where_the_chunks_run():
    """V2-Lite with FP8 weights: at b=32 the chunks' step places no fp8_xq / fp8_xs / fp8_partials bytes (its
    arena is smaller than today's); at b=128, above the chunks, the same arena as today."""
    from codegen.bundle import plan_spec
    from codegen.memplan import ArenaPlan, step_sizes
    from runtime.bench import bench_spec
    lite = str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")
    totals = {}
    for tune in ((OFF,), ("linear.fp8_chunks_upto=64",)):
        plan = plan_spec(bench_spec(lite, "fp8"), Options(tuning=parse_tune(list(tune))), strict=False).plans["decode"]
        arena = ArenaPlan(plan.arena)
        for b in (32, 128):
            lay = arena.layout(step_sizes("decode", b, plan), 2)
            fp8_ws = sum(n for name, n in lay.nbytes.items() if name.rsplit("/", 1)[-1].startswith("fp8_"))
            totals[tune, b] = (lay.total, fp8_ws)
    on = ("linear.fp8_chunks_upto=64",)
    assert totals[on, 32][1] == 0 < totals[(OFF,), 32][1] and totals[on, 32][0] < totals[(OFF,), 32][0], totals
    assert totals[on, 128] == totals[(OFF,), 128], totals


@pytest.mark.slow
def test_with_the_norms_e4m3_rows_the_norms_write_them_only_above_the_chunks(capsys):
    """linear.norm_fp8 reads where gemm_fp8's row starts (linear_skinny.fp8x_from): at b=32 the chunks read
    the 16-bit x, so the attention's input norms write no e4m3 rows (the MoE input norms do: the experts run
    FP8 x FP8 above moe.fp8_activations_above); at b=128 they do, for gemm_fp8."""
    lite = str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")
    assert main(["explain", lite, "--weights", "fp8", "--phase", "decode", "--tokens", "32,128",
                 "--tune", "linear.fp8_chunks_upto=64", "--tune", "linear.norm_fp8=true"]) == 0
    out = capsys.readouterr().out
    d32, d128 = out.split("decode, T = 32 ", 1)[1].split("\n\n")[0], out.split("decode, T = 128 ", 1)[1]
    attention_norms = re.compile(r"\b(rms_norm|moe_combine_residual_rms_norm)__bf16__\w*__qf8")
    assert not attention_norms.search(d32) and "__c16" in d32 and "fused_add_rms_norm__bf16__d2048__qf8" in d32
    assert "rms_norm__bf16__d2048__qf8" in d128   # and q + kv_a, the norm's reader, has no quantiser launch
    assert "runs   gemm_fp8__bf16_wfp8__k2048__o3072__ovl__ew, gemm_fp8__bf16_wfp8__k2048__o576__ovl__ew" in d128
