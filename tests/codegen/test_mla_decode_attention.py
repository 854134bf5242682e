"""The one-launch decode attention's lowering (codegen/families/mla_decode_attention.py), on the CPU:
the split policy (clusters of S CTAs, G of them an item), the launches of which exactly one runs at
any size, the level-2 workspace, shared memory, the
pre-Hopper fallback, and the machine code NVRTC makes of every shipped spec's attention kernels:
tensor cores fed by 16-byte cp.async and ldmatrix, the cluster barrier in the splits launch, the
PDL wait, no register spills."""
from __future__ import annotations

import functools
import os
import sys

import pytest

import ir
from codegen import sizes as size_exprs
from codegen.families import mla_decode_attention as fam
from codegen.kernel import Options
from codegen.nvrtc import compile_cubin
from codegen.render import render_launch
from ir.ops import TType

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
from harness import single_op_graph, tiny_model  # noqa: E402
from sass import cuobjdump, opcodes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = ("deepseek_v2_lite", "deepseek_v2", "deepseek_v3")


@functools.lru_cache(maxsize=None)
def spec_model(name: str):
    if name in SPECS:
        return ir.load_spec(os.path.join(ROOT, "model_specs", f"{name}.yaml"), check=False).model
    if name == "odd":
        return tiny_model(hidden=40, heads=3, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=10,
                          v_head_dim=12, intermediate=30, moe_intermediate=30)
    raise KeyError(name)


def lowered(name: str, dtype: str = "bf16", arch: str = "sm_90", variant=None, block_size: int = 64):
    m = spec_model(name)
    d = m.dims
    H, C, R = d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    G, nid = single_op_graph(m, "mla_decode_attention", {},
                             {"ql": TType(("T", H, C), "act"), "qr": TType(("T", H, R), "act"),
                              "st": TType(("cache",), "state")}, {}, phase="decode")
    return H, fam.lower(nid, G, Options(arch=arch, dtype=dtype, block_size=block_size), variant=variant)


def evaluate(expr, sizes) -> int:
    return size_exprs.evaluate(expr, sizes)


def live(launches, sizes):
    """The launches whose grid is not empty at these sizes."""
    return [la for la in launches if 0 not in tuple(evaluate(g, sizes) for g in la.grid)]


def policy(T, NG, SMS, MAXCTX, *, per_sm: int = 1, cs: int = 8) -> int:
    """The CUDA-core split policy written out: targets, clamps, then the power of two at or below
    (one cluster an item)."""
    x = min(cs, -(-MAXCTX // 64), max(1, -(-2 * SMS // (T * NG))))
    return 1 << (x.bit_length() - 1)


def mma_policy(T, NG, SMS, MAXCTX, *, per_sm: int = 1, cs: int = 8) -> tuple[int, int]:
    """The tensor-core split policy written out: (S, G), clusters of S CTAs, G of them an item."""
    items = T * NG
    X = min(-(-MAXCTX // 64), max(1, per_sm * SMS // items))

    def fit(c):
        cap = per_sm * SMS // c if c <= 2 else per_sm * SMS // (2 * c)
        return min(fam.GMAX, cap // items, X // c, max(1, fam.TICKETS // (items * c)))

    if cs == 1:
        return 1, max(1, fit(1))
    if cs > 2 and fit(cs) >= 1 and cs * fit(cs) >= 2 * fit(2):
        return cs, fit(cs)
    if X >= 2:
        return 2, fit(2)
    return 1, 1


SIZES = [(T, SMS, L) for T in (1, 2, 3, 7, 8, 16, 17, 32, 33, 64, 66, 67, 128, 133, 600, 1000)
         for SMS in (1, 7, 40, 132, 4096) for L in (1, 63, 64, 65, 256, 512, 4096, 17000)]


@pytest.mark.parametrize("name,dtype", [("deepseek_v2_lite", "bf16"), ("deepseek_v3", "bf16"),
                                        ("deepseek_v2_lite", "fp32"), ("odd", "bf16")])
def test_split_count_and_the_launch_that_runs(name, dtype):
    """Tensor cores: one launch per cluster size S in 8, 2, 1; CUDA cores: 8, 4, 2, 1. At any step
    sizes exactly one has a non-empty grid, T * NG * S * G CTAs, (S, G) the policy's: never more
    than one split per 64 rows of the longest context, at most GMAX clusters an item, no more
    clusters than the GPU holds at once (clusters of 8 on half the SMs, of 2 on all), tickets for
    every (item, rank) when G > 1; a level-2 workspace row per CTA then, none at G == 1."""
    H, launches = lowered(name, dtype)
    mma = launches[0].params["mma"]
    assert mma == (dtype == "bf16" and name != "odd")
    stages = ["splits8", "splits2", "single"] if mma else ["splits8", "splits4", "splits2", "single"]
    assert [la.stage for la in launches] == stages
    assert [la.params["cs"] for la in launches] == [int(st[6:]) if st != "single" else 1 for st in stages]
    assert len({la.name for la in launches}) == len(stages)
    NG = -(-H // 16)
    seen = set()
    for T, SMS, L in SIZES:
        sizes = {"T": T, "B": T, "NP": T, "MAXQ": 1, "MAXCTX": L, "W": -(-L // 64), "SMS": SMS}
        (la,) = live(launches, sizes)
        S = la.params["cs"]
        items = T * NG
        if mma:
            S_want, G = mma_policy(T, NG, SMS, L)
            assert S == S_want, (T, SMS, L, S, S_want)
            seen.add((S, G > 1))
            assert 1 <= G <= fam.GMAX
            if S * G >= 2:
                assert S * G <= -(-L // 64), "at most one split per 64-row tile"
                assert items * S * G <= (SMS if S <= 2 else SMS // 2), "one wave of clusters"
        else:
            S, G = policy(T, NG, SMS, L), 1
            assert la.params["cs"] == S, (T, SMS, L)
        assert tuple(evaluate(g, sizes) for g in la.grid) == (items * S * G, 1, 1)
        (ws,) = la.workspace
        rows = evaluate(ws.shape[0], sizes)
        assert rows == (items * S * G if G > 1 else 0), (T, SMS, L, S, G, rows)
        assert ws.shape[1] == fam.rec_floats(512 if name != "odd" else 20, 16 if mma else min(H, 16), S)
        if G > 1:
            assert items * S <= fam.TICKETS
    if mma:   # every form ran somewhere: each cluster size with one cluster an item and with more
        assert seen >= {(8, False), (8, True), (2, False), (2, True), (1, False)}, seen


def test_level2_splits_where_the_step_is_small():
    """The cases the policy was measured for (H200, 132 SMs, V2-Lite's 16 heads): one token at ctx
    4096 takes 8 clusters of 8 (64 one-tile splits), 8 tokens clusters of 2, 8 an item (128 CTAs),
    32 tokens clusters of 2, 2 an item (32 clusters of 4 were two waves), 128 tokens one CTA each."""
    _, launches = lowered("deepseek_v2_lite")
    for T, L, want in ((1, 512, (8, 1)), (1, 4096, (8, 8)), (8, 512, (8, 1)), (8, 4096, (2, 8)),
                       (32, 512, (2, 2)), (32, 4096, (2, 2)), (64, 4096, (2, 1)), (128, 512, (1, 1))):
        sizes = {"T": T, "B": T, "NP": T, "MAXQ": 1, "MAXCTX": L, "W": -(-L // 64), "SMS": 132}
        (la,) = live(launches, sizes)
        S = la.params["cs"]
        assert (S, evaluate(la.grid[0], sizes) // (T * S)) == want, (T, L)


def test_shared_memory_mirrors_the_kernel_and_fits():
    """mma_smem_bytes mirrors MlaDecodeMma::SMEM (the kernels static_assert it: compiled below):
    three 72 KB rings of 64 swizzled 576-wide rows, the maxima and the P tile; the 4-warp variant
    fits two CTAs per SM."""
    _, launches = lowered("deepseek_v2_lite")
    assert {la.smem for la in launches} == {3 * 64 * 1152 + 8 * 16 * 4 + 16 * 72 * 2}   # the ring dominates
    assert all(la.smem <= fam.smem_limit("sm_90") for la in launches)
    assert fam.mma_smem_bytes(512, 64, 8, fam.Variant(8, 2, 8)) == 2 * 64 * 1152 + 8 * 16 * 4 + 16 * 72 * 2
    small = fam.mma_smem_bytes(512, 64, 8, fam.Variant(4, 3, 8))
    assert small == 3 * 32 * 1152 + 4 * 16 * 4 + 16 * 40 * 2 and fam.mma_ctas_per_sm(small, fam.Variant(4, 3, 8)) == 2
    # an odd chunk pitch where a row is not a multiple of 8 chunks (160 wide: 20 chunks -> 21)
    assert fam.mma_smem_bytes(128, 32, 8) == 3 * 64 * 21 * 16 + 8 * 16 * 4 + 16 * 72 * 2
    # the CUDA-core carve-up, or the partial where that is larger
    assert fam.smem_bytes(512, 64, 16, 4, 8) == 113216
    assert fam.smem_bytes(20, 8, 3, 2, 8) == max(fam.merge_bytes(20, 3, 8), 3040)


def test_pre_hopper_arch_has_one_plain_launch():
    """Clusters need sm_90: for sm_80 the family lowers the single launch alone (S = 1; G CTAs an
    item merged through the level-2 workspace), with a ring of two tiles (163 KB of shared memory
    per CTA there)."""
    _, launches = lowered("deepseek_v2_lite", arch="sm_80")
    (la,) = launches
    assert la.stage == "single" and la.params["cs"] == 1
    for T, L, G in ((1, 4096, 8), (1, 512, 8), (1, 64, 1), (200, 4096, 1)):
        sizes = {"T": T, "MAXCTX": L, "SMS": 108}
        assert evaluate(la.grid[0], sizes) == T * G, (T, L)
    assert la.params["nstage"] == 2 and la.smem <= fam.smem_limit("sm_80")
    src = render_launch(la)
    assert "__cluster_dims__" not in src
    compile_cubin(src, la.name, arch="sm_80")


def test_variant_names_and_validation():
    _, default = lowered("deepseek_v2_lite")
    _, other = lowered("deepseek_v2_lite", variant=fam.Variant(8, 2, 8))
    base = "mla_decode_attention__bf16__c512_r64__h16__page64"
    assert [la.name for la in default] == [base + "__s8", base + "__s2", base]
    assert [la.name for la in other] == [base + "__w8s2c8__s8", base + "__w8s2c8__s2", base + "__w8s2c8"]
    _, two = lowered("deepseek_v2_lite", variant=fam.Variant(8, 3, 2))
    assert [la.stage for la in two] == ["splits2", "single"]
    _, four = lowered("deepseek_v2_lite", variant=fam.Variant(8, 3, 4))
    assert [la.stage for la in four] == ["splits4", "splits2", "single"]
    with pytest.raises(ValueError):
        fam.Variant(warps=6)
    with pytest.raises(ValueError):
        fam.Variant(cluster=16)


def _compile(la):
    res = compile_cubin(render_launch(la), la.name, options=("--ptxas-options=-v",))
    return res, opcodes(res.cubin)


def _elf(cubin: bytes) -> str:
    """cuobjdump -elf of a cubin (its .nv.info attributes: cluster dimensions among them)."""
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([cuobjdump(), "-elf", fh.name], capture_output=True, text=True, check=True).stdout


sass = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")


@pytest.mark.slow
@sass
@pytest.mark.parametrize("name,dtype", [("deepseek_v2_lite", "bf16"), ("deepseek_v2", "bf16"),
                                        ("deepseek_v3", "bf16"), ("deepseek_v3", "fp16")])
def test_shipped_specs_run_on_tensor_cores_without_spills(name, dtype):
    """Every launch of every shipped spec: HMMA fed by 16-byte cp.async (L2 128-byte hint) and
    ldmatrix (plain for scores / queries / P, transposed for values), the PDL wait and trigger, no
    spills; the split launches meet their cluster at a barrier (cluster dims in the cubin), the
    single one has none."""
    _, launches = lowered(name, dtype)
    hmma = "HMMA.16816.F32.BF16" if dtype == "bf16" else "HMMA.16816.F32"
    for la in launches:
        res, ops = _compile(la)
        assert ops[hmma] > 0, sorted(ops)
        assert ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0, "cache rows come in as 16-byte cp.async"
        assert ops["LDSM.16.M88.4"] > 0 and ops["LDSM.16.MT88.4"] > 0, "fragments by ldmatrix x4"
        assert ops["ACQBULK"] > 0 and ops["PREEXIT"] > 0, "griddepcontrol.wait / launch_dependents (pdl.cuh)"
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        clustered = la.params["cs"] > 1
        assert (ops["UCGABAR_ARV"] > 0 and ops["UCGABAR_WAIT"] > 0) == clustered, la.stage
        assert (f"__cluster_dims__({la.params['cs']}, 1, 1)" in render_launch(la)) == clustered
        assert ("EIATTR_CTA_PER_CLUSTER" in _elf(res.cubin)) == clustered, "cluster dims in the cubin"


@pytest.mark.slow
@sass
def test_cuda_core_path_waits_and_does_not_spill():
    for name, dtype in (("deepseek_v2_lite", "fp32"), ("odd", "bf16")):
        _, launches = lowered(name, dtype)
        for la in launches:
            assert not la.params["mma"]
            res, ops = _compile(la)
            assert ops["ACQBULK"] > 0, "griddepcontrol.wait (pdl.cuh)"
            assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log


@pytest.mark.slow
@sass
@pytest.mark.parametrize("tag", ["w8s2c8", "w4s3c8", "w8s3c4"])
def test_timed_variants_compile(tag):
    """bench/perf_decode.py's variants compile, their largest split count and no split (the
    4-warp one sits at 255 registers: a few bytes of spill are allowed there, none at 8 warps)."""
    w, s, c = (int(x) for x in tag[1:].replace("s", " ").replace("c", " ").split())
    _, launches = lowered("deepseek_v2_lite", variant=fam.Variant(w, s, c))
    for la in (launches[0], launches[-1]):
        res, ops = _compile(la)
        assert ops["HMMA.16816.F32.BF16"] > 0
        if w == 8:
            assert "0 bytes spill stores" in res.log, res.log
