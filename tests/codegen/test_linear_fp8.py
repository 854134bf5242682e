"""linear_skinny with FP8 weights (CPU): its lowering (the kernel's name, its arguments binding the bytes
and the scale companions, the library call above 16 tokens marked as the FP8 fallback where the FP8 GEMM
cannot run, one-line errors for what it cannot take) and its machine code (NVRTC, sm_90): 16-byte weight
loads, e4m3 widened by the conversion unit, tensor-core HMMA, no spills.  Above 16 tokens on sm_90a:
tests/codegen/test_gemm_fp8.py."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, opcodes  # noqa: E402
from tiny import ROOT  # noqa: E402

import ir  # noqa: E402
from codegen.errors import LoweringError  # noqa: E402
from codegen.families import linear_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, LibraryCall, Options, WeightRef  # noqa: E402
from ir.formats import FP8, weight_format  # noqa: E402
from ir.ops import TType  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import single_op_graph  # noqa: E402

WEIGHT_LOAD = "LDG.E.NA.LTC128B.128.CONSTANT"


def _lite():
    return ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model


def _node(op="multi_linear", formats=(FP8.name, FP8.name), K=2048):
    x = {"x": TType(("T", K), "act")}
    if op == "multi_linear":
        G, nid = single_op_graph(_lite(), op, {"out_dims": [3072, 576]}, x, {"weight0": "q", "weight1": "kv_a"})
    elif op == "gate_up_silu":
        G, nid = single_op_graph(_lite(), op, {"out_dim": 10944}, x, {"gate": "g", "up": "u"})
    else:
        G, nid = single_op_graph(_lite(), op, {"out_dim": 2048}, x, {"weight": "o"})
    for name, fmt in zip(G.graph["weights"], formats):
        G.graph["weights"][name] = dataclasses.replace(G.graph["weights"][name], format=fmt)
    return G, nid


def test_weight_format_reads_the_bound_weights_format_else_the_activation_dtype():
    G, _ = _node(formats=(FP8.name, None))
    assert weight_format(G, "q") is FP8
    assert weight_format(G, "kv_a").name == "bf16" and weight_format(G, "kv_a", "fp16").name == "fp16"


def test_fp8_weights_lower_to_the_fp8_kernel_with_their_scales_and_the_fallback_above_without_sm_90a():
    G, nid = _node()
    launch, call = linear_skinny.lower(nid, G, Options(arch="sm_80"))
    assert isinstance(launch, KernelLaunch) and isinstance(call, LibraryCall)
    assert launch.name == "linear_skinny__bf16_wfp8__k2048__o3072_576"
    assert launch.params["wfmt"] == FP8.name and launch.params["rolling"]
    assert (launch.params["unroll"], launch.params["min_blocks"]) == (4, 2)
    bound = {a.name: (a.ctype, a.ref) for a in launch.args}
    assert bound["w0"] == ("const unsigned char*", WeightRef("q"))
    assert bound["w1"] == ("const unsigned char*", WeightRef("kv_a"))
    assert bound["s0"] == ("const float*", WeightRef("q_scale_inv"))
    assert bound["s1"] == ("const float*", WeightRef("kv_a_scale_inv"))
    assert call.from_tokens == linear_skinny.SKINNY_MAX_TOKENS + 1 and call.attrs["weight_format"] == FP8.name
    assert call.weights == ("q", "kv_a")


def test_the_gate_up_runs_the_batch_pipeline_and_a_non_default_one_is_named():
    G, nid = _node("gate_up_silu")
    launch = linear_skinny.lower(nid, G, Options())[0]
    assert launch.name == "linear_skinny__bf16_wfp8__k2048__silu10944"
    assert not launch.params["rolling"] and launch.params["unroll"] == 1
    other = linear_skinny.lower(nid, G, Options(), pipeline="rolling", unroll=4)[0]
    assert other.name == "linear_skinny__bf16_wfp8__k2048__silu10944__w8r1u4_rolling" and other.params["rolling"]
    G, nid = _node(formats=(None, None))
    with pytest.raises(LoweringError, match="pipeline 'batch': FP8 weights only"):
        linear_skinny.lower(nid, G, Options(), pipeline="batch")


def test_bf16_weights_lower_as_before():
    G, nid = _node(formats=(None, None))
    launch, call = linear_skinny.lower(nid, G, Options())
    assert isinstance(call, LibraryCall) and call.from_tokens == linear_skinny.SKINNY_MAX_TOKENS + 1
    assert launch.name == "linear_skinny__bf16__k2048__o3072_576" and launch.params["wfmt"] == "bf16"
    assert "weight_format" not in call.attrs and not launch.params["s_args"]


@pytest.mark.parametrize("formats, dtype, message", [
    ((FP8.name, None), "bf16", "all in bf16 or all in fp8_e4m3_block128, got q: fp8_e4m3_block128, kv_a: bf16"),
    ((FP8.name, FP8.name), "fp32", "fp8_e4m3_block128 weights need bf16 or fp16 activations, not fp32"),
])
def test_what_the_kernel_cannot_take_is_one_line(formats, dtype, message):
    G, nid = _node(formats=formats)
    with pytest.raises(LoweringError, match=message):
        linear_skinny.lower(nid, G, Options(dtype=dtype))


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op, dtype", [("multi_linear", "bf16"), ("gate_up_silu", "bf16"), ("linear", "fp16")])
def test_the_fp8_kernel_widens_16_byte_loads_in_registers_for_the_tensor_cores(op, dtype):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    G, nid = _node(op, (FP8.name, FP8.name))
    launch = linear_skinny.lower(nid, G, Options(dtype=dtype))[0]
    res = compile_cubin(render_launch(launch), launch.name, options=("--ptxas-options=-v",))
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
    ops = opcodes(res.cubin)
    hmma = "HMMA.16816.F32.BF16" if dtype == "bf16" else "HMMA.16816.F32"
    assert ops[hmma] > 0 and ops[WEIGHT_LOAD] > 0, sorted(ops)
    assert ops["F2FP.F16.E4M3.UNPACK_B"] > 0, "e4m3 pairs are widened by the conversion instruction"
    assert not any(op_.startswith(("LDGSTS", "LDSM", "UBLKCP")) for op_ in ops), "weights go straight to registers"
