"""Decode's wgmma + TMA grouped expert GEMM (moe_wgmma_skinny.cuh, codegen/families/_moe_wgmma_skinny.py)
as a lowering choice, on the CPU: on by default for compute-capability-9.0 targets, 16-bit
activations and 16-byte rows, where it takes every T up to the prefill wgmma's threshold (the GEMV
and the mma launch, which then never run, are left out); elsewhere (fp32, odd KD, other targets)
the GEMV and the mma launch stay; exactly one launch runs at each T; its grid is persistent (two
CTAs per SM at most) over a tile bound no expert split exceeds; its weights are tensor maps of
64-row boxes; it requires sm_90a; it compiles to HGMMA fed by TMA and gathering copies on
mbarriers, without spills, in both 16-bit types and all three modes."""
from __future__ import annotations

import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, opcodes  # noqa: E402
from test_families_moe import DIMS, moe_graphs  # noqa: E402

from codegen import families, sizes  # noqa: E402
from codegen.families import _moe_wgmma_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, Options, TensorMapRef, WeightRef  # noqa: E402
from codegen.nvrtc import KernelCompileError, compile_cubin  # noqa: E402
from codegen.render import render_launch  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402

GROUPED = ("moe_gate_up_silu", "moe_gate_up", "moe_down")


def _moe(**knobs) -> Tuning:
    return Tuning(moe=MoeTuning(**knobs))


def _lower(G, nid, dtype="bf16", target="sm_90", tuning=Tuning()):
    return families.family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(arch=target, dtype=dtype, tuning=tuning))


def _grouped(dims="v2_lite"):
    return [(G, nid) for G, nid in moe_graphs(*DIMS[dims]) if G.nodes[nid]["op"] in GROUPED]


def _stages(G, nid, **kw):
    return [la.stage for la in _lower(G, nid, **kw)]


def _decode_stages(G, nid):
    """wgmma_skinny, and down's one-token launch (moe.one_token_down_stages) after it."""
    return ["wgmma_skinny", *[ONE] * (G.nodes[nid]["op"] == "moe_down")]


ONE = _moe_wgmma_skinny.ONE_TOKEN_STAGE


def test_on_by_default_for_compute_capability_90_16bit_and_whole_16_byte_rows():
    assert MoeTuning().decode_wgmma and MoeTuning().decode_wgmma_from == 0
    for G, nid in _grouped():
        for target in ("sm_90", "sm_90a"):
            assert _stages(G, nid, target=target) == [*_decode_stages(G, nid), "wgmma"]
            assert _stages(G, nid, dtype="fp16", target=target) == [*_decode_stages(G, nid), "wgmma"]
        for target in ("sm_80", "sm_100"):
            assert _stages(G, nid, target=target) == ["gemv", "mma"]
        assert _stages(G, nid, dtype="fp32") == ["gemv"]
    # KD % 8 != 0 ("odd": D = 40 is fine for gate/up, M = 36 is not for down)
    stages = {G.nodes[nid]["op"]: _stages(G, nid) for G, nid in _grouped("odd")}
    assert stages == {"moe_gate_up_silu": ["wgmma_skinny", "wgmma"], "moe_gate_up": ["wgmma_skinny", "wgmma"],
                      "moe_down": ["gemv", "mma"]}


def test_without_the_one_token_launch_down_keeps_one_launch():
    """moe.one_token_down_stages at STAGES (or 0): down's one launch takes every T of its range."""
    for st in (0, _moe_wgmma_skinny.STAGES):
        for G, nid in _grouped():
            assert _stages(G, nid, tuning=_moe(one_token_down_stages=st)) == ["wgmma_skinny", "wgmma"]


def test_off_keeps_the_gemv_and_the_mma_launch():
    for G, nid in _grouped():
        assert _stages(G, nid, tuning=_moe(decode_wgmma=False)) == ["gemv", "mma", "wgmma"]


def _worst_tiles(NP: int, E: int, bp: int = 64) -> int:
    """Most 64-pair row tiles NP pairs make over E experts (no expert has more than T = NP / 6)."""
    T = NP // 6
    splits = ([NP // E + (i < NP % E) for i in range(E)],               # even
              [1] * min(E - 1, NP - 1) + [NP - min(E - 1, NP - 1)],     # one big, the rest one pair each
              [bp + 1] * min(E, NP // (bp + 1)))                       # many just past a tile
    return max(sum(-(-min(c, T) // bp) for c in counts) for counts in splits)


@pytest.mark.parametrize("from_tokens", [0, 8])
def test_one_launch_runs_at_each_T_and_the_grid_covers_every_tile(from_tokens):
    """moe.decode_wgmma_from 0 (the default): no GEMV; 8: the GEMV keeps T <= 8."""
    tuning = _moe(decode_wgmma_from=from_tokens)
    upper = tuning.moe.prefill_wgmma_above
    for G, nid in _grouped():
        launches = _lower(G, nid, tuning=tuning)
        by = {la.stage: la for la in launches}
        one = ONE in by
        assert one == (G.nodes[nid]["op"] == "moe_down" and not from_tokens)
        assert list(by) == (["gemv"] if from_tokens else []) + ["wgmma_skinny", *[ONE] * one, "wgmma"]
        sk = by["wgmma_skinny"]
        p = sk.params
        assert sk.requires == ("sm_90a",) and sk.block == (256, 1, 1)
        assert sk.smem == p["smem"] == 4 * (128 + 64) * 64 * 2 + 1024          # ring, alignment slack
        assert 2 * (sk.smem + _moe_wgmma_skinny.static_smem(p["E"]) + 1024) <= 228 * 1024   # two CTAs an SM
        if one:   # the deeper ring, one CTA an SM, the same operands, kernel and tile
            t1 = by[ONE]
            st = tuning.moe.one_token_down_stages
            assert t1.smem == t1.params["smem"] == st * (128 + 64) * 64 * 2 + 1024 and st > 4
            assert t1.smem + _moe_wgmma_skinny.static_smem(p["E"], st) + 1024 <= 228 * 1024 < 2 * t1.smem
            assert t1.args == sk.args and t1.template == sk.template and t1.requires == sk.requires
            assert t1.name == sk.name + "_t1" and t1.params["cols"] == p["cols"]
        assert p["cols"] == (128 if G.nodes[nid]["op"] == "moe_down" else 64)
        ncols = -(-p["N"] // p["cols"])
        for T in (1, 2, 8, 9, 32, 128, upper, upper + 1, 2048):
            env = {"T": T, "NP": 6 * T, "SMS": 132}
            runs = {st: sizes.evaluate(la.grid[0], env) > 0 for st, la in by.items()}
            assert sum(runs.values()) == 1, (T, runs)
            assert (runs["wgmma_skinny"] or runs.get(ONE, False)) == (from_tokens < T <= upper), (T, runs)
            assert runs.get(ONE, False) == (one and T == 1), (T, runs)
            if runs["wgmma_skinny"] or runs.get(ONE, False):
                bound = ncols * (6 * T // 64 + min(64, 6 * T))
                ctas = sizes.evaluate((by[ONE] if T == 1 and one else sk).grid[0], env)
                assert ctas == min((1 if T == 1 and one else 2) * 132, bound)
                assert bound >= ncols * _worst_tiles(6 * T, 64)


def test_weights_are_tensor_maps_of_64_row_boxes():
    for G, nid in _grouped():
        sk, *_, wg = _lower(G, nid)
        maps = [a for a in sk.args if isinstance(a.ref, TensorMapRef)]
        assert maps and not any(isinstance(a.ref, WeightRef) for a in sk.args)
        assert [a.ref.weight for a in maps] == [a.ref.weight for a in wg.args if isinstance(a.ref, TensorMapRef)]
        assert all(a.ref.box == (64, 64) and a.ref.swizzle == 128 for a in maps)


def test_without_the_prefill_wgmma_the_mma_launch_keeps_the_tokens_above():
    """600 experts: the prefill wgmma's row-tile table no longer fits beside its ring, decode's does;
    the mma launch then takes T above 256."""
    many = (600, *DIMS["v2_lite"][1:])
    for G, nid in moe_graphs(*many):
        if G.nodes[nid]["op"] not in GROUPED:
            continue
        sk, *one, mma = _lower(G, nid)
        assert (sk.stage, *[o.stage for o in one], mma.stage) == ("wgmma_skinny", *_decode_stages(G, nid)[1:], "mma")
        for T in (1, 256, 257, 4096):
            env = {"T": T, "NP": 6 * T, "SMS": 132}
            skinny = any(sizes.evaluate(la.grid[0], env) > 0 for la in (sk, *one))
            assert (skinny, sizes.evaluate(mma.grid[1], env) > 0) == (T <= 256, T > 256)


@pytest.mark.slow
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op,dtype", list(itertools.product(GROUPED, ("bf16", "fp16"))))
def test_compiles_to_hgmma_fed_by_tma_and_gathering_copies(op, dtype):
    """Two HGMMA 64xNx16 a 16-wide K step for each of N = 16, 32, 64 (the tile's pair count picks
    one), weights as 3-D TMA boxes, pair rows as 16-byte cp.async that arrive on the stage's
    mbarrier; no mma.sync fall-back, no spills, at most 128 registers (two 256-thread CTAs an SM)."""
    for G, nid in _grouped():
        if G.nodes[nid]["op"] != op:
            continue
        for sk in [la for la in _lower(G, nid, dtype=dtype) if la.stage in ("wgmma_skinny", ONE)]:
            res = compile_cubin(render_launch(sk), sk.name, arch="sm_90a", options=("--ptxas-options=-v",))
            ops = opcodes(res.cubin)
            suffix = ".BF16" if dtype == "bf16" else ""
            for n in (16, 32, 64):
                assert ops[f"HGMMA.64x{n}x16.F32{suffix}"] == 8, sorted(ops)
            assert not any(k.startswith("HMMA") for k in ops), "no mma.sync path inside"
            assert ops["UTMALDG.3D"] > 0 and ops["UTMACCTL.PF"] > 0
            assert ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0 and ops["ARRIVES.LDGSTSBAR.64.ARVCNT"] > 0
            assert ops["SYNCS.PHASECHK.TRANS64.TRYWAIT"] > 0
            assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
            assert int(res.log.split("Used ")[1].split(" registers")[0]) <= 128, res.log
            with pytest.raises(KernelCompileError, match="sm_90a"):
                compile_cubin(render_launch(sk), sk.name, arch="sm_90")


@pytest.mark.slow
@pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_down"])
def test_the_staged_epilogue_compiles_to_whole_chunk_stores_without_spills(op):
    """The epilogue through shared memory (moe_wgmma_skinny.cuh; `moe.decode_staged_from`,
    0 in these two launches, which serve 1-3 tokens; the fused launch's is on) is rendered into
    the kernel's source and, on from 32 pairs, compiles to 2-byte shared stores, 16-byte shared loads and 16-byte global stores, no
    spills, at most 128 registers; off, the kernel has no 16-byte global store at all."""
    for G, nid in _grouped():
        if G.nodes[nid]["op"] != op:
            continue
        kernels = {}
        for staged in (0, 32):
            (sk,) = [la for la in _lower(G, nid, tuning=_moe(decode_staged_from=staged)) if la.stage == "wgmma_skinny"]
            src = render_launch(sk)
            assert f"#define DSG_WS_STAGED_FROM_BP {staged}" in src
            assert ("__st32__" in sk.name) == bool(staged), sk.name   # other code, another name
            kernels[staged] = compile_cubin(src, sk.name, arch="sm_90a", options=("--ptxas-options=-v",))
        off, on, res = opcodes(kernels[0].cubin), opcodes(kernels[32].cubin), kernels[32]
        assert off["STG.E.128"] == 0 and on["STG.E.128"] > 0 and on["LDS.128"] > 0 and on["STS.U16"] > 0, sorted(on)
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        assert int(res.log.split("Used ")[1].split(" registers")[0]) <= 128, res.log


@pytest.mark.parametrize("phase,tuning", [("prefill", Tuning()), ("decode", _moe(expert_ffn_upto=0))])
def test_a_shared_experts_early_tile_runs_only_while_it_is_one_row_tile(phase, tuning):
    """gate / up's early shared tile takes its pairs in token order, the walk's later tiles of the same
    expert the route's `order`: above one 64-pair row tile a shared expert (T > 64) the two could split its
    pairs differently, so the launch without the early tile takes those T (V2-Lite: two shared experts)."""
    from codegen.bundle import plan_spec
    from codegen.paths import DEFAULT_SPEC
    plan = plan_spec(str(DEFAULT_SPEC), Options(tuning=tuning), strict=False).plans[phase]
    gate_up = [s for s in plan.steps if isinstance(s, KernelLaunch) and s.family == "moe_gate_up_silu"
               and s.stage == "wgmma_skinny"]
    node = gate_up[0].nodes
    sk = [la for la in gate_up if la.nodes == node]
    assert len(sk) == 2 and sum("__sh2w__" in la.name for la in sk) == 1
    for T in (1, 2, 63, 64, 65, 128, 200, 256):
        env = {"T": T, "NP": 8 * T, "SMS": 132}
        runs = [la.name for la in sk if sizes.evaluate(la.grid[0], env) > 0]
        assert len(runs) == (1 if phase == "prefill" or T <= 256 else 0), (T, runs)
        assert ("__sh2w__" in runs[0]) == (T <= 64), (T, runs)
