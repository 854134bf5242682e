"""linear_skinny with msModelSlim's int8 weights (int8_channel, W8A8_DYNAMIC) on the CPU: its dispatch rows,
its lowering (the quantiser's launch, the int8 kernel's, their workspaces, the exact library call above 16
tokens where the int8 GEMM cannot run: a target without sm_90a; tests/codegen/test_gemm_int8.py has the
GEMM), one-line refusals, a whole int8 spec lowering, and its machine code (NVRTC sm_90 and sm_90a):
IMMA s8 x s8 with int32 accumulators, 16-byte weight loads, no spills or local memory, the quantiser's
correctly rounded division and round-to-nearest conversion, the epilogue's separate multiplies."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, opcodes  # noqa: E402
from tiny import ROOT  # noqa: E402

import ir  # noqa: E402
from codegen import dispatch, sizes  # noqa: E402
from codegen.errors import LoweringError  # noqa: E402
from codegen.families import linear_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, LibraryCall, Options, WeightRef, WorkspaceRef  # noqa: E402
from codegen.tuning import LinearTuning, Tuning  # noqa: E402
from ir.ops import TType  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import single_op_graph  # noqa: E402

I8 = "int8_channel"
# the int8 readers' own quantiser launches (the prologue and the norms' rows have their own tests)
# ... and gemm_int8 from 17 tokens: the skinny kernel's 16-token chunks (on at 32 by default) off
QUANT = Tuning(linear=LinearTuning(i8_prologue_upto=0, norm_int8=False, i8_chunks_upto=0))
NO_90A = Options(arch="sm_89", tuning=QUANT)   # no wgmma: the exact library call serves above the skinny range
WEIGHT_LOAD = "LDG.E.NA.LTC128B.128.CONSTANT"


def _lite():
    return ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model


def _node(op="multi_linear", formats=(I8, I8), K=2048):
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


def test_the_linear_table_has_int8_rows_at_16_bit_and_none_at_fp32():
    facts = {"precision": "act", "weight_format": I8, "dtype": "bf16"}
    assert dispatch.select("linear", 1, facts).variant == "skinny_wi8"
    assert dispatch.select("linear", 16, facts).variant == "skinny_wi8"
    above = dispatch.select("linear", 17, facts)
    assert above.variant == "int_mm" and "NOT a tuned GEMM" in above.reason and "exact" in above.reason
    gemm = dispatch.select("linear", 17, {**facts, "sm_90a": True, "i8_rows": True, "i8_fits": True}, QUANT)
    assert gemm.variant == "i8_wgmma" and "bit-equal" in gemm.reason and gemm.span == "17..inf"
    for missing in ("sm_90a", "i8_rows", "i8_fits"):
        wanting = {**facts, "sm_90a": True, "i8_rows": True, "i8_fits": True, missing: False}
        assert dispatch.select("linear", 17, wanting).variant == "int_mm", missing
    assert dispatch.select("gate_up_silu", 1, {**facts, "dtype": "fp32"}).variant == dispatch.NONE
    assert dispatch.select("linear", 1, {**facts, "weight_format": "same"}).variant == "skinny"
    off = Tuning(linear=LinearTuning(skinny_upto=0))
    assert [r.variant for r in dispatch.rows("linear", facts, off)] == ["int_mm"]


def test_int8_weights_lower_to_the_quantiser_the_int8_kernel_and_the_exact_call_above_without_sm_90a():
    G, nid = _node()
    quant, launch, call = linear_skinny.lower(nid, G, NO_90A)
    assert isinstance(quant, KernelLaunch) and isinstance(launch, KernelLaunch) and isinstance(call, LibraryCall)
    assert quant.name == "linear_skinny__bf16_qi8__k2048" and quant.stage == "quant_int8"
    assert launch.name == "linear_skinny__bf16_wi8__k2048__o3072_576" and launch.stage == "multi_linear"
    assert quant.params["qrow"] == 2048 and quant.params["quant"] and not launch.params["quant"]
    assert quant.grid[0] == "T * (1 - min(1, T // 17))"
    assert launch.grid[0] == f"{(3072 + 576) // 16} * (1 - min(1, T // 17))"
    ws = {w.name: w for w in launch.workspace}
    assert quant.workspace == launch.workspace
    assert ws["x_int8"].shape[1] == 512 and ws["x_int8"].dtype == "i32" and ws["x_scale"].dtype == "f32"
    for w in (ws["x_int8"], ws["x_scale"]):       # the skinny range's rows, none above it (the GEMM has its own)
        assert [sizes.evaluate(w.shape[0], {"T": T}) for T in (1, 16, 17, 1000)] == [1, 16, 0, 0]
    qb = {a.name: (a.ctype, a.ref) for a in quant.args}
    assert qb["q"] == ("signed char*", WorkspaceRef("x_int8")) and qb["s"] == ("float*", WorkspaceRef("x_scale"))
    bound = {a.name: (a.ctype, a.ref) for a in launch.args}
    assert bound["xq"] == ("const signed char*", WorkspaceRef("x_int8"))
    assert bound["xs"] == ("const float*", WorkspaceRef("x_scale"))
    assert bound["w0"] == ("const signed char*", WeightRef("q"))
    assert bound["w1"] == ("const signed char*", WeightRef("kv_a"))
    assert bound["s0"] == ("const float*", WeightRef("q_scale"))
    assert bound["s1"] == ("const float*", WeightRef("kv_a_scale"))
    assert call.from_tokens == linear_skinny.SKINNY_MAX_TOKENS + 1 and call.attrs["weight_format"] == I8
    assert call.weights == ("q", "kv_a")


def test_odd_widths_pad_the_quantised_rows_to_16_bytes():
    G, nid = _node("linear", (I8,), K=1001)
    quant, launch, _ = linear_skinny.lower(nid, G, Options(dtype="fp16", tuning=QUANT))   # K % 16 != 0: no int8 GEMM
    assert quant.params["qrow"] == 1008 and launch.workspace[0].shape[1] == 252
    assert launch.name == "linear_skinny__fp16_wi8__k1001__o2048"


def test_a_non_default_shape_is_named_and_the_silu_takes_gate_and_up():
    G, nid = _node("gate_up_silu")
    _, launch, call = linear_skinny.lower(nid, G, NO_90A, warps=4, unroll=2)
    assert launch.name == "linear_skinny__bf16_wi8__k2048__silu10944__w4r1u2" and launch.params["silu"]
    bound = {a.name: a.ref for a in launch.args}
    assert bound["s0"] == WeightRef("g_scale") and bound["s1"] == WeightRef("u_scale")
    assert call.call == "ir.ops.core.gate_up_silu_ref" and call.attrs["weight_format"] == I8


def test_skinny_upto_zero_leaves_only_the_exact_call_without_sm_90a():
    G, nid = _node()
    (call,) = linear_skinny.lower(nid, G, Options(arch="sm_89", tuning=Tuning(linear=LinearTuning(skinny_upto=0))))
    assert isinstance(call, LibraryCall) and call.from_tokens == 1 and call.attrs["weight_format"] == I8


@pytest.mark.parametrize("formats, opts, message", [
    ((I8, None), Options(tuning=QUANT), "all in bf16 or all in int8_channel, got q: int8_channel, kv_a: bf16"),
    ((I8, "fp8_e4m3_block128"), Options(tuning=QUANT), "got q: int8_channel, kv_a: fp8_e4m3_block128"),
    ((I8, I8), Options(dtype="fp32"), "int8 weights need bf16 or fp16 activations, not fp32"),
    ((I8, I8), Options(tuning=Tuning(linear=LinearTuning(ksplit=2))), "splits K inside a CTA only"),
])
def test_what_the_int8_kernel_cannot_take_is_one_line(formats, opts, message):
    G, nid = _node(formats=formats)
    with pytest.raises(LoweringError, match=message) as info:
        linear_skinny.lower(nid, G, opts)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kw", [{"ksplit": 4}, {"pipeline": "batch"}])
def test_fp8s_and_clusters_knobs_are_refused_for_int8_weights(kw):
    G, nid = _node()
    with pytest.raises(LoweringError, match="no load pipelines"):
        linear_skinny.lower(nid, G, Options(tuning=QUANT), **kw)


def _int8_spec_text() -> str:
    """The tiny spec with attention's projections, the dense FFN and the shared experts in int8 (routed
    experts float, kv_b float)."""
    from ir.config_to_spec import spec_from_config
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    formats = ('\nweight_formats:\n  "model.layers.*.self_attn.kv_b_proj.weight": act\n'
               '  "model.layers.*.self_attn.*_proj*.weight": int8_channel\n'
               '  "model.layers.*.mlp.shared_experts.*": int8_channel\n  "model.layers.0.mlp.*": int8_channel\n')
    return spec_from_config(tiny, name="tiny") + formats


def test_a_spec_with_int8_linears_lowers_every_phase():
    """Every int8 node lowers to its skinny steps and, above them, the int8 GEMM's (sm_90a: the tiny spec's
    widths are multiples of 16) or the exact call (without sm_90a); kv_b stays float."""
    from codegen.lower import lower_graph
    from ir.passes import run_pipeline
    spec = ir.load_spec(_int8_spec_text(), file="t.yaml")
    for phase in ("decode", "prefill"):
        for opts in (Options(tuning=QUANT), NO_90A):
            plan = lower_graph(run_pipeline(ir.build_graph(spec, phase)), opts)
            launches = [s for s in plan.steps if isinstance(s, KernelLaunch)]
            quant = [s for s in launches if s.stage == "quant_int8"]
            kern = [s for s in launches if s.family == linear_skinny.FAMILY and "_wi8__" in s.name]
            gemm_quant = [s for s in launches if s.stage == "quant_i8"]
            calls = [s for s in plan.steps if isinstance(s, LibraryCall) and s.attrs.get("weight_format") == I8]
            above = calls if opts is NO_90A else gemm_quant
            assert quant and len(quant) == len(kern) == len(above), (phase, opts.arch)
            assert not (gemm_quant if opts is NO_90A else calls), (phase, opts.arch)
            assert not any("kv_b_proj" in w for c in calls for w in c.weights)


def test_an_int8_linear_over_rows_other_than_the_steps_tokens_is_the_exact_call_alone():
    """A linear over rows other than the step's T tokens (as prefill's linear(kv_b) reads the TK gathered
    context rows; the verifier keeps kv_b itself float or FP8): the quantiser's and the int8 kernel's grids
    read T, so int8 weights there lower to the exact library call at every row count."""
    G, nid = single_op_graph(_lite(), "linear", {"out_dim": 2048}, {"x": TType(("TK", 512), "act")},
                             {"weight": "o"})
    for name in G.graph["weights"]:
        G.graph["weights"][name] = dataclasses.replace(G.graph["weights"][name], format=I8)
    (call,) = linear_skinny.lower(nid, G, Options(tuning=QUANT))
    assert isinstance(call, LibraryCall) and call.attrs["weight_format"] == I8 and call.from_tokens == 1, call


def test_an_int8_bundle_keeps_its_steps_through_the_manifest(tmp_path, monkeypatch):
    """compile_bundle (NVRTC stubbed: the machine code is tested below) writes the int8 steps --
    workspaces, argument types, the library call's weight_format -- and load_bundle reads back the
    same plans."""
    import hashlib
    import codegen.nvrtc as nvrtc
    from codegen.bundle import compile_bundle, load_bundle
    from codegen.lower import lower_graph
    from ir.passes import run_pipeline
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, **kw: nvrtc.CompileResult(
        cubin=b"CUBIN:" + hashlib.sha256(source.encode()).digest(), log=""))
    path = tmp_path / "tiny.yaml"
    path.write_text(_int8_spec_text())
    out = tmp_path / "bundle"
    compile_bundle(str(path), out, cache_dir=tmp_path / "cache", progress=False, tuning=QUANT)
    loaded = load_bundle(out, arch="sm_90")
    spec = ir.load_spec(str(path))
    for phase in ("decode", "prefill"):
        want = [s for s in lower_graph(run_pipeline(ir.build_graph(spec, phase)), Options(tuning=QUANT)).steps
                if (s.params.get("wfmt") if isinstance(s, KernelLaunch) else s.attrs.get("weight_format")) == I8]
        got = [s for s in loaded.plans[phase].steps
               if (s.params.get("wfmt") if isinstance(s, KernelLaunch) else s.attrs.get("weight_format")) == I8]
        assert want and [dataclasses.replace(s, origins=()) if isinstance(s, KernelLaunch) else s for s in got] == \
            [dataclasses.replace(s, origins=()) if isinstance(s, KernelLaunch) else s for s in want], phase


def test_explain_names_the_int8_rows():
    from runtime.cli_explain import _reason
    G, nid = _node("linear", (I8,))
    steps = linear_skinny.lower(nid, G, Options(tuning=QUANT))
    assert _reason("linear", steps[:2], 4, Options(tuning=QUANT), {}).startswith("skinny_wi8 [tokens 1..16]: int8 weights")
    assert _reason("linear", steps[2:], 40, Options(tuning=QUANT), {}).startswith("i8_wgmma [tokens 17..inf]: int8 x int8")
    steps = linear_skinny.lower(nid, G, NO_90A)
    assert _reason("linear", steps[2:], 40, NO_90A, {}).startswith("int_mm [tokens 17..inf]: int8 weights")


def _compile(launch, arch="sm_90"):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    return compile_cubin(render_launch(launch), launch.name, arch=arch, options=("--ptxas-options=-v",))


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op, dtype, K, arch", [("multi_linear", "bf16", 2048, "sm_90"),
                                                ("gate_up_silu", "bf16", 2048, "sm_90a"),
                                                ("linear", "fp16", 1001, "sm_90"),
                                                ("linear", "bf16", 18432, "sm_90")])   # V3's down K
def test_the_int8_kernel_is_imma_on_16_byte_weight_loads_without_spills(op, dtype, K, arch):
    G, nid = _node(op, (I8, I8), K=K)
    quant, launch = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=QUANT))[:2]
    res = _compile(launch, arch)
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
    ops = opcodes(res.cubin)
    assert ops["IMMA.16832.S8.S8"] > 0, sorted(ops)
    assert ops["I2FP.F32.S32"] > 0 and ops["FMUL"] > 0, "the epilogue: int -> float, then the two scales"
    if K % 16 == 0:
        assert ops[WEIGHT_LOAD] > 0, sorted(ops)
    assert not any(o.startswith(("HMMA", "LDL", "STL", "LDGSTS", "LDSM")) for o in ops), sorted(ops)
    if op != "gate_up_silu":
        assert not any(o.startswith("FFMA") for o in ops), "no FMA may merge the epilogue's two products"
    qres = _compile(quant, arch)
    assert "0 bytes stack frame" in qres.log and "0 bytes spill stores" in qres.log, qres.log
    qops = opcodes(qres.cubin)
    # __fdiv_rn: the reciprocal estimate refined by FMAs with a FCHK guard and a slow path (IEEE
    # division); __float2int_rn: F2I with no rounding modifier (round to nearest even), never TRUNC
    assert qops["FCHK"] > 0 and qops["MUFU.RCP"] > 0, sorted(qops)
    assert qops["F2I.NTZ"] > 0 and not any(o.startswith("F2I") and "TRUNC" in o for o in qops), sorted(qops)
    if K % 8 == 0:   # rows that allow it are read once, 16 bytes at a time
        assert qops["LDG.E.128.CONSTANT"] > 0 and qops["STG.E.64"] > 0, sorted(qops)
    # PDL (pdl.cuh): the quantiser touches nothing before its wait; the int8 kernel only its weights
    from sass import instructions
    from test_sass_pdl import wait_problem
    assert wait_problem(instructions(qres.cubin)[quant.name]) is None
    assert wait_problem(instructions(res.cubin)[launch.name], weight_loads=True) is None


@pytest.mark.parametrize("op", ["multi_linear", "gate_up_silu"])
def test_the_exact_call_above_16_tokens_is_int_linear_without_host_reads(op, monkeypatch):
    """The cuda backend's library call (run here on CPU tensors: it is torch only) gives int_linear's
    numbers, rounded as the reference backend rounds, and reads no tensor on the host (the loader checked
    the offsets; a decode graph captured above 16 tokens holds this call)."""
    import torch
    from ir.formats_int import int_linear, quantize_int
    from ir.ops.core import gate_up_silu_ref
    from runtime.cuda_backend import CudaBackend
    G, nid = _node(op, K=96)
    (call,) = [s for s in linear_skinny.lower(nid, G, NO_90A) if isinstance(s, LibraryCall)]
    gen = torch.Generator().manual_seed(3)
    rows = [40, 40] if op == "gate_up_silu" else [48, 24]
    ws, floats = {}, {}
    for name, n in zip(call.weights, rows):
        q, (s, z) = quantize_int(torch.randn(n, 96, generator=gen), linear_skinny.INT8)
        ws[name], ws[name + "_scale"], ws[name + "_offset"] = q, s, z
        floats[name] = (q, (s, z))
    x = torch.randn(20, 96, generator=gen).to(torch.bfloat16)
    backend = CudaBackend.__new__(CudaBackend)
    backend.weights = ws
    env = {"x": x}
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("a host read of a tensor"))
    (CudaBackend._gate_up_silu if op == "gate_up_silu" else CudaBackend._linear)(backend, call, env)
    monkeypatch.undo()
    lin = {n: int_linear(x, q, c, linear_skinny.INT8).to(x.dtype) for n, (q, c) in floats.items()}
    if op == "gate_up_silu":
        g, u = (lin[n] for n in call.weights)
        assert torch.equal(env[call.outputs[0]], torch.nn.functional.silu(g).mul_(u))
    else:
        for name, out in zip(call.weights, call.outputs):
            assert torch.equal(env[out], lin[name])
