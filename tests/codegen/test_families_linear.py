"""linear_skinny's lowering (CPU): which step serves a linear at which T, what the kernel binds,
and the lowering contract for a family that hands a node back to its library call."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

import ir
from codegen import families, sizes
from codegen.families import linear_skinny
from codegen.kernel import KernelLaunch, LibraryCall, Options, SizeRef, StrideRef, ValueRef, WeightRef
from codegen.lower import library_call, lower_graph
from codegen.tuning import LinearTuning
from ir.passes import run_pipeline

MAX = linear_skinny.SKINNY_MAX_TOKENS


@functools.lru_cache(maxsize=None)
def _graph(phase: str = "decode"):
    return run_pipeline(ir.build_graph(ir.load_spec("model_specs/deepseek_v2_lite.yaml"), phase))


def _steps(nid: str, dtype: str = "bf16"):
    return linear_skinny.lower(nid, _graph(), Options(dtype=dtype))


def test_the_kernel_serves_up_to_the_token_count_and_cublas_from_the_next_token():
    launch, call = _steps("L3.mla.q")
    assert isinstance(launch, KernelLaunch) and isinstance(call, LibraryCall)
    assert call.op == "multi_linear" and call.from_tokens == MAX + 1
    for T in (1, 2, 8, 9, MAX, MAX + 1, 64, 16384):
        grid = sizes.evaluate(launch.grid[0], {"T": T})
        assert (grid > 0) == (T <= MAX) and (grid > 0) != call.runs_at(T), T
        assert grid in (0, (3072 + 576) // 16)
    assert launch.block == (LinearTuning().warps * 32, 1, 1) and launch.smem == 0


def test_the_kernel_binds_x_its_row_stride_every_weight_and_output_in_order():
    launch, call = _steps("L3.mla.q")
    assert launch.name == "linear_skinny__bf16__k2048__o3072_576"
    assert [(a.name, a.ctype, a.ref) for a in launch.args] == [
        ("x", "const __nv_bfloat16*", ValueRef("L3.h_attn")), ("x_stride", "i64", StrideRef("L3.h_attn", 0)),
        ("w0", "const __nv_bfloat16*", WeightRef("model.layers.3.self_attn.q_proj.weight")),
        ("w1", "const __nv_bfloat16*", WeightRef("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")),
        ("y0", "__nv_bfloat16*", ValueRef("L3.mla.q")), ("y1", "__nv_bfloat16*", ValueRef("L3.mla.ckv")),
        ("T", "int", SizeRef("T"))]
    assert call.weights == ("model.layers.3.self_attn.q_proj.weight",
                            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight")
    assert call.outputs == ("L3.mla.q", "L3.mla.ckv")
    assert launch.params["rows"] == [3072, 576] and launch.params["K"] == 2048


def test_single_linears_the_head_and_every_dtype():
    (launch, call) = _steps("head.logits", "fp16")
    assert launch.name == "linear_skinny__fp16__k2048__o102400" and call.op == "linear"
    assert call.weights == ("lm_head.weight",) and call.outputs == ("logits",)
    assert sizes.evaluate(launch.grid[0], {"T": 1}) == 102400 // 16
    (launch, _) = _steps("L3.mla.y", "fp32")
    assert launch.params["act"] == "float" and launch.name == "linear_skinny__fp32__k2048__o2048"


def test_gate_up_silu_tiles_a_gate_and_an_up_row_per_output_column():
    """The dense FFN's gate + up (layer 0; the MoE layers' shared MLP runs in the expert kernels)."""
    launch, call = _steps("L0.dense_ffn.g")
    assert launch.name == "linear_skinny__bf16__k2048__silu10944" and launch.params["silu"]
    assert launch.params["rows"] == [10944, 10944]          # 8 gate + 8 up rows a tile: 8 columns
    assert sizes.evaluate(launch.grid[0], {"T": 3}) == 10944 // 8
    assert [(a.name, a.ref) for a in launch.args][2:5] == [
        ("w0", WeightRef("model.layers.0.mlp.gate_proj.weight")),
        ("w1", WeightRef("model.layers.0.mlp.up_proj.weight")), ("y0", ValueRef("L0.dense_ffn.a"))]
    assert call.op == "gate_up_silu" and call.call == "ir.ops.core.gate_up_silu_ref" and call.from_tokens == MAX + 1
    assert call.weights == ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")


def test_variants_are_named_apart():
    G = _graph()
    a = linear_skinny.lower("L3.mla.y", G, Options())[0]
    b = linear_skinny.lower("L3.mla.y", G, Options(), warps=16, row_tiles=1, unroll=2)[0]
    assert a.name != b.name and b.name.endswith("__w16r1u2") and b.block == (512, 1, 1)
    assert sizes.evaluate(linear_skinny.lower("L3.mla.y", G, Options(), row_tiles=2)[0].grid[0], {"T": 1}) == 2048 // 32


def test_an_fp32_linear_stays_with_cublas_at_every_token_count():
    spec = ir.load_spec("model_specs/deepseek_v2_lite.yaml")
    G = ir.build_graph(spec, "decode")    # before fuse_router: the router is an fp32 linear
    (call,) = linear_skinny.lower("L1.moe_ffn.router_logits", G, Options())
    assert isinstance(call, LibraryCall) and call.from_tokens == 1 and call.attrs["precision"] == "fp32"


def _fake(steps):
    return SimpleNamespace(__name__="codegen.families.fake", FAMILY="fake", TEMPLATE="x.cu.j2", OPS=("linear",),
                           lower=lambda nid, G, opts: steps(nid, G))


@pytest.mark.parametrize("make,match", [
    (lambda nid, G: [library_call(nid, G.nodes[nid], from_tokens=17)], "no launch serves fewer"),
    (lambda nid, G: [library_call(nid, G.nodes[nid]), library_call(nid, G.nodes[nid])], "at most one library call"),
    (lambda nid, G: [library_call("elsewhere", G.nodes[nid])], "not the node's own"),
])
def test_a_family_handing_a_node_back_keeps_the_contract(monkeypatch, make, match):
    fam = _fake(make)
    monkeypatch.setattr(families, "family_for_op", lambda op: fam if op == "linear" else None)
    with pytest.raises(TypeError, match=match):
        lower_graph(_graph(), Options(), strict=False)
