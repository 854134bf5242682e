"""The int8 skinny kernel in 16-token chunks (Tuning.linear.i8_chunks_upto, off by default; CPU): the linear
table's row, which launches run at each T with the knob off and on (the chunked launch's grid.y, the quantiser's
launch or the norm's rows over its range, no gemm_int8 there, gemm_int8 above it with its workspaces empty
below), `dsgraph explain`, and the chunked kernels' machine code (NVRTC for sm_90a with ptxas -v: no spills).
The GPU property tests: tests/gpu/test_kernels_linear_int8_chunks.py."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_linear_int8 import I8, _node  # noqa: E402
from tiny import ROOT  # noqa: E402

from codegen import dispatch  # noqa: E402
from codegen.families import linear_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, Options  # noqa: E402
from codegen.sizes import evaluate  # noqa: E402
from codegen.tuning import LinearTuning, TuningError, parse_tune  # noqa: E402
from runtime.cli import main  # noqa: E402

GEMM_FACTS = {"precision": "act", "weight_format": I8, "dtype": "bf16", "sm_90a": True, "i8_rows": True,
              "i8_fits": True}
TOKENS = (1, 16, 17, 32, 64, 65, 128, 129)
ON = "linear.i8_chunks_upto=64"
OFF = "linear.i8_chunks_upto=0"
LITE = str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")


def _lower(op: str, *tune: str, arch: str = "sm_90a") -> list:
    G, nid = _node(op)
    return linear_skinny.lower(nid, G, Options(arch=arch, tuning=parse_tune(list(tune))))


def _running(steps, T: int) -> list[tuple[str, tuple]]:
    """(stage, grid) of each launch with work at T."""
    env = {"T": T, "SMS": 132}
    out = []
    for s in steps:
        grid = tuple(evaluate(g, env) for g in s.grid)
        if all(g > 0 for g in grid):
            out.append((s.stage, grid))
    return out


def test_the_knob_is_on_at_32_by_default_and_takes_its_choices_only():
    assert LinearTuning().i8_chunks_upto == 32
    assert parse_tune(["linear.i8_chunks_upto=128"]).linear.i8_chunks_upto == 128
    with pytest.raises(TuningError, match="must be one of 0, 32, 64, 128, 256, got 48"):
        parse_tune(["linear.i8_chunks_upto=48"])


@pytest.mark.parametrize("tune, facts, expect", [
    ((OFF,), GEMM_FACTS, {16: "skinny_wi8", 17: "i8_wgmma", 128: "i8_wgmma"}),
    ((), GEMM_FACTS, {16: "skinny_wi8", 17: "skinny_wi8_chunks", 32: "skinny_wi8_chunks", 33: "i8_wgmma"}),
    ((ON,), GEMM_FACTS, {16: "skinny_wi8", 17: "skinny_wi8_chunks", 64: "skinny_wi8_chunks", 65: "i8_wgmma"}),
    (("linear.i8_chunks_upto=128", "linear.skinny_upto=8"), GEMM_FACTS,
     {8: "skinny_wi8", 9: "skinny_wi8_chunks", 128: "skinny_wi8_chunks", 129: "i8_wgmma"}),
    (("linear.i8_chunks_upto=128", "linear.skinny_upto=0"), GEMM_FACTS, {1: "i8_wgmma", 64: "i8_wgmma"}),
    # the prologue row (T <= i8_prologue_upto <= 16) stays; the chunks start above skinny_upto
    ((ON, "linear.i8_prologue_upto=16"), {**GEMM_FACTS, "i8_xq_fits": True},
     {16: "skinny_wi8_xq", 17: "skinny_wi8_chunks", 64: "skinny_wi8_chunks", 65: "i8_wgmma"}),
    ((ON,), {**GEMM_FACTS, "i8_xq_fits": True},
     {4: "skinny_wi8_xq", 5: "skinny_wi8", 17: "skinny_wi8_chunks", 65: "i8_wgmma"}),
    # the int8 GEMM's case only: without sm_90a the exact call keeps its range
    ((ON,), {**GEMM_FACTS, "sm_90a": False}, {16: "skinny_wi8", 17: "int_mm", 64: "int_mm"}),
])
def test_the_linear_tables_int8_case_gives_the_chunks_their_range(tune, facts, expect):
    t = parse_tune(list(tune))
    assert {T: dispatch.select("linear", T, facts, t).variant for T in expect} == expect


@pytest.mark.parametrize("op, ctas", [("multi_linear", 228), ("linear", 128), ("gate_up_silu", 1368)])
def test_which_launches_run_at_each_token_count(op, ctas):
    """Off: the prologue kernel up to 4, the quantiser and the int8 kernel up to 16, gemm_int8 (its quantiser and
    GEMMs) above.  On at 64: the quantiser and the chunked kernel at 17-64, cdiv(T, 16) chunks along y, no
    gemm_int8; from 65 as off."""
    off, on = _lower(op, OFF), _lower(op, ON)
    assert [s.name for s in off] == [s.name for s in on if not s.name.endswith("__c16")]
    for T in TOKENS:
        if T <= 4:
            assert _running(off, T) == _running(on, T) == [(f"{op}_xq", (ctas, 1, 1))], T
        elif T <= 16:
            assert _running(off, T) == _running(on, T) == [("quant_int8", (T, 1, 1)), (op, (ctas, 1, 1))], T
        elif T <= 64:
            assert [st for st, _ in _running(off, T)][0] == "quant_i8", T
            assert _running(on, T) == [("quant_int8", (T, 1, 1)), (f"{op}_chunks", (ctas, -(-T // 16), 1))], T
        else:
            assert _running(on, T) == _running(off, T) and _running(on, T)[0][0] == "quant_i8", T
    (chunked,) = [s for s in on if s.name.endswith("__c16")]
    (plain,) = [s for s in on if s.stage == op]
    assert chunked.name == f"{plain.name}__c16" and chunked.args == plain.args
    assert chunked.params == {**plain.params, "chunk": linear_skinny.SKINNY_MAX_TOKENS}
    assert chunked.block == plain.block and chunked.workspace == plain.workspace


def test_the_quantisers_rows_cover_the_chunks_and_gemm_int8s_workspaces_are_empty_there():
    off, on = _lower("multi_linear", OFF), _lower("multi_linear", "linear.i8_chunks_upto=128")
    (quant,) = [s for s in on if s.stage == "quant_int8"]
    for w in quant.workspace:
        # the rows of the chunks' range, none above it (gemm_int8 quantises into its own)
        assert [evaluate(w.shape[0], {"T": T}) for T in (5, 16, 17, 100, 128, 129)] == [5, 16, 17, 100, 128, 0]
    (quant_off,) = [s for s in off if s.stage == "quant_int8"]
    for w in quant_off.workspace:                                               # knob off: the skinny range's
        assert [evaluate(w.shape[0], {"T": T}) for T in (5, 16, 17, 128)] == [5, 16, 0, 0]
    gemm_on = [s for s in on if s.family == "gemm_int8"]
    gemm_off = [s for s in off if s.family == "gemm_int8"]
    assert [s.name for s in gemm_on] == [s.name for s in gemm_off] and gemm_on
    for a, b in zip(gemm_off, gemm_on):
        assert [w.name for w in a.workspace] == [w.name for w in b.workspace]
        for wa, wb in zip(a.workspace, b.workspace):
            env = lambda T: {"T": T, "SMS": 132}   # noqa: E731
            for T in (17, 64, 128):
                assert evaluate(wb.shape[0], env(T)) == 0, (wb.name, T)
            for T in (129, 300):
                assert evaluate(wb.shape[0], env(T)) == evaluate(wa.shape[0], env(T))
            assert wa.shape[1:] == wb.shape[1:]


def test_where_the_chunks_cover_the_prologues_skinny_range_the_quantiser_runs_for_them_alone():
    """i8_prologue_upto = 16: no T <= 16 kernel on the quantiser's rows; the quantiser runs at 17-64 only."""
    steps = _lower("linear", ON, "linear.i8_prologue_upto=16")
    assert _running(steps, 16) == [("linear_xq", (128, 1, 1))]
    assert _running(steps, 17) == [("quant_int8", (17, 1, 1)), ("linear_chunks", (128, 2, 1))]
    assert not [s for s in steps if s.stage == "linear"]


def test_off_the_int8_gemms_case_no_chunks():
    """No sm_90a (the exact call above the skinny kernel) and skinny_upto 0 (no skinny kernel): the knob moves
    nothing."""
    for steps in (_lower("linear", ON, arch="sm_80"), _lower("linear", ON, "linear.skinny_upto=0")):
        assert not any(isinstance(s, KernelLaunch) and "chunk" in s.params for s in steps)
    assert _lower("linear", ON, arch="sm_80") == _lower("linear", OFF, arch="sm_80")


def test_explain_names_the_chunks_row_and_the_norms_rows_feed_them(capsys):
    """V2-Lite W4A8 at b=32: every int8 linear runs its chunked kernel; those behind a norm read the norm's int8
    rows (linear.norm_int8: no quantiser launch), the others run the quantiser first.  b=128: gemm_int8."""
    assert main(["explain", LITE, "--weights", "w4a8", "--phase", "decode", "--tokens", "32,128",
                 "--tune", ON]) == 0
    out = capsys.readouterr().out
    d32, d128 = out.split("decode, T = 32 ", 1)[1].split("\n\n")[0], out.split("decode, T = 128 ", 1)[1]
    assert "runs   linear_skinny__bf16_wi8__k2048__o3072_576__c16\n" in d32   # q + kv_a: the norm's rows
    assert "runs   linear_skinny__bf16_qi8__k2048, linear_skinny__bf16_wi8__k2048__o2048__c16" in d32   # o
    for name in ("k2048__silu10944", "k10944__o2048", "k2048__silu2816", "k2816__o2048"):
        assert f"linear_skinny__bf16_wi8__{name}__c16" in d32, name
    assert "rms_norm__bf16__d2048__qi8" in d32 and "skinny_wi8_chunks [tokens 17..64]" in d32
    assert "gemm_int8" not in d32
    assert "__c16" not in d128 and "i8_wgmma [tokens 65..inf]" in d128


def _v2_lite_chunks(shape: str, upto: int = 128):
    from bench.perf_linear_fp8 import shapes
    from bench.perf_linear_int8 import lowered
    import ir
    m = ir.load_spec(LITE).model
    K, rows, silu = shapes(m)[shape]
    plain, chunked = [la for la in lowered(m, K, rows, silu, True, chunks=upto)[0]
                      if la.family == linear_skinny.FAMILY and not la.params["quant"]]
    return plain, chunked


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["q+kv_a", "o", "dense gate_up", "dense down", "shared gate_up", "shared down"])
def test_the_chunked_kernels_compile_without_spills(shape):
    """V2-Lite's int8 linears (ptxas -v, sm_90a): the chunk's offsets and its output pointers in shared memory
    add at most a few registers to the T <= 16 kernel's, under its two-CTA cap, and no spills."""
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    regs = []
    for la in _v2_lite_chunks(shape):
        src = render_launch(la)
        log = compile_cubin(src, la.name, options=("--ptxas-options=-v",)).log
        assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, log
        regs.append(int(re.search(r"Used (\d+) registers", log).group(1)))
    assert '#include "int8_chunks.cuh"' in src and "linear_i8_chunk<" in src
    assert regs[1] <= max(regs[0] + 4, 128), regs


@pytest.mark.slow
def test_the_decode_arena_holds_no_gemm_int8_workspaces_where_the_chunks_run():
    """V2-Lite W4A8: at b=32 the chunks' step places no i8_xq / i8_xs / i8_partials bytes; at b=128, above the
    chunks, the same arena as today."""
    from codegen.bundle import plan_spec
    from codegen.memplan import ArenaPlan, step_sizes
    from runtime.bench import bench_spec
    totals = {}
    for tune in ((OFF,), (ON,)):
        plan = plan_spec(bench_spec(LITE, "w4a8"), Options(tuning=parse_tune(list(tune))), strict=False).plans["decode"]
        arena = ArenaPlan(plan.arena)
        for b in (32, 128):
            lay = arena.layout(step_sizes("decode", b, plan), 2)
            i8_ws = sum(n for name, n in lay.nbytes.items() if name.rsplit("/", 1)[-1].startswith("i8_"))
            totals[tune, b] = (lay.total, i8_ws)
    assert totals[(ON,), 32][1] == 0 < totals[(OFF,), 32][1], totals
    assert totals[(ON,), 128] == totals[(OFF,), 128], totals
