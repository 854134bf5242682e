"""The dense and MLA attention families lower from graph nodes, render byte-deterministically
and compile to sm_90 CUBINs with NVRTC (no GPU needed) for every dtype and the V2-Lite, V3
and small odd dims."""
import functools
import os
import sys

import pytest

import ir
from codegen.families import family_for_op
from codegen.kernel import Options
from codegen.nvrtc import compile_cubin
from codegen.render import render_launch
from ir.ops import TType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
from harness import single_op_graph, tiny_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS_UNDER_TEST = ("embedding", "rms_norm", "fused_add_rms_norm", "add", "silu_and_mul", "rope_q",
                  "mla_kv_cache_write", "mla_decode_query", "mla_q_absorb", "mla_decode_prologue",
                  "mla_decode_attention", "mla_v_up", "mla_prefill_attention", "mla_gather_context")


@functools.lru_cache(maxsize=None)
def model(name):
    if name in ("deepseek_v2_lite", "deepseek_v3"):
        return ir.load_spec(os.path.join(ROOT, "model_specs", f"{name}.yaml")).model
    return tiny_model(hidden=40, heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=10,
                      v_head_dim=12, intermediate=30, moe_intermediate=30)


def graph_for(op, m):
    d = m.dims
    H, C, R, N, V, D = (d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"], d["qk_nope_head_dim"],
                        d["v_head_dim"], d["hidden"])
    a = lambda *s: TType(("T", *s), "act")  # noqa: E731
    table = {
        "embedding": ({"ids": TType(("T",), "i64")}, {"weight": "emb"}),
        "rms_norm": ({"x": a(D)}, {"weight": "w"}),
        "fused_add_rms_norm": ({"x": a(D), "r": a(D)}, {"weight": "w"}),
        "add": ({"x": a(D), "r": a(D)}, {}),
        "silu_and_mul": ({"g": a(d["moe_intermediate"]), "u": a(d["moe_intermediate"])}, {}),
        "rope_q": ({"q": a(H, R)}, {}),
        "mla_kv_cache_write": ({"c": a(C), "k": a(R)}, {"norm": "n"}),
        "mla_decode_query": ({"qn": a(H, N), "qp": a(H, R)}, {"kv_b": "kvb"}),
        "mla_q_absorb": ({"qn": a(H, N)}, {"kv_b": "kvb"}),
        "mla_decode_prologue": ({"qn": a(H, N), "qp": a(H, R), "c": a(C), "k": a(R)}, {"kv_b": "kvb", "norm": "n"}),
        "mla_decode_attention": ({"ql": a(H, C), "qr": a(H, R), "st": TType(("cache",), "state")}, {}),
        "mla_v_up": ({"ol": a(H, C)}, {"kv_b": "kvb"}),
        "mla_prefill_attention": ({"qn": a(H, N), "qr": a(H, R), "kv": a(H * (N + V)), "kr": a(R)}, {}),
        "mla_gather_context": ({"st": TType(("cache",), "state")}, {}),
    }
    ins, ws = table[op]
    return single_op_graph(m, op, {}, ins, ws)


@pytest.mark.parametrize("op", OPS_UNDER_TEST)
def test_family_claims_op(op):
    fam = family_for_op(op)
    assert fam is not None and op in fam.OPS
    assert os.path.isfile(os.path.join(ROOT, "templates", fam.TEMPLATE))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
# the odd widths (the smallest model, every edge case of the rendering) in the quick tier
@pytest.mark.parametrize("model_name", [pytest.param("deepseek_v2_lite", marks=pytest.mark.slow),
                                        pytest.param("deepseek_v3", marks=pytest.mark.slow), "odd"])
@pytest.mark.parametrize("op", OPS_UNDER_TEST)
def test_lowers_renders_and_compiles(op, model_name, dtype):
    G, nid = graph_for(op, model(model_name))
    opts = Options(dtype=dtype, block_size=64)
    launches = family_for_op(op).lower(nid, G, opts)
    assert launches and len({l.name for l in launches}) == len(launches)
    assert launches == family_for_op(op).lower(nid, G, opts)   # lowering is deterministic
    for launch in launches:
        src = render_launch(launch)
        assert src == render_launch(launch)
        assert f"{launch.name}(" in src and dtype in launch.name
        cubin = compile_cubin(src, launch.name, arch="sm_90", template=launch.template, nodes=launch.nodes).cubin
        assert launch.name.encode() in cubin       # the cubin exports the launch's kernel


def test_decode_attention_page_size_is_in_the_name():
    G, nid = graph_for("mla_decode_attention", model("deepseek_v2_lite"))
    # the S = 1 launch carries the plain name; the split ones add __s<S>
    names = {family_for_op("mla_decode_attention").lower(nid, G, Options(block_size=bs))[-1].name for bs in (16, 64)}
    assert names == {"mla_decode_attention__bf16__c512_r64__h16__page16",
                     "mla_decode_attention__bf16__c512_r64__h16__page64"}
