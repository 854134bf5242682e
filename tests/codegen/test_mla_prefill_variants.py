"""The tensor-core prefill attention's tiles (Tuning.attention.prefill_tile): v2 at its default
tile is what bf16 / fp16 lower to; each MlaPrefillTC2 tile lowers to its own kernel name,
its shared-memory size agrees with the template's static_assert (NVRTC, sm_90, on the CPU), and at
V2-Lite's dims it runs on HMMA without register spills."""
from __future__ import annotations

import functools
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
from harness import single_op_graph, tiny_model  # noqa: E402
from sass import cuobjdump, opcodes  # noqa: E402

import ir  # noqa: E402
from codegen.errors import LoweringError  # noqa: E402
from codegen.families import mla_prefill_attention as fam  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.nvrtc import compile_cubin  # noqa: E402
from codegen.render import render_launch  # noqa: E402
from codegen.tuning import AttentionTuning, Tuning, TuningError  # noqa: E402
from ir.ops import TType  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HMMA = {"bf16": "HMMA.16816.F32.BF16", "fp16": "HMMA.16816.F32"}


@functools.lru_cache(maxsize=None)
def _graph(name: str):
    if name == "lite":
        m = ir.load_spec(os.path.join(ROOT, "model_specs", "deepseek_v2_lite.yaml")).model
    else:   # every width odd that may be (R is even: rotary pairs): the gather path, padded tiles
        m = tiny_model(hidden=41, heads=3, kv_lora_rank=21, qk_rope_head_dim=6, qk_nope_head_dim=33,
                       v_head_dim=19, intermediate=37, moe_intermediate=15)
    d = m.dims
    H, N, R, V = d["heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    a = lambda *s: TType(("T", *s), "act")  # noqa: E731
    return single_op_graph(m, "mla_prefill_attention", {}, {"qn": a(H, N), "qr": a(H, R), "kv": a(H * (N + V)),
                                                            "kr": a(R)}, {})


DEFAULT_TILE = AttentionTuning().prefill_tile


def _lower(name: str, dtype: str, variant: str):
    G, nid = _graph(name)
    tuning = Tuning(attention=AttentionTuning(prefill_tile=variant))
    (launch,) = fam.lower(nid, G, Options(dtype=dtype, tuning=tuning))
    return launch


def test_the_default_tile_and_a_tile_the_tuning_refuses():
    # the default tile measured fastest at 1x2048 on the H200
    assert DEFAULT_TILE == "v2_m64n64w16q"
    G, nid = _graph("lite")
    (default,) = fam.lower(nid, G, Options(dtype="bf16"))
    assert default.name == "mla_prefill_attention__bf16__h16_n128_r64_v128__mma__v2_m64n64w16q"
    assert default.block == (128, 1, 1) and default.params["tc2"]["name"] == DEFAULT_TILE
    with pytest.raises(TuningError, match="attention.prefill_tile 'v1'"):
        _lower("lite", "bf16", "v1")


def test_variant_spellings():
    t = fam.tc_variant("v2_m128n32w32sb2")
    assert (t.bm, t.bn, t.wm, t.qreg, t.minb, t.threads) == (128, 32, 32, False, 2, 128)
    assert t.name == "v2_m128n32w32sb2"
    for bad in ("v1", "v3", "v2_m64n64w8q", "v2_m48n64w32q", "v2_m64n40w16q", "v2_m64n0w16q", "v2_m64n64w16"):
        with pytest.raises(LoweringError):
            fam.tc_variant(bad)


def test_fp32_ignores_the_variant():
    launch = _lower("lite", "fp32", DEFAULT_TILE)
    assert "mma" not in launch.name and "tc2" not in launch.params


@pytest.mark.parametrize("name,dtype,variant", [
    ("lite", "bf16", DEFAULT_TILE),
    ("lite", "fp16", "v2_m128n32w32s"),
    ("lite", "bf16", "v2_m64n32w16qb3"),
    ("odd", "fp16", DEFAULT_TILE),
    ("odd", "bf16", "v2_m64n32w32s"),
])
@pytest.mark.slow
def test_tc2_compiles(name, dtype, variant):
    launch = _lower(name, dtype, variant)
    tile = fam.tc_variant(variant)
    assert launch.name.endswith(f"__mma__{tile.name}")
    assert launch.block == (tile.threads, 1, 1) and launch.grid[0] == f"cdiv(MAXQ, {tile.bm})"
    src = render_launch(launch)
    assert src == render_launch(launch) and "MlaPrefillTC2<" in src
    # the template static_asserts Attn::SMEM == the lowering's size
    res = compile_cubin(src, launch.name, arch="sm_90", options=("--ptxas-options=-v",),
                        template=launch.template, nodes=launch.nodes)
    if name == "lite":
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        regs = int(re.search(r"Used (\d+) registers", res.log).group(1))
        assert regs * tile.threads * max(tile.minb, 1) <= 64 * 1024, f"{regs} registers x {tile.threads} threads"
    if cuobjdump() is not None:
        assert opcodes(res.cubin)[HMMA[dtype]] > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_sequences_keys_start_where_its_keys_attribute_says(dtype):
    """keys=step binds the kernel's key_start to the queries' own rows (query_start); keys=context
    to the packed context rows (key_start, mla_gather_context's); the kernel is the same."""
    from codegen.kernel import CtxRef
    from ir.passes.rewrite import copy_graph
    G, nid = _graph("lite")
    (step,) = fam.lower(nid, G, Options(dtype=dtype))
    H = copy_graph(G)
    H.nodes[nid]["attrs"]["keys"] = "context"
    (context,) = fam.lower(nid, H, Options(dtype=dtype))
    bound = lambda launch: next(a.ref for a in launch.args if a.name == "key_start")  # noqa: E731
    assert bound(step) == CtxRef("query_start") and bound(context) == CtxRef("key_start")
    assert step.name == context.name and step.params == context.params
