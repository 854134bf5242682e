"""The wgmma + TMA grouped expert GEMM (moe_wgmma.cuh, codegen/families/_moe_wgmma.py) as a
lowering choice, on the CPU: on by default above Tuning.moe.prefill_wgmma_above tokens, only for compute-capability-9.0
targets (sm_90, sm_90a), 16-bit activations and 16-byte rows; it takes every T above its threshold
from the mma launch, with a persistent grid that covers every row tile; its weights are tensor
maps, which the manifest carries and reads back; it requires sm_90a, so a bundle builds that kernel
alone for sm_90a, records it, and is refused on a device of another compute capability in one line
that names it.  The target the runtime picks for a device (codegen/arch.py) is dsgraph compile's
default wherever the device runs it."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_families_moe import DIMS, moe_graphs  # noqa: E402

import codegen.nvrtc as nvrtc  # noqa: E402
from codegen import arch, families, sizes  # noqa: E402
from codegen.bundle import BundleError, check_compatible, compile_bundle, load_manifest  # noqa: E402
from codegen.families import _moe_wgmma  # noqa: E402
from codegen.families.mla_decode_attention import smem_limit  # noqa: E402
from codegen.kernel import (DEFAULTS, TENSOR_MAP_CTYPE, Arg, KernelLaunch, Options, TensorMapRef,  # noqa: E402
                            WeightRef, ref_from_json, ref_to_json)
from codegen.manifest import step_from_json, step_to_json  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402
from tiny import write_tiny_spec  # noqa: E402

GROUPED = ("moe_gate_up_silu", "moe_gate_up", "moe_down")


# These tests are the prefill wgmma's place beside the GEMV and the mma launch; decode's wgmma (on by
# default, which takes both their token ranges) has its own: test_wgmma_skinny_lowering.py.
PREFILL_ONLY = Tuning(moe=MoeTuning(decode_wgmma=False))
WGMMA_OFF = Tuning(moe=MoeTuning(decode_wgmma=False, prefill_wgmma_above=None))


def _lower(G, nid, dtype="bf16", target="sm_90", tuning=PREFILL_ONLY):
    return families.family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(arch=target, dtype=dtype, tuning=tuning))


def _grouped(dims="v2_lite"):
    return [(G, nid) for G, nid in moe_graphs(*DIMS[dims]) if G.nodes[nid]["op"] in GROUPED]


def test_arch_features_and_targets(monkeypatch):
    assert arch.features("sm_90a") == arch.features("sm_90") == {"sm_90a"} and arch.features("sm_100") == {"sm_100a"}
    assert arch.kernel_target("sm_90", ("sm_90a",)) == "sm_90a" and arch.kernel_target("sm_90") == "sm_90"
    assert arch.runs_on("sm_90a", "sm_90") and arch.runs_on("sm_90", "sm_90") and not arch.runs_on("sm_90a", "sm_100")
    # one set of defaults: the runtime's target on a device is dsgraph compile's where it runs there
    assert DEFAULTS.arch == "sm_90" and arch.target_arch("sm_90") == "sm_90"
    assert arch.target_arch("sm_90", default="sm_90a") == "sm_90a"
    assert arch.target_arch("sm_100", default="sm_90a") == "sm_100"
    import codegen.kernel as kernel
    monkeypatch.setattr(kernel, "DEFAULTS", Options(arch="sm_90a"))
    assert arch.target_arch("sm_90") == "sm_90a" and arch.target_arch("sm_89") == "sm_89"


def test_on_by_default_for_compute_capability_90_only():
    """The default lowering hands prefill's token counts to the wgmma launch on sm_90 / sm_90a
    targets, and nowhere else; off (None) it holds none."""
    assert MoeTuning().prefill_wgmma_above == 256
    for G, nid in _grouped():
        for target in ("sm_90", "sm_90a"):
            assert [la.stage for la in _lower(G, nid, target=target)] == ["gemv", "mma", "wgmma"]
        for target in ("sm_80", "sm_100"):
            assert [la.stage for la in _lower(G, nid, target=target)] == ["gemv", "mma"]


def test_off_holds_no_wgmma_launch():
    for G, nid in _grouped():
        for target in ("sm_90", "sm_90a"):
            assert [la.stage for la in _lower(G, nid, target=target, tuning=WGMMA_OFF)] == ["gemv", "mma"]


def test_only_for_compute_capability_90_16bit_and_whole_16_byte_rows():
    for G, nid in _grouped():
        for target in ("sm_80", "sm_100"):
            assert [la.stage for la in _lower(G, nid, target=target)] == ["gemv", "mma"]
        assert [la.stage for la in _lower(G, nid, target="sm_90a")] == ["gemv", "mma", "wgmma"]
        assert [la.stage for la in _lower(G, nid, "fp32")] == ["gemv"]
        assert [la.stage for la in _lower(G, nid, "fp16")] == ["gemv", "mma", "wgmma"]
    # KD % 8 != 0 ("odd": D = 40 is fine for gate/up, M = 36 is not for down)
    stages = {G.nodes[nid]["op"]: [la.stage for la in _lower(G, nid)] for G, nid in _grouped("odd")}
    assert stages == {"moe_gate_up_silu": ["gemv", "mma", "wgmma"], "moe_gate_up": ["gemv", "mma", "wgmma"],
                      "moe_down": ["gemv", "mma"]}


def _worst_row_tiles(NP: int, E: int) -> int:
    """Most row tiles NP pairs can make over E experts: as many partial tiles as possible."""
    return max(sum(-(-c // 128) for c in counts) for counts in (
        [NP // E + (i < NP % E) for i in range(E)],          # even split
        [1] * min(E - 1, NP - 1) + [NP - min(E - 1, NP - 1)],  # one big, the rest one pair each
        [129] * (NP // 129) + ([NP % 129] if NP % 129 else []) if NP // 129 < E else [NP]))


def test_more_experts_than_a_ctas_shared_memory_holds_keep_the_mma_launch():
    """The ring + epilogue staging take 225 KB; the row-tile table 4 bytes an expert more: V3's 256
    experts fit, ~500 would not, and such a spec keeps mma.sync (no kernel that cannot launch)."""
    assert _moe_wgmma.smem(_moe_wgmma.STAGES) + _moe_wgmma.static_smem(256) <= smem_limit("sm_90a")
    assert [la.stage for G, nid in _grouped("v3") for la in _lower(G, nid)][-1] == "wgmma"
    many = (600, *DIMS["v2_lite"][1:])
    for G, nid in moe_graphs(*many):
        if G.nodes[nid]["op"] in GROUPED:
            assert [la.stage for la in _lower(G, nid)] == ["gemv", "mma"], G.nodes[nid]["op"]


def test_one_launch_runs_at_each_T_and_the_wgmma_grid_covers_every_tile():
    thr = PREFILL_ONLY.moe.prefill_wgmma_above
    for G, nid in _grouped():
        gemv, mma, wg = _lower(G, nid)
        p = wg.params
        assert wg.requires == ("sm_90a",) and mma.requires == gemv.requires == ()
        assert wg.block == (p["threads"], 1, 1) == (384, 1, 1) and wg.smem == p["smem"] == 4 * 48 * 1024 + 2 * 16 * 1024 + 1024   # ring, epilogue staging, alignment
        assert p["cols"] == (256 if G.nodes[nid]["op"] == "moe_down" else 128)
        ncols = -(-p["N"] // p["cols"])
        for T in (1, 8, 9, 100, thr, thr + 1, 2048, 16384):
            env = {"T": T, "NP": 6 * T, "SMS": 132}
            runs = [sizes.evaluate(gemv.grid[0], env) > 0, sizes.evaluate(mma.grid[1], env) > 0,
                    sizes.evaluate(wg.grid[0], env) > 0]
            assert runs == [T <= 8, 8 < T <= thr, T > thr], (T, runs)
            if T > thr:
                # persistent: one CTA per SM at most, and the walk (stride gridDim) covers the tiles
                x = sizes.evaluate(wg.grid[0], env)
                assert x == min(132, ncols * (6 * T // 128 + min(64, 6 * T)))
                assert ncols * (6 * T // 128 + min(64, 6 * T)) >= ncols * _worst_row_tiles(6 * T, 64)


def test_weights_are_tensor_maps_and_the_manifest_reads_them_back():
    for G, nid in _grouped():
        gemv, mma, wg = _lower(G, nid)
        weights = [a for a in mma.args if isinstance(a.ref, WeightRef)]
        maps = [a for a in wg.args if isinstance(a.ref, TensorMapRef)]
        assert [a.name for a in maps] == [a.name for a in weights] and weights
        for w, m in zip(weights, maps):
            assert m.ctype == TENSOR_MAP_CTYPE and m.kind == "tmap"
            assert m.ref == TensorMapRef(w.ref.name, (128, 64), 128)
            assert m.declaration() == f"const __grid_constant__ dsg::TensorMap {m.name}"
        back = step_from_json(json.loads(json.dumps(step_to_json(wg))))
        assert back == dataclasses.replace(wg, origins=()) and back.requires == ("sm_90a",)
        assert "requires" not in step_to_json(mma)       # other kernels' manifest entries are unchanged
    ref = TensorMapRef("e.*.gate", (128, 64), 128)
    assert ref_from_json(json.loads(json.dumps(ref_to_json(ref)))) == ref
    a = Arg("w", TENSOR_MAP_CTYPE, ref)
    assert Arg.from_json(a.to_json()) == a


def test_lowering_refuses_a_kernel_whose_target_lacks_its_features(monkeypatch):
    from codegen.lower import _check_launch
    launch = KernelLaunch(family="f", template="t", name="k", params={}, nodes=("n",), grid=(1, 1, 1),
                          block=(32, 1, 1), args=(), requires=("sm_90a",))
    _check_launch(launch, "n", "f", Options(arch="sm_90"))
    with pytest.raises(TypeError, match="requires sm_90a, which the target sm_100 does not offer"):
        _check_launch(launch, "n", "f", Options(arch="sm_100"))
    bad = dataclasses.replace(launch, requires=(), args=(Arg("w", "int", TensorMapRef("w", (1,))),))
    with pytest.raises(TypeError, match="tensor maps, and only they"):
        _check_launch(bad, "n", "f", Options())


def test_a_bundle_records_what_its_kernels_need_and_is_refused_where_they_cannot_run(tmp_path, monkeypatch):
    """dsgraph compile's default target (sm_90) with the variant on: the wgmma kernels alone are
    built for sm_90a and say so; a device of another compute capability refuses the bundle."""
    built: dict = {}

    def fake(src, name, **kw):
        built[name] = kw["arch"]
        return nvrtc.CompileResult(cubin=b"CUBIN", log="")
    monkeypatch.setattr(nvrtc, "compile_cubin", fake)
    spec = write_tiny_spec(tmp_path / "tiny.yaml")
    res = compile_bundle(spec, tmp_path / "b", cache_dir=tmp_path / "c", strict=False, progress=False,
                         tuning=PREFILL_ONLY)
    m = load_manifest(res.path)
    assert m["arch"] == "sm_90" and m["features"] == ["sm_90a"]
    needs = sorted(n for n, k in m["kernels"].items() if k.get("requires") == ["sm_90a"])
    assert needs and all(n.endswith("__wgmma") for n in needs)
    assert all("requires" not in k for n, k in m["kernels"].items() if n not in needs)
    assert {n: a for n, a in built.items() if a != "sm_90"} == dict.fromkeys(needs, "sm_90a")
    check_compatible(m, res.path, arch="sm_90")          # a 9.0 device runs sm_90a kernels
    with pytest.raises(BundleError) as info:
        check_compatible(m, res.path, arch="sm_100")
    msg = str(info.value)
    assert "\n" not in msg and "needs sm_90a" in msg and needs[0] in msg and "this device (sm_100)" in msg
    assert "--arch sm_100" in msg
    # a bundle without the wgmma kernels names no features
    plain = compile_bundle(spec, tmp_path / "p", cache_dir=tmp_path / "c", strict=False, progress=False,
                           tuning=WGMMA_OFF)
    mp = load_manifest(plain.path)
    assert mp["arch"] == "sm_90" and "features" not in mp and not any("requires" in k for k in mp["kernels"].values())
