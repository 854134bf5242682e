"""kv_b in FP8 (fp8_e4m3_block128) on the cuda backend: the absorbed decode ops (mla_decode_prologue,
mla_decode_query, mla_q_absorb, mla_v_up) lower to their FP8 tensor-core kernels (names carry "wfp8",
kv_b's bytes and its block scales as arguments, dispatch rows mma_kv_fp8 / mma_fp8), so a V2-Lite or V3
spec with DeepSeek-V3's FP8 weights lowers in both phases with nothing left over and `dsgraph explain`
names every FP8 kernel; what no FP8 kernel serves (fp32, dims off the tensor-core tiling) is one line;
the kernels compile for sm_90a without spills (HMMA fed by the e4m3 unpack, no local memory); the
reference semantics of the ops are the plain ops on the dequantised kv_b."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
from harness import single_op_graph, tiny_model  # noqa: E402
from sass import cuobjdump, instructions  # noqa: E402
from test_sass_pdl import wait_problem  # noqa: E402
from tiny import ROOT  # noqa: E402

import ir  # noqa: E402
from codegen import dispatch, families  # noqa: E402
from codegen.errors import LoweringError  # noqa: E402
from codegen.kernel import KernelLaunch, Options, WeightRef  # noqa: E402
from codegen.lower import lower_graph  # noqa: E402
from ir.formats import FP8, FP8_CHECKPOINT_GLOBS, dequantize, quantize, set_format, weight_formats_yaml  # noqa: E402
from ir.graph import node_view  # noqa: E402
from ir.ops import OPS, TType  # noqa: E402
from ir.passes import run_pipeline  # noqa: E402
from runtime.cli import main  # noqa: E402

KV_B_OPS = ("mla_decode_prologue", "mla_decode_query", "mla_q_absorb", "mla_v_up")
FP8_FACTS = {"weight_format": FP8.name, "mma": True}


def _fp8_spec_text(name: str) -> str:
    """A shipped spec with DeepSeek-V3's FP8 weights (what weight_format="fp8" and spec --from-config of an
    FP8 checkpoint give): every decoder linear, kv_b_proj among them."""
    return (ROOT / "model_specs" / f"{name}.yaml").read_text() + weight_formats_yaml(FP8_CHECKPOINT_GLOBS, FP8)


def _fp8_spec(name: str):
    return ir.load_spec(_fp8_spec_text(name), file=f"{name}.yaml")


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3"])
def test_an_fp8_spec_lowers_with_every_kv_b_op_on_its_fp8_kernel(name):
    spec = _fp8_spec(name)
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    for phase in ir.PHASES:
        G = run_pipeline(ir.build_graph(spec, phase))
        assert G.graph["weights"][kv_b].format == FP8.name
        plan = lower_graph(G, Options(dtype="bf16"))   # strict: raises on any node left over
        assert not plan.unlowered
        if phase != "decode":
            continue
        ops = {G.nodes[n]["op"] for n in G.nodes}
        assert {"mla_decode_prologue", "mla_v_up"} <= ops
        launches = [s for s in plan.steps
                    if isinstance(s, KernelLaunch) and s.family in ("mla_decode_query", "mla_v_up")]
        assert launches
        for la in launches:
            assert "_wfp8__" in la.name and la.params["fp8"] and la.params["mma"], la.name
            w = {a.name: a for a in la.args if isinstance(a.ref, WeightRef)}
            assert w["kv_b"].ctype == "const unsigned char*" and w["kv_b_s"].ctype == "const float*"
            assert w["kv_b_s"].ref.name == w["kv_b"].ref.name + "_scale_inv"


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_90"])
def test_prefills_kv_b_over_the_context_rows_is_the_dequantising_library_call(name, arch):
    """Prefill decompresses each sequence's gathered context (TK rows, not the step's T tokens) with one
    linear(kv_b): neither the skinny kernel nor the FP8 GEMM (their grids read T) but the library call
    marked FP8, which dequantises kv_b to the activation dtype before cuBLAS, at every row count."""
    from codegen.kernel import LibraryCall
    spec = _fp8_spec(name)
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    G = run_pipeline(ir.build_graph(spec, "prefill"))
    plan = lower_graph(G, Options(dtype="bf16", arch=arch))
    (nid,) = [n for n, d in G.nodes(data=True) if d["op"] == "linear" and kv_b in d["weights"].values()]
    assert G.graph["values"][G.nodes[nid]["inputs"][0]].shape[0] == "TK"
    steps = [s for s in plan.steps if nid in (s.nodes if isinstance(s, KernelLaunch) else (s.node,))]
    assert len(steps) == 1 and isinstance(steps[0], LibraryCall), steps
    (call,) = steps
    assert call.weights == (kv_b,) and call.from_tokens == 1, call
    assert call.attrs.get("weight_format") == FP8.name, call


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3"])
def test_explain_names_the_fp8_kernels(name, tmp_path, capsys):
    spec = tmp_path / f"{name}_fp8.yaml"
    spec.write_text(_fp8_spec_text(name))
    assert main(["explain", str(spec), "--tokens", "1,64", "--phase", "decode"]) == 0
    out = capsys.readouterr().out
    for T, query_row in ((1, "mma_kv_fp8 [tokens 1..16]"), (64, "mma_fp8 [tokens 17..inf]")):
        block = out.split(f"decode, T = {T} ", 1)[1].split("\n\n", 1)[0]
        prologue = block.split("mla_decode_prologue", 1)[1].split("\n  mla_decode_attention", 1)[0]
        assert re.search(r"runs   mla_decode_query__bf16_wfp8__h\d+_n128_c512__", prologue), prologue
        assert query_row in prologue and "128-block scale" in prologue, prologue
        v_up = block.split("  mla_v_up", 1)[1].split("\n  linear", 1)[0]
        assert "runs   mla_v_up__bf16_wfp8__h" in v_up and "mma_fp8 [tokens 1..inf]" in v_up, v_up


def _node(op: str, m, *, fp8: bool = True):
    d = m.dims
    H, N, R, C = d["heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["kv_lora_rank"]
    heads = lambda n: TType(("T", H, n), "act")   # noqa: E731
    if op == "mla_v_up":
        G, nid = single_op_graph(m, op, {}, {"o_lat": heads(C)}, {"kv_b": "kvb"}, phase="decode")
    elif op == "mla_q_absorb":
        G, nid = single_op_graph(m, op, {}, {"q_nope": heads(N)}, {"kv_b": "kvb"}, phase="decode")
    elif op == "mla_decode_query":
        G, nid = single_op_graph(m, op, {"pairs": "adjacent", "output": "interleaved"},
                                 {"q_nope": heads(N), "q_pe": heads(R)}, {"kv_b": "kvb"}, phase="decode")
    else:
        G, nid = single_op_graph(m, op, {"pairs": "adjacent", "output": "interleaved"},
                                 {"q_nope": heads(N), "q_pe": heads(R), "c": TType(("T", C), "act"),
                                  "k_pe": TType(("T", R), "act")}, {"kv_b": "kvb", "norm": "n"}, phase="decode")
    if fp8:
        set_format(G.graph["weights"], "kvb", FP8)
    return G, nid


# tc16: N 16, C 160 (a ceil column block of 32), 56 rows a head (heads cross the 128-row blocks)
TC16 = dict(hidden=40, heads=3, kv_lora_rank=160, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=40,
            intermediate=40, moe_intermediate=16)
# odd: N 10, C 20 (off the tensor-core tiling)
ODD = dict(hidden=40, heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=10, v_head_dim=12,
           intermediate=30, moe_intermediate=30)


@pytest.mark.parametrize("op", KV_B_OPS)
def test_fp8_kv_b_lowers_to_the_fp8_tensor_core_kernel(op):
    G, nid = _node(op, tiny_model(**TC16))
    steps = families.family_for_op(op).lower(nid, G, Options(dtype="fp16"))
    la = steps[0]
    assert la.name.startswith(f"{la.family}__fp16_wfp8__") and "__mma_" in la.name and la.params["fp8"]
    G16, nid16 = _node(op, tiny_model(**TC16), fp8=False)
    plain = families.family_for_op(op).lower(nid16, G16, Options(dtype="fp16"))[0]
    assert la.name == plain.name.replace("__fp16__", "__fp16_wfp8__", 1) and not plain.params["fp8"]
    assert la.grid == plain.grid and la.block == plain.block


@pytest.mark.parametrize("op", KV_B_OPS)
@pytest.mark.parametrize("model,dtype", [(TC16, "fp32"), (ODD, "bf16")])
def test_what_no_fp8_kernel_serves_is_one_line(op, model, dtype):
    G, nid = _node(op, tiny_model(**model))
    with pytest.raises(LoweringError) as info:
        families.family_for_op(op).lower(nid, G, Options(dtype=dtype))
    msg = str(info.value)
    assert "\n" not in msg and nid in msg and "FP8 kv_b needs bf16 or fp16 activations" in msg, msg


def test_the_fp8_rows_serve_every_token_count():
    for T in (1, 2, 16, 17, 64, 256, 4096):
        assert dispatch.select("mla_v_up", T, FP8_FACTS).variant == "mma_fp8"
        want = "mma_kv_fp8" if T <= dispatch.DEFAULT_TUNING.attention.prologue_upto else "mma_fp8"
        assert dispatch.select("mla_decode_prologue", T, FP8_FACTS).variant == want
        assert dispatch.select("mla_v_up", T, {"weight_format": "same", "mma": True}).variant == "mma"
        assert dispatch.select("mla_v_up", T, {"weight_format": FP8.name, "mma": False}).variant == dispatch.NONE


@pytest.mark.parametrize("op", ["mla_decode_query", "mla_v_up"])
def test_the_reference_runs_the_op_on_the_dequantised_kv_b(op):
    """The reference interpreter (ir/interpret.py) gives an FP8 kv_b op the dequantised weight in the
    activation dtype: the kernel's weights are those values bit for bit (mla_absorb_fp8.cuh)."""
    from ir.interpret import bound_weight
    m = tiny_model(**TC16)
    G, nid = _node(op, m)
    d = m.dims
    H, N, V, C = d["heads"], d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    gen = torch.Generator().manual_seed(5)
    q, (s,) = quantize(torch.randn(H * (N + V), C, generator=gen) * 0.1, FP8)
    weights = {"kvb": q, "kvb_scale_inv": s}
    x = torch.randn(4, H, C if op == "mla_v_up" else N, generator=gen).to(torch.bfloat16)
    w = bound_weight(G, weights, "kvb", [x])
    assert w.dtype == torch.bfloat16 and torch.equal(w, dequantize(q, [s], FP8).to(torch.bfloat16))
    if op == "mla_v_up":
        out = OPS[op].run(node_view(G, nid), [x], {"kv_b": w}, None)[0]
        plain = torch.einsum("thc,hvc->thv", x, w.view(H, N + V, C)[:, N:]).reshape(4, -1)
        assert torch.equal(out, plain)


def _absorb_launches(spec, dtype: str) -> list:
    """The decode plan's absorbed-projection launches (one per kernel), in plan order."""
    plan = lower_graph(run_pipeline(ir.build_graph(spec, "decode")), Options(dtype=dtype))
    seen = {}
    for la in plan.steps:
        if isinstance(la, KernelLaunch) and la.family in ("mla_decode_query", "mla_v_up"):
            seen.setdefault(la.name, la)
    return list(seen.values())


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("name,dtype", [("deepseek_v2_lite", "bf16"), ("deepseek_v3", "fp16")])
def test_fp8_kernels_compile_for_sm90a_without_spills(name, dtype):
    """No spills; HMMA fed by the e4m3 unpack; local memory only where the 16-bit kernel has it too (the
    prologue's cache-write row keeps a 32-byte stack frame in both)."""
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    fp8 = _absorb_launches(_fp8_spec(name), dtype)
    plain = _absorb_launches(ir.load_spec(str(ROOT / "model_specs" / f"{name}.yaml")), dtype)
    assert len(fp8) == len(plain) == 2, [la.name for la in fp8]
    hmma = "HMMA.16816.F32.BF16" if dtype == "bf16" else "HMMA.16816.F32"

    def build(la):
        res = compile_cubin(render_launch(la), la.name, arch="sm_90a", options=("--ptxas-options=-v",))
        (body,) = instructions(res.cubin).values()
        return res, body

    for la, la16 in zip(fp8, plain):
        assert la.name == la16.name.replace(f"__{dtype}__", f"__{dtype}_wfp8__", 1)
        res, body = build(la)
        regs = re.findall(r"Used (\d+) registers", res.log)
        print(f"{la.name}: {regs[0]} registers")
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        ops = {i.opcode for i in body}
        assert hmma in ops and "F2FP.F16.E4M3.UNPACK_B" in ops, sorted(ops)
        local = sum(i.opcode.startswith(("LDL", "STL")) for i in body)
        local16 = sum(i.opcode.startswith(("LDL", "STL")) for i in build(la16)[1])
        assert local == local16, (la.name, local, local16)
        # the PDL contract (pdl.cuh): nothing but kv_b's bytes and scales read before the wait, no write
        assert wait_problem(body, weight_loads=True) is None, (la.name, wait_problem(body, weight_loads=True))


@pytest.mark.parametrize("name", ["v2_lite", "v3"])
def test_the_gpu_end_to_end_fp8_checkpoints_lower_on_cuda(name, tmp_path):
    """tests/gpu/test_e2e_fp8.py's tiny checkpoints, written by `dsgraph quantize --to fp8`, lower on the
    cuda backend in both phases (strict: nothing left to the reference), their FP8 weights on FP8 kernels."""
    pytest.importorskip("transformers")
    import json

    from codegen.bundle import plan_spec
    from runtime.model_loader import resolve_spec
    from test_e2e_fp8 import write_fp8_checkpoint
    path = write_fp8_checkpoint(name, tmp_path)
    spec = resolve_spec(None, json.loads((path / "config.json").read_text()))
    sp = plan_spec(spec, Options(dtype="bf16"), strict=True)
    decode = {s.name.split("__")[0] for s in sp.plans["decode"].steps
              if isinstance(s, KernelLaunch) and "_wfp8__" in s.name}
    # gemm_fp8: the FP8 linears of decode batches above the skinny range (sm_90a)
    assert decode == {"linear_skinny", "gemm_fp8", "mla_decode_query", "mla_v_up", "moe_gate_up_silu",
                      "moe_down"}, decode
