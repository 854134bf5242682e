"""The grouped experts' FP8 case (codegen/families/_moe_fp8.py, codegen/dispatch.py grouped_experts): FP8
expert weights lower to the wgmma_skinny_fp8 launch over decode's range (every token count with
moe.fp8_activations off; above decode the FP8 x FP8 launches: tests/codegen/test_moe_gemm_fp8.py), its name
carries "wfp8", its weights are 64 x 64-byte tensor maps (64B swizzle) with their block scales beside them;
the expert FFN runs as the two launches; `dsgraph explain` prints the FP8 rows; what no FP8 kernel serves
(fp32, an inner width not a multiple of 16, FP8 beside bf16 in one node) is one line; the kernels compile
for sm_90a without spills.  The decode refinements' knobs (moe.fp8_one_token_down, fp8_shared_before_wait,
fp8_widen_ahead): off, the launches are main's; on, which launches, grids, rings, names and operands, and
each variant compiles without spills."""
from __future__ import annotations

import pytest

from codegen import dispatch, families
from codegen.errors import LoweringError
from codegen.families import _moe_fp8, _moe_wgmma_skinny as S
from codegen.kernel import KernelLaunch, Options, TensorMapRef, WeightRef
from ir.formats import FP8, set_format, weight_formats_yaml
from ir.ops import TType
from runtime.cli import main
from tests.gpu.harness import single_op_graph, tiny_model
from tiny import ROOT

LITE = ROOT / "model_specs" / "deepseek_v2_lite.yaml"
EXPERTS = "model.layers.*.mlp.*_proj.weight"   # V3's FP8 globs' MLP half: experts, shared experts, dense MLP
FP8_FACTS = {"weight_format": FP8.name, "dtype": "bf16", "sm_90a": True, "fp8_rows": True, "fp8_fits": True}


def _node(op: str, KD: int, N: int, *, E: int = 8, K: int = 2, fp8_roles=None):
    r = TType((f"T*{K}", E), "routing")
    if op == "moe_down":
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"a": TType((f"T*{K}", KD), "act"), "R": r}, {"weight": "e.{expert}.down"})
    else:
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": N},
                                 {"x": TType(("T", KD), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})
    bound = G.nodes[nid]["weights"]
    for role in (bound if fp8_roles is None else fp8_roles):
        set_format(G.graph["weights"], bound[role], FP8)
    return G, nid


@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_gate_up", "moe_down"])
def test_fp8_experts_lower_to_the_fp8_launch_with_maps_and_scales(op):
    G, nid = _node(op, 144, 200)
    (la,) = [s for s in families.family_for_op(op).lower(nid, G, Options(dtype="bf16")) if s.stage == _moe_fp8.VARIANT]
    assert "bf16_wfp8" in la.name and la.grid[0].startswith("min(2 * SMS")
    maps = [a for a in la.args if isinstance(a.ref, TensorMapRef)]
    scales = [a for a in la.args if isinstance(a.ref, WeightRef)]
    assert maps and all(a.ref.box == (64, 64) and a.ref.swizzle == 64 for a in maps)
    assert sorted(a.ref.name for a in scales) == sorted(m.ref.weight + "_scale_inv" for m in maps)
    assert all(a.ctype == "const float*" for a in scales), [a.ctype for a in scales]


def test_the_fp8_row_serves_decode_and_every_token_count_with_16_bit_activations():
    from codegen.tuning import MoeTuning, Tuning
    weight_only = Tuning(moe=MoeTuning(fp8_activations=False))
    for down in (False, True):
        op = "moe_down" if down else "moe_gate_up_silu"
        for T in (1, 2, 8, 32, 128, 192, 256, 300, 16384):
            assert dispatch.select(op, T, FP8_FACTS, weight_only).variant == _moe_fp8.VARIANT
            assert dispatch.select(op, T, {**FP8_FACTS, "fp8x_fits": False}).variant == _moe_fp8.VARIANT
            above = Tuning().moe.fp8_activations_above   # 16: the FP8 x FP8 GEMM from 17 tokens
            assert dispatch.select(op, T, {**FP8_FACTS, "fp8x_fits": True}).variant == \
                (_moe_fp8.VARIANT if T <= above else "wgmma_fp8")
            # none: decode's tiles up to bf16's prefill threshold (256)
            follow = Tuning(moe=MoeTuning(fp8_activations_above=None))
            assert dispatch.select(op, T, {**FP8_FACTS, "fp8x_fits": True}, follow).variant == \
                (_moe_fp8.VARIANT if T <= 256 else "wgmma_fp8")


@pytest.mark.parametrize("why,opts,KD,roles", [
    ("bf16 or fp16 activations", Options(dtype="fp32"), 144, None),
    ("multiple of 16", Options(dtype="bf16"), 40, None),
    ("all in bf16 or all in", Options(dtype="bf16"), 144, ("gate",)),
])
def test_what_no_fp8_kernel_serves_is_one_line(why, opts, KD, roles):
    G, nid = _node("moe_gate_up_silu", KD, 64, fp8_roles=roles)
    with pytest.raises(LoweringError) as info:
        families.family_for_op("moe_gate_up_silu").lower(nid, G, opts)
    assert why in str(info.value) and "\n" not in str(info.value)


def test_explain_shows_the_fp8_rows_and_the_two_launches(tmp_path, capsys):
    spec = tmp_path / "lite_fp8.yaml"
    spec.write_text(LITE.read_text() + weight_formats_yaml((EXPERTS,), FP8))
    assert main(["explain", str(spec), "--tokens", "1,48,300", *FP8_DECODE_OFF_FLAGS]) == 0
    out = capsys.readouterr().out
    for T in (1, 48):
        block = out.split(f"decode, T = {T} ", 1)[1].split("\n\n", 1)[0]
        assert "moe_gate_up_silu__bf16_wfp8__e66_k8__m1408_d2048__wgmma_skinny_fp8" in block
        assert "moe_down__bf16_wfp8__e66__d2048_m1408__wgmma_skinny_fp8" in block
        assert "wgmma_skinny_fp8 [tokens 1..256]" in block and "moe_expert_ffn__" not in block
    prefill = out.split("prefill, T = 300 ", 1)[1].split("\n\n", 1)[0]
    assert "gemm_fp8__bf16__k1408__quant_x, moe_down__bf16_wfp8_afp8__e66__d2048_m1408__ovl__wgmma_fp8" in prefill
    assert "wgmma_fp8 [tokens 257..inf]: FP8 x FP8" in prefill


@pytest.mark.parametrize("op,KD,N,dtype", [("moe_gate_up_silu", 2048, 1408, "bf16"), ("moe_down", 1408, 2048, "fp16")])
def test_fp8_kernels_compile_for_sm90a_without_spills(op, KD, N, dtype):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    G, nid = _node(op, KD, N, E=64, K=6)
    (la,) = [s for s in families.family_for_op(op).lower(nid, G, Options(dtype=dtype)) if s.stage == _moe_fp8.VARIANT]
    assert isinstance(la, KernelLaunch)
    log = compile_cubin(render_launch(la), la.name, arch="sm_90a", options=("--ptxas-options=-v",)).log
    assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, log


# bf16's decode refinements on the FP8 tiles (on by default): each test below turns on the ones it names
FP8_DECODE_OFF = {"fp8_one_token_down": False, "fp8_shared_before_wait": False, "fp8_widen_ahead": False}
# ... on decode's tiles over bf16's decode range, 1-256 (by default the FP8 x FP8 GEMM takes T > 16)
TILES_TO_256 = {"fp8_activations_above": None}
FP8_DECODE_OFF_FLAGS = [f for k in FP8_DECODE_OFF for f in ("--tune", f"moe.{k}=false")] + \
    ["--tune", "moe.fp8_activations_above=none"]


def _fp8_tuning(**moe):
    from codegen.tuning import MoeTuning, Tuning
    return Tuning(moe=MoeTuning(**{**FP8_DECODE_OFF, **TILES_TO_256, **moe}))


def test_the_fp8_decode_refinements_are_on_by_default():
    """Measured on an H100 (PERF_NOTES v43): FP8 decode b=1 2.25 -> 2.14 ms with the three, b=8 and b=32 alike."""
    from codegen.tuning import Tuning
    assert all(getattr(Tuning().moe, k) for k in FP8_DECODE_OFF)


def _fp8_launches(op: str, tuning, KD: int = 1408, N: int = 2048, E: int = 66):
    G, nid = _node(op, KD, N, E=E, K=6)
    return [la for la in families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=tuning))
            if la.stage.startswith(_moe_fp8.VARIANT)]


def test_fp8_one_token_down_serves_t1_only_when_on():
    """moe.fp8_one_token_down off: down's FP8 launch at every decode T; on: its one-token launch at
    T = 1 (one CTA an SM, min(SMS, tiles); twice the FP8 stages of one_token_down_stages: the bf16
    one-token ring's weight bytes; the same operands and template) and the two-CTA launch from T = 2.
    gate / up never take it, nor down while one_token_down_stages leaves the bf16 one off (<= 4)."""
    from codegen import sizes
    assert [la.stage for la in _fp8_launches("moe_down", _fp8_tuning())] == [_moe_fp8.VARIANT]
    for st in (0, 4):
        assert [la.stage for la in _fp8_launches("moe_down", _fp8_tuning(fp8_one_token_down=True,
                                                                         one_token_down_stages=st))] == [_moe_fp8.VARIANT]
    assert [la.stage for la in _fp8_launches("moe_gate_up_silu", _fp8_tuning(fp8_one_token_down=True), 2048, 1408)] \
        == [_moe_fp8.VARIANT]
    for st in (5, 8):
        tuning = _fp8_tuning(fp8_one_token_down=True, one_token_down_stages=st)
        sk, t1 = _fp8_launches("moe_down", tuning)
        assert (sk.stage, t1.stage) == (_moe_fp8.VARIANT, _moe_fp8.ONE_TOKEN_VARIANT)
        assert t1.params["stages"] == 2 * st == _moe_fp8.one_token_stages(tuning)
        assert t1.smem == t1.params["smem"] == 2 * st * (128 * 64 + 32 * 128) + 1024
        assert _moe_fp8.fits(66, 2 * st, ctas=1) and (st < 8 or not _moe_fp8.fits(66, 2 * st))
        # the table's one_token fact (the bf16 ring at one CTA an SM) answers for the FP8 ring too
        assert all(_moe_fp8.fits(E, 2 * st, ctas=1) for E in range(1, 9000, 7) if S.fits(E, st, ctas=1))
        assert t1.name == sk.name + "_t1" and t1.args == sk.args and t1.template == sk.template
        assert t1.requires == sk.requires and t1.block == sk.block and t1.params["cols"] == sk.params["cols"] == 128
        for T in (1, 2, 3, 8, 256):
            env = {"T": T, "NP": 6 * T, "SMS": 132}
            ctas = {la.stage: sizes.evaluate(la.grid[0], env) for la in (sk, t1)}
            tiles = 16 * (6 * T // 32 + min(66, 6 * T))
            assert ctas == ({_moe_fp8.VARIANT: 0, _moe_fp8.ONE_TOKEN_VARIANT: min(132, tiles)} if T == 1 else
                            {_moe_fp8.VARIANT: min(264, tiles), _moe_fp8.ONE_TOKEN_VARIANT: 0}), (T, ctas)


def test_the_fp8_one_token_row_in_the_table():
    on = _fp8_tuning(fp8_one_token_down=True)
    for fp8x in (True, False):
        facts = {**FP8_FACTS, "fp8x_fits": fp8x, "one_token": True}
        assert [dispatch.select("moe_down", T, facts, on).variant for T in (1, 2, 256)] == \
            [_moe_fp8.ONE_TOKEN_VARIANT, _moe_fp8.VARIANT, _moe_fp8.VARIANT]
        assert dispatch.select("moe_down", 1, {**facts, "one_token": False}, on).variant == _moe_fp8.VARIANT
        assert dispatch.select("moe_down", 1, facts).variant == _moe_fp8.ONE_TOKEN_VARIANT   # the knob's default
        assert dispatch.select("moe_down", 1, facts, _fp8_tuning()).variant == _moe_fp8.VARIANT
        assert dispatch.select("moe_gate_up_silu", 1, facts, on).variant == _moe_fp8.VARIANT


def test_explain_shows_the_fp8_one_token_launch(tmp_path, capsys):
    spec = tmp_path / "lite_fp8.yaml"
    spec.write_text(LITE.read_text() + weight_formats_yaml((EXPERTS,), FP8))
    assert main(["explain", str(spec), "--tokens", "1,2", *FP8_DECODE_OFF_FLAGS, "--tune", "moe.fp8_one_token_down=true"]) == 0
    out = capsys.readouterr().out
    one = out.split("decode, T = 1 ", 1)[1].split("\n\n", 1)[0]
    two = out.split("decode, T = 2 ", 1)[1].split("\n\n", 1)[0]
    down = "moe_down__bf16_wfp8__e66__d2048_m1408__wgmma_skinny_fp8"
    assert f"{down}_t1" in one and "wgmma_skinny_fp8_t1 [tokens 1..1]: FP8 down at one token" in one
    assert f"{down}_t1" not in two and f"{down}\n" in two and "wgmma_skinny_fp8 [tokens 2..256]" in two


@pytest.mark.parametrize("st", [5, 8])
def test_fp8_one_token_down_compiles_for_sm90a_without_spills(st):
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    (la,) = [la for la in _fp8_launches("moe_down", _fp8_tuning(fp8_one_token_down=True, one_token_down_stages=st))
             if la.stage == _moe_fp8.ONE_TOKEN_VARIANT]
    log = compile_cubin(render_launch(la), la.name, arch="sm_90a", options=("--ptxas-options=-v",)).log
    assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, log


def _shared_launch(op: str, monkeypatch, on: bool, shared: int = 2):
    """Gate / up's FP8 launch at V2-Lite's widths, lowered as if its routing came from a route with
    `shared` shared experts (the test graph takes the routing as an input: _moe.routing_shared says 0)."""
    from codegen.families import _moe
    monkeypatch.setattr(_moe, "routing_shared", lambda G, routing: shared)
    G, nid = _node(op, 2048, 1408, E=66, K=8)
    (la,) = _fp8_launches_of(G, nid, op, _fp8_tuning(fp8_shared_before_wait=on))
    return la


def _fp8_launches_of(G, nid, op, tuning):
    return [la for la in families.family_for_op(op).lower(nid, G, Options(dtype="bf16", tuning=tuning))
            if la.stage == _moe_fp8.VARIANT]


@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_gate_up"])
def test_fp8_shared_before_wait_names_its_kernel_when_on(op, monkeypatch):
    """moe.fp8_shared_before_wait off: gate / up's FP8 launch waits at entry, as on main; on: its
    kernel takes the shared experts (name part sh2w, template parameter `shared`) and NP for T
    (num_pairs, its last argument); without shared experts, or for down, nothing changes."""
    off, on = _shared_launch(op, monkeypatch, False), _shared_launch(op, monkeypatch, True)
    assert "sh2w" not in off.name and "shared" not in off.params and off.args[-1].name != "num_pairs"
    assert on.name == off.name.replace("__wgmma_skinny_fp8", "__sh2w__wgmma_skinny_fp8")
    assert on.params == {**off.params, "shared": 2} and on.args == (*off.args, on.args[-1])
    assert on.args[-1].name == "num_pairs" and on.grid == off.grid and on.smem == off.smem
    assert _shared_launch(op, monkeypatch, True, shared=0).name == off.name
    from codegen.families import _moe
    monkeypatch.setattr(_moe, "routing_shared", lambda G, routing: 2)
    G, nid = _node("moe_down", 1408, 2048, E=66, K=8)
    tuned = [la.name for la in _fp8_launches_of(G, nid, "moe_down", _fp8_tuning(fp8_shared_before_wait=True))]
    assert tuned == [la.name for la in _fp8_launches_of(G, nid, "moe_down", _fp8_tuning())]


@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_gate_up", "moe_down"])
def test_fp8_widen_ahead_names_its_kernel_when_on(op, monkeypatch):
    """moe.fp8_widen_ahead off: the kernels as on main; on: name part wa, parameter `ahead`, the same
    launch otherwise (grid, shared memory, operands), with the other FP8 knobs too."""
    from codegen.families import _moe
    monkeypatch.setattr(_moe, "routing_shared", lambda G, routing: 2)
    KD, N = (1408, 2048) if op == "moe_down" else (2048, 1408)
    G, nid = _node(op, KD, N, E=66, K=8)
    off = _fp8_launches_of(G, nid, op, _fp8_tuning())
    for extra in ({}, {"fp8_shared_before_wait": True}):
        (on,) = _fp8_launches_of(G, nid, op, _fp8_tuning(fp8_widen_ahead=True, **extra))
        (base,) = _fp8_launches_of(G, nid, op, _fp8_tuning(**extra))
        assert on.name == base.name.replace("__wgmma_skinny_fp8", "__wa__wgmma_skinny_fp8")
        assert on.params == {**base.params, "ahead": True} and on.args == base.args and on.grid == base.grid
        assert on.smem == base.smem and "ahead" not in off[0].params


@pytest.mark.parametrize("op,knobs", [("moe_gate_up_silu", {}), ("moe_gate_up", {"fp8_shared_before_wait": True}),
                                      ("moe_down", {"fp8_one_token_down": True})])
def test_fp8_widen_ahead_compiles_without_spills_or_serialised_wgmma(op, knobs, monkeypatch):
    """Every widen-ahead variant compiles for sm_90a within 128 registers, no spills, and ptxas keeps its
    wgmma asynchronous (no C7514 "wgmma.mma_async instructions are serialized")."""
    from codegen.families import _moe
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    monkeypatch.setattr(_moe, "routing_shared", lambda G, routing: 2)
    KD, N = (1408, 2048) if op == "moe_down" else (2048, 1408)
    G, nid = _node(op, KD, N, E=66, K=8)
    tuning = _fp8_tuning(fp8_widen_ahead=True, **knobs)
    launches = [la for la in families.family_for_op(op).lower(nid, G, Options(dtype="fp16", tuning=tuning))
                if la.stage.startswith(_moe_fp8.VARIANT)]
    assert launches and all("__wa__" in la.name for la in launches)
    for la in launches:
        log = compile_cubin(render_launch(la), la.name, arch="sm_90a", options=("--ptxas-options=-v",)).log
        assert "0 bytes spill stores" in log and "0 bytes spill loads" in log and "serialized" not in log, log
