"""The grouped experts' int8 wgmma prefill GEMM on the CPU (codegen/families/_moe_gemm_int.py,
templates/include/moe_gemm_int.cuh): Tuning.moe.int_wgmma_above (default None: off) splits the grouped_experts
table's int rows for int4_channel and int8_channel weights into mma_int up to it and wgmma_int above it on
sm_90a; other integer formats, shapes the kernel cannot serve and the knob off keep mma_int; the launches
reuse _moe_int's quantiser and workspaces and bind the stored weights as [64 (int4 gate / up: 32) x 128-byte]
tensor maps; moe_expert_ffn's two-launch path and a tiny W4A8 bundle take them; NVRTC makes int8 wgmma
(IGMMA ... S8.S8), 3-D TMA boxes and the gathered rows' cp.async for sm_90a without spills."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from codegen import dispatch, sizes
from codegen.families import _moe_gemm_int, _moe_int
from codegen.kernel import KernelLaunch, Options, TensorMapRef, WeightRef, WorkspaceRef
from codegen.tuning import MoeTuning, Tuning, TuningError, parse_tune
from ir.formats import FORMATS
from sass import cuobjdump, opcodes
from test_moe_int_lowering import _lower, _node
from tiny import ROOT

ON = Tuning(moe=MoeTuning(int_wgmma_above=64))
SERVED = ("int4_channel", "int8_channel")
FACTS = {"dtype": "bf16", "int_rows": True, "sm_90a": True, "int_wgmma_rows": True, "int_wgmma_fits": True}


def _running(steps, T, K):
    env = {"T": T, "NP": T * K, "SMS": 132}
    return [s.stage for s in steps if all(sizes.evaluate(g, env) > 0 for g in s.grid)]


def test_the_knob_is_off_by_default_and_takes_its_choices():
    assert Tuning().moe.int_wgmma_above is None
    assert parse_tune(["moe.int_wgmma_above=64"]).moe.int_wgmma_above == 64
    assert parse_tune(["moe.int_wgmma_above=none"]).moe.int_wgmma_above is None
    for bad in ("65", "0"):
        with pytest.raises(TuningError, match="int_wgmma_above"):
            parse_tune([f"moe.int_wgmma_above={bad}"])
    assert ON.flags() == ["--tune moe.int_wgmma_above=64"]
    assert ON.to_json() != Tuning().to_json()          # part of the cache key and the manifest


@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_down"])
def test_the_table_rows(op):
    for fmt in SERVED:
        facts = {**FACTS, "weight_format": fmt}
        assert [r.variant for r in dispatch.rows(op, facts)] == [_moe_int.VARIANT]          # off by default
        rows = dispatch.rows(op, facts, ON)
        assert [(r.variant, r.span) for r in rows] == [("mma_int", "1..64"), ("wgmma_int", "65..inf")]
        assert "s8 x s8 -> s32" in rows[1].reason and "per-group int4" in rows[1].reason
        for miss in ("sm_90a", "int_wgmma_rows", "int_wgmma_fits"):
            assert dispatch.select(op, 16384, {**facts, miss: False}, ON).variant == _moe_int.VARIANT, miss
        t = Tuning(moe=MoeTuning(int_wgmma_above=1024))
        assert [dispatch.select(op, n, facts, t).variant for n in (1024, 1025)] == ["mma_int", "wgmma_int"]
    for fmt in ("int4_group256_packed", "int4_channel_byte", "int4_group256"):
        facts = {**FACTS, "weight_format": fmt}
        assert dispatch.select(op, 16384, facts, ON).variant == _moe_int.VARIANT, fmt


def test_the_facts_refuse_what_the_kernel_cannot_serve():
    opts = Options(tuning=ON)
    p = {"int": "int4_channel", "KD": 2048, "N": 1408, "E": 64}
    assert _moe_gemm_int.facts(opts, p) == {"int_wgmma_rows": True, "int_wgmma_fits": True}
    assert _moe_gemm_int.facts(opts, {**p, "N": 176})["int_wgmma_rows"]            # partial packed boxes: TMA's zeros
    assert not _moe_gemm_int.facts(opts, {**p, "N": 177})["int_wgmma_rows"]        # two channels a byte
    assert not _moe_gemm_int.facts(opts, {**p, "KD": 2040})["int_wgmma_rows"]      # KD % 16
    assert not _moe_gemm_int.facts(opts, {**p, "KD": 1 << 17})["int_wgmma_rows"]   # exact int32 sums
    assert _moe_gemm_int.facts(opts, {**p, "int": "int8_channel", "N": 37})["int_wgmma_rows"]
    assert _moe_gemm_int.facts(opts, {**p, "int": "int4_group256_packed"}) == \
        {"int_wgmma_rows": False, "int_wgmma_fits": False}
    assert _moe_gemm_int.facts(opts, {**p, "E": 256})["int_wgmma_fits"]            # V3's experts
    assert not _moe_gemm_int.facts(opts, {**p, "E": 16384})["int_wgmma_fits"]


def test_the_shared_memory_of_each_format():
    assert _moe_gemm_int.smem(1) == 6 * 32768 + 32768 + 1024                 # gemm_int8's ring
    assert _moe_gemm_int.smem(2) == 4 * (32768 + 8192) + 32768 + 1024        # + the packed staging, 4 stages
    for pack in (1, 2):
        assert _moe_gemm_int.smem(pack) + _moe_gemm_int.static_smem(pack, 256) <= 227 * 1024


def _ring_runs(st: int, lag: int, tiles: list[int]) -> bool:
    """moe_gemm_int.cuh's packed int4 handshake as two actors (the producer warpgroup; the consumers, which
    do the same waits), run until neither can move: True when both finish, False on a deadlock.  Producer
    step it: wait empty (step it - ST released), issue the box and the gathered rows, then unpack step
    it - lag once landed (full[it - lag]: the rows' and the unpackers' arrivals); after the walk the last lag
    steps' unpacks.  Consumer: wait full[it], its wgmmas, then release the previous step of the tile (wait<1>);
    at a tile's end the last one (wait<0>).  `tiles`: the K blocks of each of the CTA's tiles."""
    steps = sum(tiles)
    full, released = set(), set()

    def producer():
        for it in range(steps):
            yield lambda it=it: it < st or it - st in released
            if it >= lag:
                full.add(it - lag)          # landed long since: TMA's wait is not the question here
        for step in range(max(0, steps - lag), steps):
            full.add(step)
        yield None

    def consumer():
        it = 0
        for kb_count in tiles:
            prev = None
            for _ in range(kb_count):
                yield lambda it=it: it in full
                if prev is not None:
                    released.add(prev)
                prev, it = it, it + 1
            released.add(prev)
        yield None

    actors = [producer(), consumer()]
    waits = [next(a) for a in actors]
    while any(w is not None for w in waits):
        moved = False
        for i, w in enumerate(waits):
            if w is not None and w():
                waits[i], moved = next(actors[i]), True
        if not moved:
            return False
    return True


def test_the_packed_ring_is_live_at_its_stages_and_lag():
    """The unpack of step it - IWG_LAG comes after step it's empty wait, and a consumer frees a stage only once
    the next step's wgmmas are issued: the ring needs ST >= IWG_LAG + 2 (a 3-stage ring, or IWG_LAG 3 at 4
    stages, deadlocks once two consecutive K blocks of one tile are a ring's length behind); the kernel's
    static_assert says so."""
    import re
    text = (ROOT / "templates" / "include" / "moe_gemm_int.cuh").read_text()
    lag = int(re.search(r"constexpr int IWG_LAG = (\d+);", text).group(1))
    st = _moe_gemm_int.STAGES[2]
    for tiles in ([1], [2], [16], [1, 1, 1, 1, 1], [3, 1, 11], [11] * 4):
        assert _ring_runs(st, lag, tiles), (st, lag, tiles)
    assert not _ring_runs(lag + 1, lag, [16]) and not _ring_runs(st, st - 1, [16])
    assert not _ring_runs(lag + 1, lag, [1, 2, 1, 1])   # steps 1 and 2 of one tile, a stage apart
    assert _ring_runs(lag + 1, lag, [1] * 8)            # one K block a tile frees each stage at once
    assert "ST >= IWG_LAG + 2" in text


@pytest.mark.parametrize("fmt", SERVED)
@pytest.mark.parametrize("op,KD,N", [("moe_gate_up_silu", 2048, 1408), ("moe_down", 1408, 2048)])
def test_launches_below_and_above_the_knob(op, KD, N, fmt):
    down = op == "moe_down"
    G, nid = _node(op, KD, N, E=64, K=6, fmt=FORMATS[fmt])
    off = _lower(G, nid, Options(dtype="bf16"))
    assert [s.stage for s in off] == [_moe_int.QUANT_STAGE, _moe_int.VARIANT]
    steps = _lower(G, nid, Options(dtype="bf16", tuning=ON))
    assert [s.stage for s in steps] == [_moe_int.QUANT_STAGE, _moe_int.VARIANT, _moe_int.QUANT_STAGE, "wgmma_int"]
    for T in (1, 16, 64):
        assert _running(steps, T, 6) == [_moe_int.QUANT_STAGE, _moe_int.VARIANT]
    for T in (65, 512, 16384):
        assert _running(steps, T, 6) == [_moe_int.QUANT_STAGE, "wgmma_int"]
    q0, mma, q1, la = steps
    # below the knob: the knob-off launches exactly, their grids limited to T <= 64
    assert [(s.name, s.params, s.args, s.workspace) for s in (q0, mma)] == \
        [(s.name, s.params, s.args, s.workspace) for s in off]
    # above: the same quantiser and workspaces, then the GEMM reading them
    assert (q1.name, q1.params, q1.args, q1.workspace) == (q0.name, q0.params, q0.args, q0.workspace)
    assert la.workspace == q1.workspace == _moe_int.workspaces(mma.params, down=down)
    tag = _moe_int.TAGS[fmt]
    assert la.name == f"{op}__bf16_{tag}__" + ("e64__d2048_m1408" if down else "e64_k6__m1408_d2048") + "__wgmma_int"
    assert la.requires == ("sm_90a",) and la.block == (384, 1, 1) and la.template == _moe_int.TEMPLATE
    pack = FORMATS[fmt].pack
    assert la.smem == _moe_gemm_int.smem(pack) and la.params["stages"] == (4 if pack == 2 else 6)
    assert la.params["cols"] == (128 if down else 64) and la.params["pack"] == pack
    refs = {a.name: a.ref for a in la.args}
    q_ws, s_ws = (w.name for w in la.workspace)
    assert refs["xq"] == WorkspaceRef(q_ws) and refs["xs"] == WorkspaceRef(s_ws)
    maps = {a.name: a.ref for a in la.args if isinstance(a.ref, TensorMapRef)}
    assert set(maps) == ({"w"} if down else {"w_gate", "w_up"})
    rows = 64 if pack == 1 or down else 32                  # int4 gate / up: 32 packed rows = the tile's 64 channels
    assert all(m.box == (rows, 128) and m.swizzle == 128 for m in maps.values())
    scales = {a.name: a.ref for a in la.args if isinstance(a.ref, WeightRef)}
    assert set(scales) == ({"s"} if down else {"s_gate", "s_up"})
    assert {m.weight for m in maps.values()} == {r.name for a, r in {a.name: a.ref for a in mma.args}.items()
                                                 if a in maps}
    # 1408 / 2048 columns in tiles of 64 / 128: 22 or 16 column tiles; NP = 3072: <= 24 + 64 row tiles
    assert sizes.evaluate(la.grid[0], {"T": 512, "NP": 3072, "SMS": 132}) == 132


@pytest.mark.parametrize("fmt", ("int4_group256_packed", "int4_channel_byte", "int4_group256"))
def test_other_integer_formats_keep_mma_int(fmt):
    for op, KD, N in (("moe_gate_up_silu", 2048, 1408), ("moe_down", 1536, 2048)):
        G, nid = _node(op, KD, N, E=8, fmt=FORMATS[fmt])
        assert [s.stage for s in _lower(G, nid, Options(tuning=ON))] == [_moe_int.QUANT_STAGE, _moe_int.VARIANT]


@pytest.mark.parametrize("op,KD,N,fmt", [("moe_gate_up_silu", 1001, 1408, "int8_channel"),  # KD % 16
                                         ("moe_down", 72, 34, "int4_channel")])
def test_shapes_the_kernel_cannot_serve_keep_mma_int(op, KD, N, fmt):
    G, nid = _node(op, KD, N, E=8, fmt=FORMATS[fmt])
    assert [s.stage for s in _lower(G, nid, Options(tuning=ON))] == [_moe_int.QUANT_STAGE, _moe_int.VARIANT]


@pytest.mark.parametrize("op,KD,N,fmt", [("moe_down", 144, 37, "int8_channel"),      # N odd: one value a byte
                                         ("moe_down", 176, 144, "int4_channel"),     # a partial packed box
                                         ("moe_gate_up_silu", 144, 176, "int4_channel")])
def test_ceil_widths_take_the_gemm(op, KD, N, fmt):
    G, nid = _node(op, KD, N, E=2, fmt=FORMATS[fmt])
    assert "wgmma_int" in [s.stage for s in _lower(G, nid, Options(tuning=ON))]


@pytest.mark.parametrize("fmt", SERVED)
def test_the_expert_ffn_runs_both_pairs_on_the_gemm_above_the_knob(fmt):
    from codegen.families import moe_expert_ffn
    G, nid = _node("moe_expert_ffn", 2048, 1408, E=64, K=6, fmt=FORMATS[fmt])
    steps = moe_expert_ffn.lower(nid, G, Options(dtype="bf16", tuning=ON))
    assert [s.stage for s in steps if _running([s], 64, 6)] == [_moe_int.QUANT_STAGE, _moe_int.VARIANT] * 2
    above = [s for s in steps if _running([s], 65, 6)]
    assert [s.stage for s in above] == [_moe_int.QUANT_STAGE, "wgmma_int"] * 2
    gu_q, gu, dn_q, dn = above
    assert {a.name: a.ref for a in gu.args}["out"] == WorkspaceRef(moe_expert_ffn.WORKSPACE)
    assert {a.name: a.ref for a in dn_q.args}["x"] == WorkspaceRef(moe_expert_ffn.WORKSPACE)
    assert gu.params["N"] == 1408 and dn.params["N"] == 2048 and not gu.params["down"] and dn.params["down"]


def _tiny_w4a8(tmp_path):
    from codegen.families import _moe_int as mi   # noqa: F401  (the int experts' lowering)
    from ir.config_to_spec import spec_from_config
    tiny = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
    path = tmp_path / "tiny_w4a8.yaml"
    path.write_text(spec_from_config({**tiny, "quantize": "w8a8_dynamic", "moe_quantize": "w4a8_dynamic"},
                                     name="tiny_w4a8"))
    return path


def test_a_tiny_w4a8_bundle_keeps_the_gemm_through_the_manifest(tmp_path, monkeypatch):
    """compile_bundle with the knob on (NVRTC stubbed: the machine code is tested below) writes both phases'
    expert GEMMs with their quantisers (one quantiser kernel serving both rows), and load_bundle reads back
    the same plans."""
    import codegen.nvrtc as nvrtc
    import ir
    from codegen.bundle import compile_bundle, load_bundle
    from codegen.lower import lower_graph, pipeline_knobs
    from ir.passes import run_pipeline
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, **kw: nvrtc.CompileResult(
        cubin=b"CUBIN:" + hashlib.sha256(source.encode()).digest(), log=""))
    path = _tiny_w4a8(tmp_path)
    compile_bundle(str(path), tmp_path / "bundle", cache_dir=tmp_path / "cache", progress=False, tuning=ON)
    loaded = load_bundle(tmp_path / "bundle", arch="sm_90")
    spec = ir.load_spec(str(path))
    opts = Options(tuning=ON)

    def ours(steps):
        return [dataclasses.replace(s, origins=()) for s in steps
                if isinstance(s, KernelLaunch) and s.template == _moe_int.TEMPLATE]
    for phase in ("decode", "prefill"):
        want = ours(lower_graph(run_pipeline(ir.build_graph(spec, phase), knobs=pipeline_knobs(opts)), opts).steps)
        assert any(s.stage == "wgmma_int" for s in want), phase
        assert ours(loaded.plans[phase].steps) == want, phase


@pytest.mark.slow
def test_explain_shows_the_row():
    from runtime.cli import main as cli_main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["explain", "--weights", "w4a8", "--tune", "moe.int_wgmma_above=64", "--tokens", "512",
                         "--phase", "prefill"]) == 0
    text = buf.getvalue()
    assert "moe_gate_up_silu__bf16_wi4__e64_k6__m1408_d2048__wgmma_int" in text, text
    assert "moe_down__bf16_wi4__e64__d2048_m1408__wgmma_int" in text, text
    # and why: the row's reason under each expert GEMM (the int cases name their formats as a tuple)
    whys = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("why    wgmma_int [tokens 65..inf]: ")]
    assert len(whys) == 2, text


@pytest.mark.slow
def test_explain_says_why_the_integer_experts_run_mma_int():
    """Below the knob's T, and with the knob off, the grouped int rows' reason is mma_int's, with its span (decode
    runs the expert FFN's two launches: its why names their own tables' rows)."""
    from runtime.cli import main as cli_main
    import contextlib
    import io
    for tune, span in ((["--tune", "moe.int_wgmma_above=64"], "1..64"), ([], "1..inf")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli_main(["explain", "--weights", "w4a8", *tune, "--tokens", "32", "--phase", "decode"]) == 0
        text = buf.getvalue()
        whys = [ln for ln in text.splitlines() if ln.strip().startswith("why    two_launch [tokens 1..inf]: ")]
        assert len(whys) == 1 and f"; mma_int [tokens {span}]: integer weights x int8" in whys[0], text


@pytest.mark.slow
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("fmt", SERVED)
@pytest.mark.parametrize("op,KD,N,E,K", [("moe_gate_up_silu", 2048, 1408, 64, 6),   # V2-Lite
                                          ("moe_down", 1408, 2048, 64, 6),
                                          ("moe_gate_up_silu", 7168, 2048, 256, 8),  # V3.1
                                          ("moe_down", 2048, 7168, 256, 8)])
def test_the_gemm_compiles_to_int8_wgmma_without_spills(op, KD, N, E, K, fmt):
    from codegen.arch import kernel_target
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    G, nid = _node(op, KD, N, E=E, K=K, fmt=FORMATS[fmt])
    (la,) = [s for s in _lower(G, nid, Options(dtype="bf16", tuning=ON)) if s.stage == "wgmma_int"]
    res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                        options=("--ptxas-options=-v",))
    assert "0 bytes stack frame" in res.log and "0 bytes spill stores" in res.log and \
        "0 bytes spill loads" in res.log, res.log
    ops = opcodes(res.cubin)
    assert ops["IGMMA.64x128x32.S8.S8"] == 4, sorted(ops)             # four k32 steps a 128-byte stage
    boxes = 1 if FORMATS[fmt].pack == 2 and op == "moe_down" else 2    # packed down: one box of 64 packed rows
    assert ops["UTMALDG.3D"] == boxes and ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0, sorted(ops)
    assert ops["I2FP.F32.S32"] > 0, "the epilogue: the exact int32 sum to float, then the two scales"
    if op == "moe_down":
        assert not any(o.startswith("FFMA") for o in ops), "no FMA may merge the epilogue's two products"
    assert not any(o.startswith(("HGMMA", "QGMMA", "IMMA", "LDL", "STL")) for o in ops), sorted(ops)
