"""The grouped experts with msModelSlim's integer weights on the CPU -- packed int4 (int4_channel, W4A8_DYNAMIC
1.0.0; int4_group256_packed) and one value a byte (int8_channel, int4_channel_byte, int4_group256): the
grouped_experts table's int rows; moe_gate_up_silu / moe_down lower to the per-row int8 quantiser's launch and
the int launch ("wi4", "wi8", ..., templates/include/moe_int.cuh) over two workspaces, moe_expert_ffn to both
pairs; what no int kernel serves is one line; the kernels compile for sm_90 and sm_90a with no spills, on IMMA
s8 (packed int4: with the unpack's LOP3s), keeping the PDL contract; and tiny W4A8 / W8A8 checkpoints
(`dsgraph quantize`) lower with their routed experts on these kernels, no library call serving decode's
token counts."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions, opcodes  # noqa: E402
from tiny import ROOT  # noqa: E402

import ir  # noqa: E402
from codegen import dispatch, families  # noqa: E402
from codegen.errors import LoweringError  # noqa: E402
from codegen.families import _moe_int  # noqa: E402
from codegen.kernel import KernelLaunch, LibraryCall, Options, WeightRef, WorkspaceRef  # noqa: E402
from ir.formats import FORMATS, set_format  # noqa: E402
from ir.ops import TType  # noqa: E402
from tests.gpu.harness import single_op_graph, tiny_model  # noqa: E402

INT4 = FORMATS["int4_channel"]
GROUPED = FORMATS["int4_group256_packed"]
FACTS = {"weight_format": INT4.name, "dtype": "bf16", "int_rows": True}
MOE_OPS = ("moe_gate_up_silu", "moe_gate_up", "moe_down", "moe_expert_ffn")


def _node(op: str, KD: int, N: int, *, E: int = 8, K: int = 2, fmt=INT4, roles=None):
    r = TType((f"T*{K}", E), "routing")
    if op == "moe_down":
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"a": TType((f"T*{K}", KD), "act"), "R": r}, {"weight": "e.{expert}.down"})
    elif op == "moe_expert_ffn":
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "inner_dim": N, "out_dim": KD},
                                 {"x": TType(("T", KD), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up", "down": "e.{expert}.down"})
    else:
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"x": TType(("T", KD), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})
    bound = G.nodes[nid]["weights"]
    for role in (bound if roles is None else roles):
        set_format(G.graph["weights"], bound[role], fmt)
    return G, nid


def _lower(G, nid, opts=None):
    return families.family_for_op(G.nodes[nid]["op"]).lower(nid, G, opts or Options())


def test_the_grouped_table_serves_int4_at_every_token_count_and_refuses_the_rest():
    for op in ("moe_gate_up_silu", "moe_down"):
        rows = dispatch.rows(op, FACTS)
        assert [(r.variant, r.lo, r.hi) for r in rows] == [(_moe_int.VARIANT, 1, None)]
        assert "exact" in rows[0].reason and "NOT a tuned GEMM" in rows[0].reason
        for T in (1, 16, 256, 300, 16384):
            assert dispatch.select(op, T, FACTS).variant == _moe_int.VARIANT
            assert dispatch.select(op, T, {**FACTS, "weight_format": GROUPED.name}).variant == _moe_int.VARIANT
            for fmt in ("int8_channel", "int4_channel_byte", "int4_group256"):
                assert dispatch.select(op, T, {**FACTS, "weight_format": fmt}).variant == _moe_int.VARIANT
        for facts in ({**FACTS, "dtype": "fp32"}, {**FACTS, "int_rows": False},
                      {**FACTS, "weight_format": "int8_static"},
                      {**FACTS, "weight_format": GROUPED.name, "int_rows": False}):
            assert [r.variant for r in dispatch.rows(op, facts)] == [dispatch.NONE], facts
    # the bf16 rows are untouched
    bf16 = {"dtype": "bf16", "sm_90a": True, "tma_rows": True, "decode_wgmma_fits": True, "prefill_wgmma_fits": True}
    assert dispatch.select("moe_down", 48, bf16).variant == "wgmma_skinny"


@pytest.mark.parametrize("op,KD,N", [("moe_gate_up_silu", 2048, 1408), ("moe_down", 1408, 2048)])
def test_int4_experts_lower_to_the_quantiser_and_the_int4_launch(op, KD, N):
    G, nid = _node(op, KD, N, E=64, K=6)
    quant, gemm = _lower(G, nid)
    down = op == "moe_down"
    assert quant.stage == _moe_int.QUANT_STAGE and gemm.stage == _moe_int.VARIANT
    assert quant.template == gemm.template == "moe_int.cu.j2" and quant.family == gemm.family == op
    assert quant.name == f"{op}__bf16_qi8__k{KD}"
    assert gemm.name == (f"{op}__bf16_wi4__e64__d{N}_m{KD}" if down else f"{op}__bf16_wi4__e64_k6__m{N}_d{KD}")
    rows = "NP" if down else "T"
    assert quant.grid == (rows, 1, 1) and quant.block == (_moe_int.QUANT_THREADS, 1, 1)
    assert gemm.grid == (N // _moe_int.channels(down=down), "min(64, NP)", 1) and gemm.block == (128, 1, 1)
    ws = {w.name: w for w in quant.workspace}
    assert quant.workspace == gemm.workspace and len(ws) == 2
    q, s = ("aq_i8", "as_f32") if down else ("xq_i8", "xs_f32")
    assert ws[q].shape == (rows, KD // 4) and ws[q].dtype == "i32" and ws[s].shape == (rows,) and ws[s].dtype == "f32"
    qa = {a.name: (a.ctype, a.ref) for a in quant.args}
    assert qa["q"] == ("signed char*", WorkspaceRef(q)) and qa["s"] == ("float*", WorkspaceRef(s))
    assert qa["x"][0] == "const __nv_bfloat16*" and qa["rows"][1].expr == rows
    ga = {a.name: (a.ctype, a.ref) for a in gemm.args}
    assert ga["xq"] == ("const signed char*", WorkspaceRef(q)) and ga["xs"] == ("const float*", WorkspaceRef(s))
    for w in (("w",) if down else ("w_gate", "w_up")):
        name = G.nodes[nid]["weights"]["weight" if down else w[2:]]
        assert ga[w] == ("const signed char*", WeightRef(name))
        assert ga["s" + w[1:]] == ("const float*", WeightRef(name + "_scale"))
    assert gemm.params["down"] is down and gemm.params["channels"] == _moe_int.channels(down=down)


@pytest.mark.parametrize("op,KD,N", [("moe_gate_up_silu", 2048, 1408), ("moe_down", 1536, 2048)])
def test_per_group_int4_adds_the_second_stage_scales(op, KD, N):
    """int4_group256_packed: the same launches, named wi4g256, with each weight's "_scale_second" beside its
    "_scale"; a reduction width that is not whole groups is one line."""
    G, nid = _node(op, KD, N, E=64, K=6, fmt=GROUPED)
    quant, gemm = _lower(G, nid)
    assert quant.name == f"{op}__bf16_qi8__k{KD}" and "_wi4g256__" in gemm.name and gemm.params["group"] == 256
    ga = {a.name: (a.ctype, a.ref) for a in gemm.args}
    for w in (("w",) if op == "moe_down" else ("w_gate", "w_up")):
        name = ga[w][1].name
        assert ga["s" + w[1:]] == ("const float*", WeightRef(name + "_scale"))
        assert ga["g" + w[1:]] == ("const float*", WeightRef(name + "_scale_second"))
    from codegen.families import _moe_grouped
    p = {"int": GROUPED.name, "N": 200, "KD": 300, "E": 8, "K": 1}
    with pytest.raises(LoweringError, match="groups 256 input channels; 300 do not divide"):
        _moe_int.check("n", Options(), p)
    assert _moe_grouped.facts(Options(), {**p, "fp8": False}, down=True)["int_rows"] is False


def test_odd_reduction_widths_pad_the_quantised_rows():
    G, nid = _node("moe_down", 1001, 90)
    quant, gemm = _lower(G, nid, Options(dtype="fp16"))
    assert quant.params["qrow"] == 1008 and quant.workspace[0].shape == ("NP", 252)
    assert gemm.grid[0] == 3 and gemm.name == "moe_down__fp16_wi4__e8__d90_m1001"


def test_the_expert_ffn_runs_both_int_launch_pairs_beside_its_intermediate():
    G, nid = _node("moe_expert_ffn", 2048, 1408, E=64, K=6)
    launches = _lower(G, nid)
    assert [(la.family, la.stage) for la in launches] == [
        ("moe_gate_up_silu", "quant_i8"), ("moe_gate_up_silu", "mma_int"), ("moe_down", "quant_i8"),
        ("moe_down", "mma_int")]
    for la in launches:
        assert "expert_act" in {w.name for w in la.workspace}
    assert {a.name: a.ref for a in launches[2].args}["x"] == WorkspaceRef("expert_act")
    assert {a.name: a.ref for a in launches[1].args}["out"] == WorkspaceRef("expert_act")


@pytest.mark.parametrize("op,kw,opts,message", [
    ("moe_gate_up_silu", {}, Options(dtype="fp32"), "int4_channel expert weights need bf16 or fp16 activations"),
    ("moe_gate_up_silu", {"roles": ("gate",)}, Options(), "all in one integer format, got bf16, int4_channel"),
    ("moe_down", {"N": 45}, Options(), "packs two output channels a byte; 45 do not pair"),
])
def test_what_no_int_kernel_serves_is_one_line(op, kw, opts, message):
    kw = dict(kw)
    G, nid = _node(op, 256, kw.pop("N", 200), **kw)
    with pytest.raises(LoweringError, match=message) as info:
        _lower(G, nid, opts)
    assert "\n" not in str(info.value)


def test_static_int8_experts_have_no_kernel_in_one_line():
    """int8_static (a per-tensor static activation scale): the table's none row; `check` says why."""
    p = {"int": "int8_static", "N": 200, "KD": 256, "E": 8, "K": 1}
    assert [r.variant for r in dispatch.rows("moe_down", {"dtype": "bf16", "weight_format": "int8_static",
                                                          "int_rows": True})] == [dispatch.NONE]
    with pytest.raises(LoweringError, match="no cuda kernel for int8_static expert weights") as info:
        _moe_int.check("n", Options(), p)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fmt", sorted(_moe_int.TAGS))
def test_every_dynamic_integer_expert_format_lowers_to_its_kernel(fmt):
    """Each format a msModelSlim checkpoint may store routed experts in (per-token activations) lowers to the
    quantiser and its own int kernel (name part _moe_int.TAGS[fmt]).  Widths of whole 256-groups."""
    from codegen.lower import lower_graph
    from ir.config_to_spec import spec_from_config
    from ir.passes import run_pipeline
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    tiny = {**tiny, "hidden_size": 256, "moe_intermediate_size": 256}
    text = spec_from_config(tiny, name="tiny") + f'\nweight_formats:\n  "model.layers.*.mlp.experts.*": {fmt}\n'
    G = run_pipeline(ir.build_graph(ir.load_spec(text, file="t.yaml"), "decode"))
    steps = [s for s in lower_graph(G, Options()).steps if isinstance(s, KernelLaunch) and s.stage == "mma_int"]
    assert steps and all(f"_bf16_{_moe_int.TAGS[fmt]}__" in s.name for s in steps), [s.name for s in steps]
    assert {s.params["pack"] for s in steps} == {FORMATS[fmt].pack}


def _compile(launch, arch):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    return compile_cubin(render_launch(launch), launch.name, arch=arch, options=("--ptxas-options=-v",))


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op,KD,N,dtype,arch", [("moe_gate_up_silu", 2048, 1408, "bf16", "sm_90"),
                                                 ("moe_down", 1408, 2048, "bf16", "sm_90a"),
                                                 ("moe_gate_up_silu", 7168, 2048, "bf16", "sm_90a"),   # V3
                                                 ("moe_down", 1001, 90, "fp16", "sm_90"),          # byte loads
                                                 ("moe_gate_up_silu", 2048, 1408, "bf16", "int4_group256_packed"),
                                                 ("moe_down", 1536, 2048, "fp16", "int4_group256_packed"),
                                                 ("moe_gate_up_silu", 2048, 1408, "bf16", "int8_channel"),
                                                 ("moe_down", 1001, 45, "bf16", "int8_channel"),
                                                 ("moe_down", 1536, 2048, "bf16", "int4_group256")])
def test_the_int_kernel_is_imma_without_spills(op, KD, N, dtype, arch):
    from test_sass_pdl import wait_problem
    fmt = FORMATS[arch] if arch in FORMATS else INT4
    arch = "sm_90" if arch in FORMATS else arch
    G, nid = _node(op, KD, N, E=64, K=6, fmt=fmt)
    quant, gemm = _lower(G, nid, Options(dtype=dtype))
    res = _compile(gemm, arch)
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
    ops = opcodes(res.cubin)
    assert ops["IMMA.16832.S8.S8"] > 0, sorted(ops)
    if fmt.pack == 2:
        assert any(o.startswith("LOP3") for o in ops), "the int4 unpack: masks of the packed words"
    assert ops["I2FP.F32.S32"] > 0 and ops["FMUL"] > 0, "the epilogue: int -> float, then the two scales"
    if KD % 16 == 0:
        assert ops["LDG.E.NA.LTC128B.128.CONSTANT"] > 0, sorted(ops)
    assert not any(o.startswith(("HMMA", "HGMMA", "LDL", "STL")) for o in ops), sorted(ops)
    if op == "moe_down":   # (per group too: the step's promotion is a separate multiply and add)
        assert not any(o.startswith("FFMA") for o in ops), "no FMA may merge the epilogue's two products"
    assert wait_problem(instructions(res.cubin)[gemm.name]) is None
    qres = _compile(quant, arch)
    assert "0 bytes stack frame" in qres.log and "0 bytes spill stores" in qres.log, qres.log
    qops = opcodes(qres.cubin)
    assert qops["FCHK"] > 0 and qops["F2I.NTZ"] > 0, sorted(qops)   # __fdiv_rn, round half to even
    assert wait_problem(instructions(qres.cubin)[quant.name]) is None


@pytest.mark.parametrize("to,fmt", [("w4a8", "int4_channel"), ("w8a8", "int8_channel")])
def test_a_tiny_msmodelslim_checkpoint_lowers_with_its_experts_on_the_int_kernels(tmp_path, to, fmt):
    """`dsgraph quantize --to w4a8 | w8a8` of a tiny V3-style checkpoint, its spec from its config (int8
    linears, packed int4 or int8 routed experts), the pass pipeline and the cuda lowering on the CPU: every
    routed-expert node runs the quantiser and the int launch at every T; no library call serves a decode token
    count (<= 16: above it the int8 dense linears' exact call, not the experts)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    import hf_tiny
    from codegen.lower import lower_graph
    from ir.config_to_spec import spec_from_config
    from ir.passes import run_pipeline
    from runtime.cli import main as cli_main
    src, dst = hf_tiny.build("v3_tp", tmp_path / "hf"), tmp_path / to
    assert cli_main(["quantize", "--to", to, str(src), str(dst)]) == 0
    text = spec_from_config(json.loads((dst / "config.json").read_text()), name=f"tiny_{to}")
    assert f'"model.layers.*.mlp.experts.*": {fmt}' in text
    spec = ir.load_spec(text, file="tiny_w4a8.yaml")
    for phase in ("decode", "prefill"):
        G = run_pipeline(ir.build_graph(spec, phase))
        plan = lower_graph(G, Options())
        experts = [n for n, d in G.nodes(data=True) if d["op"] in MOE_OPS]
        assert experts, phase
        for nid in experts:
            steps = [s for s in plan.steps if (s.nodes[0] if isinstance(s, KernelLaunch) else s.node) == nid]
            assert steps and all(isinstance(s, KernelLaunch) for s in steps), (phase, nid, steps)
            assert {s.stage for s in steps} == {_moe_int.QUANT_STAGE, _moe_int.VARIANT}, (phase, nid)
            assert all(s.grid[0] in ("T", "NP") or f"_{_moe_int.TAGS[fmt]}__" in s.name for s in steps)
        calls = [s for s in plan.steps if isinstance(s, LibraryCall) and s.call != "view"]
        assert all(c.op not in MOE_OPS for c in calls)
        if phase == "decode":
            assert all(c.from_tokens > 16 for c in calls), [(c.node, c.op, c.from_tokens) for c in calls]


def test_an_int_expert_bundle_keeps_its_steps_through_the_manifest(tmp_path, monkeypatch):
    """compile_bundle (NVRTC stubbed: the machine code is tested above) writes the int4 experts' steps --
    workspaces, argument types, template -- and load_bundle reads back the same plans."""
    import dataclasses
    import hashlib
    import codegen.nvrtc as nvrtc
    from codegen.bundle import compile_bundle, load_bundle
    from codegen.lower import lower_graph, pipeline_knobs
    from ir.config_to_spec import spec_from_config
    from ir.passes import run_pipeline
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, **kw: nvrtc.CompileResult(
        cubin=b"CUBIN:" + hashlib.sha256(source.encode()).digest(), log=""))
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    path = tmp_path / "tiny_w4a8.yaml"
    path.write_text(spec_from_config({**tiny, "quantize": "w8a8_dynamic", "moe_quantize": "w4a8_dynamic"},
                                     name="tiny_w4a8"))
    out = tmp_path / "bundle"
    compile_bundle(str(path), out, cache_dir=tmp_path / "cache", progress=False)
    loaded = load_bundle(out, arch="sm_90")
    spec = ir.load_spec(str(path))

    def ours(steps):
        return [dataclasses.replace(s, origins=()) for s in steps
                if isinstance(s, KernelLaunch) and s.template == _moe_int.TEMPLATE]
    for phase in ("decode", "prefill"):
        want = ours(lower_graph(run_pipeline(ir.build_graph(spec, phase), knobs=pipeline_knobs(Options())), Options()).steps)
        assert want and ours(loaded.plans[phase].steps) == want, phase
