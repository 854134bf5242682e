"""The RMSNorms writing their FP8 x FP8 readers' e4m3 rows (Tuning.linear.norm_fp8; ir/passes/fuse_norm_fp8_quant.py,
templates/include/norm_quant.cuh norm_rows_fp8) on the CPU: with the knob off the plans are today's; with it on, a
norm read by FP8 weights runs its plain launch below the first token count at which one of its readers multiplies
FP8 x FP8 (gemm_fp8 above skinny_upto, the experts' wgmma_fp8 above decode's range) and its "qf8" launch from
there, and those readers bind its rows and scales and run no quantiser of their own; at every T the same launches
run as without the knob, less the norm-fed quantisers, and every row a norm writes is read; without sm_90a nothing
changes; the rows live in the memory plan from the norm to their last reader; fp32 and odd widths are one line;
the three norm variants render and compile for sm_90a without spills on the quantiser's arithmetic (true
divisions, e4m3x2's rounding, four half-warp shuffles a chunk, 8-byte stores), keeping the PDL contract."""
from __future__ import annotations

import os
import sys
from functools import lru_cache

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions, opcodes  # noqa: E402
from tiny import ROOT  # noqa: E402

import ir  # noqa: E402
from codegen import sizes  # noqa: E402
from codegen.errors import LoweringError  # noqa: E402
from codegen.families import _norm_quant, family_for_op  # noqa: E402
from codegen.kernel import KernelLaunch, Options, ValueRef  # noqa: E402
from codegen.lower import lower_graph, pipeline_knobs  # noqa: E402
from codegen.tuning import LinearTuning, MoeTuning, Tuning  # noqa: E402
from ir.config_to_spec import spec_from_config  # noqa: E402
from ir.ops import TType  # noqa: E402
from ir.passes import run_pipeline  # noqa: E402
from ir.passes.norm_rows import NORMS, give_rows, row_names  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import single_op_graph  # noqa: E402

# the FP8 x FP8 readers from T = 17: the skinny kernel's 16-token chunks (on at 64 by default) read the 16-bit x
# (tests/codegen/test_linear_fp8_chunks.py has the norms' rows with the chunks on); the experts' FP8 x FP8 GEMM
# from 257, where bf16's prefill GEMM starts (by default from 17: moe.fp8_activations_above; the same test file's
# explain test has the MoE input norms' rows at b=32)
EXPERTS_256 = MoeTuning(fp8_activations_above=None)
ON = Tuning(linear=LinearTuning(norm_fp8=True, fp8_chunks_upto=0), moe=EXPERTS_256)
OFF = Tuning(linear=LinearTuning(norm_fp8=False, fp8_chunks_upto=0), moe=EXPERTS_256)
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
TINY = {  # V2-style, no q_lora: the input norm feeds q + kv_a; D = 144 (a partial 128-group), widths % 16 == 0
    "model_type": "deepseek_v2", "hidden_size": 144, "num_attention_heads": 2, "q_lora_rank": None,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "intermediate_size": 96,
    "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "topk_method": "greedy", "vocab_size": 64, "num_hidden_layers": 3,
    "first_k_dense_replace": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "quantization_config": FP8_QUANT,
}
SIZES = (1, 2, 16, 17, 32, 64, 256, 257, 300, 16384)


@lru_cache(maxsize=None)
def _spec():
    return ir.load_spec(spec_from_config(TINY, name="tiny"), file="tiny.yaml")


@lru_cache(maxsize=None)
def _plan(phase: str, tuning: Tuning = OFF, arch: str = "sm_90a", dtype: str = "bf16"):
    opts = Options(arch=arch, dtype=dtype, tuning=tuning)
    G = run_pipeline(ir.build_graph(_spec(), phase), knobs=pipeline_knobs(opts))
    return G, lower_graph(G, opts)


def _launches(plan):
    return [s for s in plan.steps if isinstance(s, KernelLaunch)]


def _running(plan, T: int) -> list:
    env = {"T": T, "B": T, "NP": T * (TINY["num_experts_per_tok"] + TINY["n_shared_experts"]), "MAXQ": T,
           "MAXCTX": T, "TK": T, "W": T, "SMS": 132}
    return [s for s in _launches(plan) if all(sizes.evaluate(g, env) > 0 for g in s.grid)]


def _norm_fed(G) -> set[str]:
    """The nodes reading a norm's output as their x."""
    norms = {d["outputs"][0] for _, d in G.nodes(data=True) if d["op"] in NORMS}
    return {n for n, d in G.nodes(data=True) if d["inputs"] and d["inputs"][0] in norms}


def _bound(s, name: str):
    return next((a.ref for a in s.args if a.name == name), None)


def test_the_knob_is_on_by_default_and_switches_the_pass():
    """On by default: FP8 b=32 8.12 -> 8.07 ms, b=128 9.26 -> 9.24, prefill 32x512 115.2k -> 116.5k tok/s, the
    logits bit-equal (H100, PERF_NOTES v43)."""
    assert Tuning().linear.norm_fp8
    assert "linear.norm_fp8" in pipeline_knobs(Options())
    assert "linear.norm_fp8" not in pipeline_knobs(Options(tuning=OFF))
    assert Tuning(linear=LinearTuning(norm_fp8=False)).flags() == ["--tune linear.norm_fp8=false"]
    assert Tuning().to_json()["linear"]["norm_fp8"] is True


@pytest.mark.parametrize("phase", ir.PHASES)
def test_off_no_norm_writes_rows_and_every_fp8_gemm_quantises(phase):
    G, plan = _plan(phase)
    launches = _launches(plan)
    assert not any(s.name.endswith("__qf8") for s in launches)
    assert not any(isinstance(a.ref, ValueRef) and a.name == "xq" for s in launches for a in s.args)
    assert any(s.stage == "quant_x" for s in launches) and any(s.stage == "fp8_wgmma" for s in launches)


@pytest.mark.parametrize("phase", ir.PHASES)
def test_on_the_norms_write_the_rows_where_their_readers_run_fp8_x_fp8(phase):
    """The input norms (q + kv_a: gemm_fp8 from skinny_upto + 1 = 17) and the dense MLP's input norm (17) switch
    to their qf8 launch at T = 17, the MoE input norms (the experts' wgmma_fp8) at T = 257; below, the plain
    launch, as today."""
    G, plan = _plan(phase, ON)
    by_node: dict = {}
    for s in _launches(plan):
        if s.family in NORMS:
            by_node.setdefault(s.nodes[0], []).append(s)
    marked = {n for n, d in G.nodes(data=True) if d["attrs"].get("quant") == "fp8"}
    assert len(marked) == 2 * TINY["num_hidden_layers"], sorted(marked)
    firsts = {}
    for nid, steps in by_node.items():
        if nid not in marked:
            assert len(steps) == 1 and steps[0].grid[0] == "T", nid
            continue
        plain, qf8 = steps
        h = G.nodes[nid]["outputs"][0]
        assert not plain.name.endswith("__qf8") and qf8.name == plain.name + "__qf8"
        args = {a.name: a for a in qf8.args}
        assert (args["hq"].ref, args["hs"].ref) == tuple(ValueRef(v) for v in row_names(h, "fp8"))
        assert args["hq"].ctype == "unsigned char*" and args["hs"].ctype == "float*"
        assert qf8.params["quant_f8"] == {"kb": 2} and "hq" not in {a.name for a in plain.args}
        lo = next(T for T in range(1, 400) if _running(plan, T).count(qf8))
        assert all(bool(_running(plan, T).count(plain)) != bool(_running(plan, T).count(qf8)) for T in SIZES)
        firsts[h] = lo
    assert firsts == {"L0.h_attn": 17, "L0.h_ffn": 17, "L1.h_attn": 17, "L1.h_ffn": 257, "L2.h_attn": 17,
                      "L2.h_ffn": 257}, firsts


@pytest.mark.parametrize("phase", ir.PHASES)
def test_at_every_size_the_rows_are_written_exactly_where_they_are_read(phase):
    """At each T, every launch binding a norm's rows runs beside the norm's qf8 launch, and every running qf8
    launch has a running reader of its rows."""
    G, plan = _plan(phase, ON)
    for T in SIZES:
        run = _running(plan, T)
        written = {_bound(s, "hq").name for s in run if s.family in NORMS and s.name.endswith("__qf8")}
        read = {_bound(s, "xq").name for s in run if isinstance(_bound(s, "xq"), ValueRef)}
        assert written == read, (phase, T, sorted(written), sorted(read))
        if T > 16:
            assert read, (phase, T)


@pytest.mark.parametrize("phase", ir.PHASES)
def test_at_every_size_the_same_launches_run_less_the_norm_fed_quantisers(phase):
    G, on = _plan(phase, ON)
    _, off = _plan(phase)
    fed = _norm_fed(G)

    def key(s):
        return s.nodes[0], s.name.removesuffix("__qf8"), s.stage

    for T in SIZES:
        got, want = [key(s) for s in _running(on, T)], [key(s) for s in _running(off, T)]
        # the quantisers of x (K = D) at nodes a norm feeds; not down's of the expert FFN node (K = 32)
        quantisers = [r for r in want if r[2] == "quant_x" and r[0] in fed and "__k144__" in r[1]]
        assert got == [r for r in want if r not in quantisers], (phase, T)
        assert bool(quantisers) == (T > 16), (phase, T)


@pytest.mark.parametrize("phase", ir.PHASES)
def test_the_readers_bind_the_rows_and_the_others_keep_their_quantisers(phase):
    G, plan = _plan(phase, ON)
    fed = _norm_fed(G)
    readers = [s for s in _launches(plan) if isinstance(_bound(s, "xq"), ValueRef)]
    assert {s.family for s in readers} == {"gemm_fp8", "moe_gate_up_silu"}   # decode's: moe_expert_ffn's gate / up
    for s in readers:
        x = G.nodes[s.nodes[0]]["inputs"][0]
        assert (_bound(s, "xq"), _bound(s, "xs")) == tuple(ValueRef(v) for v in row_names(x, "fp8")), s.name
        assert {a.name: a.ctype for a in s.args}["xq"] == "const int*" and not s.params.get("down"), s.name
        assert not any(w.name in ("fp8_xq", "fp8_xs", "moe_xq", "moe_xs") for w in s.workspace), s.name
    # the quantisers left: o_proj's, the dense down's, the experts' down's (no norm makes their input)
    left = {s.nodes[0] for s in _launches(plan) if s.stage == "quant_x" and s.params["K"] == TINY["hidden_size"]}
    assert not left & fed, sorted(left & fed)


def test_the_norm_fed_quantisers_counted():
    """Each layer's q + kv_a (one quantiser, shared), layer 0's dense gate_up, the other layers' routed (and
    shared) gate_up at prefill sizes: 3 + 1 of the tiny model's 3 + 1 + 2 + 2 quantisers at T = 32 (o_proj x 3,
    the dense down; the experts are decode's tiles there), and at T = 300 the two MoE layers' gate_up too."""
    for phase in ir.PHASES:
        for T, gone in ((1, 0), (16, 0), (32, 4), (300, 6), (16384, 6)):
            n_on = sum(s.stage == "quant_x" for s in _running(_plan(phase, ON)[1], T))
            n_off = sum(s.stage == "quant_x" for s in _running(_plan(phase)[1], T))
            assert n_off - n_on == gone, (phase, T, n_off, n_on)


def test_without_fp8_activations_nothing_changes():
    """linear.fp8_activations and moe.fp8_activations off (the FP8 weights dequantised or widened, x kept
    16-bit): no reader multiplies FP8 x FP8, so the norms keep their plain launches at every T."""
    no_x = dict(linear=LinearTuning(fp8_activations=False, norm_fp8=False, fp8_chunks_upto=0), moe=MoeTuning(fp8_activations=False))
    both = dict(linear=LinearTuning(fp8_activations=False, norm_fp8=True, fp8_chunks_upto=0), moe=MoeTuning(fp8_activations=False))
    for phase in ir.PHASES:
        G, on = _plan(phase, Tuning(**both))
        _, off = _plan(phase, Tuning(**no_x))
        assert any(d["attrs"].get("quant") == "fp8" for _, d in G.nodes(data=True))
        assert [s.name for s in _launches(on)] == [s.name for s in _launches(off)], phase
        assert [s.grid for s in _launches(on)] == [s.grid for s in _launches(off)], phase


def test_the_rows_live_from_the_norm_to_their_last_reader():
    G, plan = _plan("prefill", ON)
    assert len(rows_live_to_their_readers(G, plan)) == 2 * TINY["num_hidden_layers"]


def rows_live_to_their_readers(G, plan) -> list[str]:
    """Every node with a qf8 launch: its e4m3 rows' and scales' arena slots live from it to their last reader.
    Returns those nodes."""
    from codegen.memplan import node_groups
    slots = {s.name: s for s in plan.arena}
    groups = node_groups(plan.steps)
    seen = []
    for at, (node, steps) in enumerate(groups):
        if not any(s.name.endswith("__qf8") for s in steps if isinstance(s, KernelLaunch)):
            continue
        q, sc = row_names(G.nodes[node]["outputs"][0], "fp8")
        readers = [i for i, (_, st) in enumerate(groups) if i != at and any(
            isinstance(a.ref, ValueRef) and a.ref.name == q for s in st if isinstance(s, KernelLaunch) for a in s.args)]
        assert readers and slots[q].first == at and slots[q].last == readers[-1], (node, slots[q], readers)
        assert (slots[sc].first, slots[sc].last) == (slots[q].first, slots[q].last)
        assert slots[q].dtype == "i32" and slots[sc].dtype == "f32"
        seen.append(node)
    return seen


def test_a_norm_writing_rows_is_no_segment_member():
    """A persistent segment's norm task body writes the 16-bit row only: the qf8 launches (and the qi8 ones)
    give none, the plain ones theirs."""
    from codegen import families
    _, plan = _plan("decode", ON)
    norms = [s for s in _launches(plan) if s.family in ("rms_norm", "fused_add_rms_norm")]
    assert any(s.name.endswith("__qf8") for s in norms) and any(not s.name.endswith("__qf8") for s in norms)
    for s in norms:
        body = families.family_named(s.family).segment_body(s)
        assert (body is None) == s.name.endswith("__qf8"), s.name


def _norm_graph(op: str, n: int):
    m = ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model
    if op == "moe_combine_residual_rms_norm":
        ins = {"eo": TType(("T*6", n), "act"), "w": TType(("T", 6), "f32"), "sh": TType(("T", n), "act"),
               "res": TType(("T", n), "act")}
    else:
        ins = {f"x{i}": TType(("T", n), "act") for i in range(1 if op == "rms_norm" else 2)}
    G, nid = single_op_graph(m, op, {}, ins, {"weight": "w"})
    return G, give_rows(G, nid, "fp8")


def _qf8_launch(op: str, n: int, monkeypatch, **opts):
    """The norm's qf8 launch alone: a reader multiplying FP8 x FP8 from T = 1 on (no real reader here)."""
    monkeypatch.setattr(_norm_quant, "fp8_from", lambda G, nid, o: 1)
    G, nid = _norm_graph(op, n)
    (launch,) = family_for_op(op).lower(nid, G, Options(tuning=ON, **opts))
    return launch


def test_a_norms_fp8_rows_need_16_bit_activations_and_whole_chunks(monkeypatch):
    with pytest.raises(LoweringError, match="fp8 rows need bf16 or fp16 activations, not fp32") as e:
        _qf8_launch("rms_norm", 64, monkeypatch, dtype="fp32")
    assert "\n" not in str(e.value)
    G, nid = _norm_graph("rms_norm", 64)
    G.graph["values"][G.nodes[nid]["inputs"][0]] = TType(("T", 72), "act")
    with pytest.raises(LoweringError, match="width 72 is not a multiple of 16"):
        family_for_op("rms_norm").lower(nid, G, Options(tuning=ON))


def test_without_a_fp8_x_fp8_reader_the_norm_writes_no_rows():
    G, nid = _norm_graph("fused_add_rms_norm", 2048)
    (launch,) = family_for_op("fused_add_rms_norm").lower(nid, G, Options(tuning=ON))
    assert launch.name == "fused_add_rms_norm__bf16__d2048" and launch.grid[0] == "T"


def test_the_norm_variant_renders_the_fp8_rows_and_its_scales_a_row(monkeypatch):
    from codegen.render import render_launch
    launch = _qf8_launch("fused_add_rms_norm", 272, monkeypatch)
    src = render_launch(launch)
    assert launch.name == "fused_add_rms_norm__bf16__d272__qf8" and launch.grid[0] == "T"
    assert "dsg::quant::norm_rows_fp8<N, 3, L>(v, hq, hs, t);" in src and "norm_rows_int8" not in src
    assert "unsigned char* __restrict__ hq," in src and "float* __restrict__ hs," in src


def _compile(launch, arch):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    return compile_cubin(render_launch(launch), launch.name, arch=arch, options=("--ptxas-options=-v",))


@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op, n, dtype", [("rms_norm", 2048, "bf16"), ("rms_norm", 144, "fp16"),
                                          ("fused_add_rms_norm", 2048, "bf16"), ("fused_add_rms_norm", 7168, "fp16"),
                                          ("moe_combine_residual_rms_norm", 2048, "bf16"),
                                          ("moe_combine_residual_rms_norm", 7168, "bf16")])
def test_the_norm_variants_compile_without_spills_on_the_quantisers_arithmetic(op, n, dtype, monkeypatch):
    from test_sass_pdl import wait_problem
    launch = _qf8_launch(op, n, monkeypatch, dtype=dtype, arch="sm_90a")
    res = _compile(launch, "sm_90a")
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log, res.log
    ops = opcodes(res.cubin)
    # amax / 448 and v / s: correctly rounded divisions (the reciprocal estimate refined, a FCHK guard), as
    # quant_fp8.cuh's; the e4m3x2 conversion (F2FP ... E4M3); the half-warp max: SHFL.BFLY; 8 bytes a chunk
    assert ops["FCHK"] > 0 and ops["MUFU.RCP"] > 0, sorted(ops)
    assert any(o.startswith("F2FP") and "E4M3" in o for o in ops), sorted(ops)
    assert ops["SHFL.BFLY"] >= 4, sorted(ops)
    assert ops["STG.E.64"] > 0, sorted(ops)
    assert wait_problem(instructions(res.cubin)[launch.name], weight_loads=True) is None


@pytest.mark.slow
def test_v2_lite_decode_runs_half_the_quantisers_at_b32_and_b128():
    """V2-Lite with FP8 weights (`dsgraph bench --weights fp8`'s spec), decode: 56 quantiser launches a step at
    b = 32 and 128 (q + kv_a and o_proj in 27 layers, the dense gate_up and down), 28 with the knob (the norm-fed
    q + kv_a and dense gate_up go); none at b = 1 either way; 55 norm launches a step (the final one too), 28
    of them qf8 (at b = 32 and 128 the MoE input norms keep their plain launch: the experts run FP8 x FP8 above 256)."""
    from runtime.bench import bench_spec
    spec = bench_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml"), "fp8")
    counts = {}
    for tuning in (OFF, ON):
        opts = Options(arch="sm_90a", tuning=tuning)
        plan = lower_graph(run_pipeline(ir.build_graph(spec, "decode"), knobs=pipeline_knobs(opts)), opts)
        for T in (1, 32, 128):
            env = {"T": T, "B": T, "NP": 8 * T, "MAXQ": 1, "MAXCTX": 512, "TK": T, "W": 8, "SMS": 132}
            run = [s for s in _launches(plan) if all(sizes.evaluate(g, env) > 0 for g in s.grid)]
            counts[tuning.linear.norm_fp8, T] = (sum(s.stage == "quant_x" for s in run),
                                                 sum(s.name.endswith("__qf8") for s in run),
                                                 sum(s.family in NORMS for s in run))
    assert counts == {(False, 1): (0, 0, 55), (False, 32): (56, 0, 55), (False, 128): (56, 0, 55),
                      (True, 1): (0, 0, 55), (True, 32): (28, 28, 55), (True, 128): (28, 28, 55)}, counts


@pytest.mark.slow
def test_a_bundle_keeps_the_norms_rows_through_the_manifest(tmp_path, monkeypatch):
    """compile_bundle with the knob (NVRTC stubbed: the machine code is tested above) writes the norms' two
    launches, the readers' value-bound rows and the rows' buffers, and load_bundle reads back the same plans."""
    import dataclasses
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

    def plain(steps):
        return [dataclasses.replace(s, origins=()) if isinstance(s, KernelLaunch) else s for s in steps]

    for phase in ir.PHASES:
        _, want = _plan(phase, ON)
        got = loaded.plans[phase]
        assert plain(got.steps) == plain(want.steps), phase
        assert any(s.name.endswith("__qf8") for s in _launches(got)), phase
        rows = {name: b for name, b in got.buffers.items() if name.endswith((".qf8", ".sf8"))}
        assert len(rows) == 4 * TINY["num_hidden_layers"], sorted(rows)
        assert all(b.dtype == ("i32" if n.endswith(".qf8") else "f32") for n, b in rows.items()), phase
