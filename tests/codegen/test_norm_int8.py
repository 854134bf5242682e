"""The RMSNorms writing their int8 readers' rows (Tuning.linear.norm_int8; ir/passes/fuse_norm_int8_quant.py,
templates/include/norm_quant.cuh) on the CPU: with the knob off the plans are today's; with it on, every norm
read by int8 linears or int experts launches its "qi8" variant writing the rows and scales, and those readers
(the skinny int8 kernel, gemm_int8, the grouped int launch) bind them and have no quantiser launch, at every
token count they run, while the readers of other inputs (o_proj, the downs) keep theirs; the exact library
call (no sm_90a) still reads x; the three norm variants compile for sm_90 / sm_90a with no spills, on the
quantiser's correctly rounded division and round-to-nearest conversion, keeping the PDL contract; a norm's int8
rows at fp32 are one line; the memory plan keeps the rows alive from the norm to their last reader."""
from __future__ import annotations

import dataclasses
import os
import sys
from functools import lru_cache

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions, opcodes  # noqa: E402
from tiny import ROOT  # noqa: E402

import ir  # noqa: E402
from codegen.errors import LoweringError  # noqa: E402
from codegen.families import family_for_op  # noqa: E402
from codegen.kernel import KernelLaunch, LibraryCall, Options, ValueRef  # noqa: E402
from codegen.lower import lower_graph, pipeline_knobs  # noqa: E402
from codegen.tuning import LinearTuning, Tuning  # noqa: E402
from ir.config_to_spec import msmodelslim_weight_formats, spec_from_config  # noqa: E402
from ir.ops import TType  # noqa: E402
from ir.passes import run_pipeline  # noqa: E402
from ir.passes.norm_rows import give_rows, row_names  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import single_op_graph  # noqa: E402

# the norms' rows against the readers' own quantisers, the prologue knob off in both (its own test is below)
ON = Tuning(linear=LinearTuning(norm_int8=True, i8_prologue_upto=0))
OFF = Tuning(linear=LinearTuning(norm_int8=False, i8_prologue_upto=0))
NO_90A = "sm_89"
QUANT_STAGES = ("quant_int8", "quant_i8")     # linear_skinny's, gemm_int8's and the int experts' quantisers
TINY = {  # V2-style, no q_lora: the input norm feeds q + kv_a; widths multiples of 16 (gemm_int8 serves them)
    "model_type": "deepseek_v2", "hidden_size": 64, "num_attention_heads": 2, "q_lora_rank": None,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "intermediate_size": 96,
    "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "topk_method": "greedy", "vocab_size": 64, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
}


@lru_cache(maxsize=None)
def _spec():
    text = spec_from_config(TINY, name="tiny") + msmodelslim_weight_formats("w8a8_dynamic", "w4a8_dynamic", True)
    return ir.load_spec(text, file="tiny.yaml")


@lru_cache(maxsize=None)
def _plan(phase: str, tuning: Tuning = OFF, arch: str = "sm_90a"):
    opts = Options(arch=arch, tuning=tuning)
    G = run_pipeline(ir.build_graph(_spec(), phase), knobs=pipeline_knobs(opts))
    return G, lower_graph(G, opts)


def _launches(plan):
    return [s for s in plan.steps if isinstance(s, KernelLaunch)]


def _norm_fed(G) -> set[str]:
    """The nodes reading a norm's output as their x."""
    norms = {d["outputs"][0] for _, d in G.nodes(data=True)
             if d["op"] in ("rms_norm", "fused_add_rms_norm", "moe_combine_residual_rms_norm")}
    return {n for n, d in G.nodes(data=True) if d["inputs"] and d["inputs"][0] in norms}


def test_the_knob_is_on_by_default_and_switches_the_pass():
    """On by default (measured: W4A8 b=1 1.86 -> 1.72 ms with the prologue knob, H100); a default that is on
    runs its pass as an explicit one does (pipeline_knobs reads the values, not what a flag changed)."""
    assert Tuning().linear.norm_int8
    assert "linear.norm_int8" in pipeline_knobs(Options())
    assert "linear.norm_int8" in pipeline_knobs(Options(tuning=ON))
    assert "linear.norm_int8" not in pipeline_knobs(Options(tuning=OFF))
    assert OFF.flags() == ["--tune linear.i8_prologue_upto=0", "--tune linear.norm_int8=false"]


@pytest.mark.parametrize("phase", ir.PHASES)
def test_off_no_norm_writes_rows_and_every_int8_reader_quantises(phase):
    G, plan = _plan(phase)
    launches = _launches(plan)
    assert not any(s.name.endswith("__qi8") for s in launches)
    assert not any(isinstance(a.ref, ValueRef) and a.name == "xq" for s in launches for a in s.args)
    assert any(s.stage in QUANT_STAGES for s in launches)


@pytest.mark.parametrize("phase", ir.PHASES)
def test_on_the_norms_write_the_rows_and_their_readers_quantise_nothing(phase):
    G, plan = _plan(phase, ON)
    _, off = _plan(phase)
    launches = _launches(plan)
    norms = [s for s in launches if s.family in ("rms_norm", "fused_add_rms_norm", "moe_combine_residual_rms_norm")
             and s.name.endswith("__qi8")]
    written = {}
    for s in norms:
        h = G.nodes[s.nodes[0]]["outputs"][0]
        args = {a.name: a for a in s.args}
        assert (args["hq"].ref, args["hs"].ref) == tuple(ValueRef(v) for v in row_names(h, "int8")), s.name
        assert args["hq"].ctype == "signed char*" and args["hs"].ctype == "float*"
        assert s.params["quant_i8"] == {"qrow": -(-G.graph["values"][h].shape[1] // 16) * 16}
        written[h] = row_names(h, "int8")
    # per layer: the input norm (q + kv_a) and the MLP / MoE input norm (shared, dense, routed gate_up)
    assert len(norms) == 2 * TINY["num_hidden_layers"], [s.name for s in norms]
    fed = _norm_fed(G)
    readers = [s for s in launches if s.nodes[0] in fed and "xq" in {a.name for a in s.args}
               and not s.params.get("down")]
    assert {s.family for s in readers} >= {"linear_skinny", "gemm_int8", "moe_gate_up_silu"}, readers
    for s in readers:
        x = G.nodes[s.nodes[0]]["inputs"][0]
        args = {a.name: a for a in s.args}
        assert (args["xq"].ref, args["xs"].ref) == tuple(ValueRef(v) for v in written[x]), s.name
    # no quantiser launch for an input a norm makes; the others' stay (o_proj, the dense down, the experts' down)
    quant = {(s.nodes[0], s.family) for s in launches if s.stage in QUANT_STAGES}
    off_quant = {(s.nodes[0], s.family) for s in _launches(off) if s.stage in QUANT_STAGES}
    assert quant < off_quant
    assert off_quant - quant == {(s.nodes[0], s.family) for s in readers}
    assert all(n not in fed or family == "moe_down" for n, family in quant), sorted(quant)


def test_on_the_same_kernels_run_except_the_norms_and_the_quantisers():
    """The readers' kernels are today's (their sources do not change: the rows come through arguments of the
    same C types); only the norms' names change and the quantisers go."""
    for phase in ir.PHASES:
        on = {s.name for s in _launches(_plan(phase, ON)[1])}
        off = {s.name for s in _launches(_plan(phase)[1])}
        assert {n.removesuffix("__qi8") for n in on} <= off, sorted(on - off)
        assert all("qi8" in n or "quant" in n for n in off - {n.removesuffix("__qi8") for n in on}), sorted(off - on)


def test_without_sm_90a_the_exact_call_above_still_reads_x():
    G, plan = _plan("prefill", ON, NO_90A)
    calls = [s for s in plan.steps if isinstance(s, LibraryCall) and s.attrs.get("weight_format") == "int8_channel"]
    fed = _norm_fed(G)
    assert any(c.node in fed for c in calls)
    for c in calls:
        assert c.inputs == tuple(G.nodes[c.node]["inputs"]), c
    skinny = [s for s in _launches(plan) if s.nodes[0] in fed and s.family == "linear_skinny"
              and s.params["wfmt"] == "int8_channel"]
    assert skinny and all(isinstance({a.name: a for a in s.args}["xq"].ref, ValueRef) for s in skinny)


def test_the_rows_live_from_the_norm_to_their_last_reader():
    from codegen.memplan import node_groups
    G, plan = _plan("decode", ON)
    slots = {s.name: s for s in plan.arena}
    groups = node_groups(plan.steps)
    for at, (node, steps) in enumerate(groups):
        if not any(s.name.endswith("__qi8") for s in steps if isinstance(s, KernelLaunch)):
            continue
        q, sc = row_names(G.nodes[node]["outputs"][0], "int8")
        readers = [i for i, (_, st) in enumerate(groups) if i != at and any(
            isinstance(a.ref, ValueRef) and a.ref.name == q for s in st if isinstance(s, KernelLaunch) for a in s.args)]
        assert readers and slots[q].first == at and slots[q].last == readers[-1], (node, slots[q], readers)
        assert (slots[sc].first, slots[sc].last) == (slots[q].first, slots[q].last)
        assert slots[q].dtype == "i32" and slots[sc].dtype == "f32"


def _norm_graph(op: str, n: int):
    m = ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model
    if op == "moe_combine_residual_rms_norm":
        ins = {"eo": TType(("T*6", n), "act"), "w": TType(("T", 6), "f32"), "sh": TType(("T", n), "act"),
               "res": TType(("T", n), "act")}
    else:
        ins = {f"x{i}": TType(("T", n), "act") for i in range(1 if op == "rms_norm" else 2)}
    G, nid = single_op_graph(m, op, {}, ins, {"weight": "w"})
    return G, give_rows(G, nid, "int8")


def test_a_norms_int8_rows_need_16_bit_activations():
    G, nid = _norm_graph("rms_norm", 64)
    with pytest.raises(LoweringError, match="need bf16 or fp16 activations, not fp32") as e:
        family_for_op("rms_norm").lower(nid, G, Options(dtype="fp32"))
    assert "\n" not in str(e.value)


def test_the_norm_variant_renders_the_quantiser_and_its_row_width():
    from codegen.render import render_launch
    G, nid = _norm_graph("fused_add_rms_norm", 1001)
    (launch,) = family_for_op("fused_add_rms_norm").lower(nid, G, Options())
    src = render_launch(launch)
    assert launch.name == "fused_add_rms_norm__bf16__d1001__qi8"
    assert "constexpr int QROW = 1008;" in src and "norm_rows_int8<N, L>(v, hq + (i64)t * QROW, hs + t" in src
    G0, nid0 = single_op_graph(G.graph["model"], "fused_add_rms_norm", {},
                               {f"x{i}": TType(("T", 1001), "act") for i in range(2)}, {"weight": "w"})
    (plain,) = family_for_op("fused_add_rms_norm").lower(nid0, G0, Options())
    assert "QROW" not in render_launch(plain) and "norm_quant" not in render_launch(plain)


def _compile(launch, arch):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    return compile_cubin(render_launch(launch), launch.name, arch=arch, options=("--ptxas-options=-v",))


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op, n, dtype, arch", [("rms_norm", 2048, "bf16", "sm_90a"),
                                                ("rms_norm", 1001, "fp16", "sm_90"),
                                                ("fused_add_rms_norm", 2048, "bf16", "sm_90"),
                                                ("fused_add_rms_norm", 7168, "fp16", "sm_90a"),
                                                ("moe_combine_residual_rms_norm", 2048, "bf16", "sm_90a"),
                                                ("moe_combine_residual_rms_norm", 1001, "bf16", "sm_90")])
def test_the_norm_variants_compile_without_spills_on_the_quantisers_arithmetic(op, n, dtype, arch):
    from test_sass_pdl import wait_problem
    G, nid = _norm_graph(op, n)
    (launch,) = family_for_op(op).lower(nid, G, Options(dtype=dtype, arch=arch))
    res = _compile(launch, arch)
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
    ops = opcodes(res.cubin)
    # __fdiv_rn (scale and quotients): the reciprocal estimate refined with a FCHK guard; __float2int_rn: F2I
    # rounding to nearest even, never TRUNC
    assert ops["FCHK"] > 0 and ops["MUFU.RCP"] > 0, sorted(ops)
    assert ops["F2I.NTZ"] > 0 and not any(o.startswith("F2I") and "TRUNC" in o for o in ops), sorted(ops)
    if n % 8 == 0:   # 8 quotients a chunk: one 8-byte store
        assert ops["STG.E.64"] > 0, sorted(ops)
    assert wait_problem(instructions(res.cubin)[launch.name], weight_loads=True) is None


def test_a_bundle_keeps_the_norms_rows_through_the_manifest(tmp_path, monkeypatch):
    """compile_bundle with the knob (NVRTC stubbed: the machine code is tested above) writes the norms' qi8
    launches, the readers' value-bound rows and the rows' buffers, and load_bundle reads back the same plans."""
    import hashlib
    import codegen.nvrtc as nvrtc
    from codegen.bundle import compile_bundle, load_bundle
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, **kw: nvrtc.CompileResult(
        cubin=b"CUBIN:" + hashlib.sha256(source.encode()).digest(), log=""))
    path = tmp_path / "tiny.yaml"
    path.write_text(_spec().text)
    out = tmp_path / "bundle"
    compile_bundle(str(path), out, arch="sm_90a", cache_dir=tmp_path / "cache", progress=False, tuning=ON)
    loaded = load_bundle(out, arch="sm_90a")
    for phase in ir.PHASES:
        G, want = _plan(phase, ON)
        got = loaded.plans[phase]
        assert [dataclasses.replace(s, origins=()) if isinstance(s, KernelLaunch) else s for s in got.steps] == \
            [dataclasses.replace(s, origins=()) if isinstance(s, KernelLaunch) else s for s in want.steps], phase
        rows = [b for name, b in got.buffers.items() if name.endswith((".qi8", ".si8"))]
        assert rows and all(b.dtype in ("i32", "f32") for b in rows), phase


@pytest.mark.parametrize("phase", ir.PHASES)
def test_at_every_size_the_same_launches_run_less_the_quantisers(phase):
    """At each T, the launches of the norms and their int8 readers that run (grid > 0) with the knob on are
    those that run with it off, less the norm-fed quantisers, the norms in their qi8 variants."""
    from codegen import sizes
    G, on = _plan(phase, ON)
    _, off = _plan(phase)
    fed = _norm_fed(G)
    norms = {n for n, d in G.nodes(data=True) if d["attrs"].get("quant")}

    def running(plan, T):
        env = {"T": T, "NP": T * TINY["num_experts_per_tok"], "SMS": 132}
        return [(s.nodes[0], s.name.removesuffix("__qi8"), s.stage) for s in _launches(plan)
                if s.nodes[0] in fed | norms and all(sizes.evaluate(g, env) > 0 for g in s.grid)]

    for T in (1, 2, 16, 17, 64, 256, 257, 4096):
        got, want = running(on, T), running(off, T)
        quantisers = [r for r in want if r[2] in QUANT_STAGES and r[0] in fed and not r[1].startswith("moe_down")]
        assert quantisers and got == [r for r in want if r not in quantisers], (phase, T)


def test_with_the_prologue_knob_too_the_norms_rows_win():
    """linear.i8_prologue_upto on as well: a norm-fed int8 linear reads the norm's rows at every T its
    skinny kernel serves (no prologue variant, no quantiser); a linear whose input no norm makes (o_proj, the
    dense down) quantises x in its prologue as that knob asks."""
    both = Tuning(linear=LinearTuning(norm_int8=True, i8_prologue_upto=8, i8_chunks_upto=0))   # (the chunks' own test)
    G, plan = _plan("decode", both)
    fed = _norm_fed(G)
    skinny = [s for s in _launches(plan) if s.family == "linear_skinny" and s.params.get("wfmt") == "int8_channel"]
    mine = [s for s in skinny if s.nodes[0] in fed]
    others = [s for s in skinny if s.nodes[0] not in fed]
    assert mine and all(s.stage != "quant_int8" and "xq" not in s.params for s in mine), [s.name for s in mine]
    for s in mine:
        assert isinstance({a.name: a for a in s.args}["xq"].ref, ValueRef), s.name
        assert s.grid[0].endswith("(1 - min(1, T // 17))"), s.grid   # every T up to skinny_upto
    assert any(s.params.get("xq") == 8 for s in others), [s.name for s in others]
