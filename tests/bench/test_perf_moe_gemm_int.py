"""bench/perf_moe_gemm_int.py on the CPU: at prefill's token counts it times the launches the lowering runs with
Tuning.moe.int_wgmma_above off (the int8 quantiser, then mma_int) and on (the same quantiser, then wgmma_int),
the quantiser first in both (the bench times launches[1:] as the GEMM alone); below the knob both arms are
mma_int."""
from __future__ import annotations

from bench import perf_moe_gemm_int as pm
from codegen.tuning import Tuning


def test_the_bench_times_the_lowerings_prefill_launches():
    for op, KD, N in pm.OPS:
        for fmt in pm.FMTS:
            off = pm.at(pm.lowered(op, KD, N, fmt, Tuning())[2], 16384)
            on = pm.at(pm.lowered(op, KD, N, fmt, pm.ON)[2], 16384)
            assert [la.stage for la in off] == ["quant_i8", "mma_int"]
            assert [la.stage for la in on] == ["quant_i8", "wgmma_int"] and on[0].name == off[0].name
            assert [la.stage for la in pm.at(pm.lowered(op, KD, N, fmt, pm.ON)[2], 64)] == ["quant_i8", "mma_int"]
