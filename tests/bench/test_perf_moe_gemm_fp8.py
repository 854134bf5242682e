"""bench/perf_moe_gemm_fp8.py on the CPU: at prefill's token counts it times the launches the lowering runs
(bf16: the persistent wgmma grid; FP8: the quantiser, then the FP8 x FP8 grid); --tune lowers its FP8 arm with
the knobs (moe.fp8_overlap=false: the plain K loop's GEMM, where the default is the ovl one)."""
from __future__ import annotations

from bench import perf_moe_gemm_fp8 as pm
from codegen.tuning import parse_tune


def test_the_bench_times_the_lowerings_prefill_launches():
    for op, KD, N in pm.OPS:
        bf16 = pm.running(pm.graph(op, KD, N, False)[2], 16384, 132)
        fp8 = pm.running(pm.graph(op, KD, N, True)[2], 16384, 132)
        assert [la.stage for la in bf16] == ["wgmma"]
        assert [la.stage for la in fp8] == ["quant_x", "wgmma_fp8"] and "_wfp8_afp8" in fp8[1].name
        assert [a.name for a in fp8[0].args[2:4]] == ["xq", "xs"]      # the bench reads the workspaces there


def test_the_tuned_arm_lowers_with_its_knobs():
    tuning = parse_tune(["moe.fp8_overlap=false"])
    for op, KD, N in pm.OPS:
        base = pm.running(pm.graph(op, KD, N, True)[2], 16384, 132)
        tuned = pm.running(pm.graph(op, KD, N, True, tuning)[2], 16384, 132)
        assert [la.stage for la in tuned] == [la.stage for la in base]
        assert tuned[0].name == base[0].name and base[1].name == tuned[1].name.replace("__wgmma_fp8", "__ovl__wgmma_fp8")
