"""bench/perf_linear_int8.py on the CPU: it times the launches the lowering runs (bf16: the skinny kernel;
int8: the quantiser then the int8 kernel, and the exact library call above the kernel's tokens)."""
from __future__ import annotations

import ir
from bench import perf_linear_int8 as pi
from bench.perf_linear_fp8 import shapes
from codegen.paths import DEFAULT_SPEC


def test_the_bench_times_the_lowerings_launches():
    m = ir.load_spec(str(DEFAULT_SPEC)).model
    for name, (K, rows, silu) in shapes(m).items():
        (bf16,), call, outs = pi.lowered(m, K, rows, silu, False)
        assert "weight_format" not in call.attrs and "_wi8" not in bf16.name
        (quant, int8), call, outs8 = pi.lowered(m, K, rows, silu, True)
        assert quant.stage == "quant_int8" and "_wi8__" in int8.name and outs8 == outs, name
        assert call.attrs["weight_format"] == pi.I8.name and quant.params["qrow"] == -(-K // 16) * 16
