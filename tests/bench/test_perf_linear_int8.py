"""bench/perf_linear_int8.py on the CPU: it times the launches the lowering runs (bf16: the skinny kernel;
int8: the quantiser then the int8 kernel, above the kernel's tokens the int8 GEMM's launches on sm_90a and
the exact library call elsewhere; with --prologue N the kernel that quantises x itself, alone, at T <= N;
with --chunks N the quantiser and the int8 kernel in 16-token chunks at 16 < T <= N)."""
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
        (quant, int8, gquant, *gemms), call, outs8 = pi.lowered(m, K, rows, silu, True)
        assert quant.stage == "quant_int8" and "_wi8__" in int8.name and outs8 == outs, name
        assert call is None and gquant.stage == "quant_i8" and gemms and all(g.stage == "i8_wgmma" for g in gemms)
        assert quant.params["qrow"] == -(-K // 16) * 16
        (quant, int8), call, _ = pi.lowered(m, K, rows, silu, True, arch="sm_89")
        assert call.attrs["weight_format"] == pi.I8.name and call.from_tokens == int8.params["max_tokens"] + 1


def test_with_a_prologue_the_bench_times_the_one_launch_that_runs():
    m = ir.load_spec(str(DEFAULT_SPEC)).model
    K, rows, silu = shapes(m)["q+kv_a"]
    launches, _, _ = pi.lowered(m, K, rows, silu, True, prologue=4)
    for T in (1, 4):
        (xq,) = pi.at_tokens(launches, T)
        assert xq.params["xq"] == 4 and not xq.workspace, T
    assert [la.stage for la in pi.at_tokens(launches, 5)] == ["quant_int8", "multi_linear"]
    assert [la.stage for la in pi.at_tokens(pi.lowered(m, K, rows, silu, True)[0], 1)] == ["quant_int8", "multi_linear"]


def test_with_chunks_the_bench_times_the_quantiser_and_the_chunked_kernel():
    m = ir.load_spec(str(DEFAULT_SPEC)).model
    K, rows, silu = shapes(m)["dense down"]
    launches, _, _ = pi.lowered(m, K, rows, silu, True, chunks=128)
    for T in (32, 64, 128):
        quant, chunked = pi.at_tokens(launches, T)
        assert quant.stage == "quant_int8" and chunked.stage == "linear_chunks" and chunked.name.endswith("__c16"), T
    assert [la.stage for la in pi.at_tokens(launches, 129)] == ["quant_i8", "i8_wgmma"]
