"""The grouped expert GEMM compiles to the instructions it was written for (sm_90, NVRTC on the
CPU): tensor-core HMMA fed by 16-byte cp.async (LDGSTS, L2 128-byte hint) and ldmatrix (LDSM), no register spills,
and the swapped few-pairs tiles (moe_grouped.cuh 4c) add tensor-core code of their own.  The wgmma variant
(sm_90a, moe_wgmma.cuh) is HGMMA fed by TMA boxes and gathering cp.async copies on
mbarriers, with its registers moved between warpgroups, without spills.  Decode's fused expert FFN
(moe_expert_ffn.cuh) reads its weight boxes under an L2 evict_first policy and stores the outputs
of its tiles of 32+ pairs in 16-byte chunks, with a publisher warp beside its two warpgroups."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions, opcodes  # noqa: E402
from test_families_moe import DIMS, lower, moe_graphs  # noqa: E402

from codegen import families  # noqa: E402
from codegen.families._moe import gemm_launch_smem  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.nvrtc import KernelCompileError, compile_cubin  # noqa: E402
from codegen.render import render_launch  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")


def _mma_launch(op: str):
    """The mma launch, as a target without decode's wgmma (fp32 aside: odd KD, non-9.0 targets) has it."""
    for G, nid in moe_graphs(*DIMS["v2_lite"]):
        if G.nodes[nid]["op"] == op:
            (launch,) = [la for la in lower(G, nid, "bf16", Tuning(moe=MoeTuning(decode_wgmma=False)))
                         if la.stage == "mma"]
            return launch
    raise AssertionError(op)


def _compile(launch):
    res = compile_cubin(render_launch(launch), launch.name, options=("--ptxas-options=-v",))
    return res, opcodes(res.cubin)


@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_down"])
def test_grouped_gemm_runs_on_tensor_cores_without_spills(op):
    launch = _mma_launch(op)
    assert launch.params["skinny"] > 0
    res, ops = _compile(launch)
    assert ops["HMMA.16816.F32.BF16"] > 0, sorted(ops)
    assert ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0, \
        "weights and rows are copied with 16-byte cp.async, hinted to fetch 128-byte L2 lines (mma.cuh)"
    assert ops["LDSM.16.M88.4"] > 0, "fragments are loaded with ldmatrix x4"
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
    # the swapped tiles are their own tensor-core code, not a fall-back to the row tile or the GEMV
    p = launch.params
    smem = gemm_launch_smem(p["bk"], p["stages"], 0, p["sbk"], p["sst"])
    _, without = _compile(dataclasses.replace(launch, params={**p, "skinny": 0, "smem": smem}, smem=smem))
    assert ops["HMMA.16816.F32.BF16"] > without["HMMA.16816.F32.BF16"]


def _wgmma_launch(op: str, dtype: str):
    for G, nid in moe_graphs(*DIMS["v2_lite"]):
        if G.nodes[nid]["op"] == op:
            launches = families.family_for_op(op).lower(nid, G, Options(dtype=dtype))
            (launch,) = [la for la in launches if la.stage == "wgmma"]
            return launch
    raise AssertionError(op)


@pytest.mark.parametrize("op,dtype", [("moe_gate_up_silu", "bf16"), ("moe_down", "bf16"), ("moe_gate_up_silu", "fp16"),
                                      ("moe_gate_up", "bf16")])
def test_wgmma_variant_is_hgmma_fed_by_tma_and_gathering_copies(op, dtype):
    """The prefill wgmma (above moe.prefill_wgmma_above tokens): 4 HGMMA 64x256x16 per K slice,
    the weights as 3-D TMA boxes, the pair rows as 16-byte cp.async reported to the stage's
    mbarrier, warpgroup register reallocation; no mma.sync fall-back, no spills, registers within
    the 168 a 384-thread CTA has at launch."""
    launch = _wgmma_launch(op, dtype)
    res = compile_cubin(render_launch(launch), launch.name, arch="sm_90a", options=("--ptxas-options=-v",))
    ops = opcodes(res.cubin)
    assert ops["HGMMA.64x256x16.F32" + (".BF16" if dtype == "bf16" else "")] == 4, sorted(ops)   # fp16 has no suffix
    assert not any(k.startswith("HMMA") for k in ops), "no mma.sync path inside"
    assert ops["UTMALDG.3D"] > 0 and ops["UTMACCTL.PF"] > 0, "weights: TMA boxes of the tensor maps (prefetched)"
    assert ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0 and ops["ARRIVES.LDGSTSBAR.64.ARVCNT"] > 0, \
        "pair rows: gathering 16-byte cp.async whose landing arrives on the stage's mbarrier"
    assert ops["SYNCS.PHASECHK.TRANS64.TRYWAIT"] > 0 and ops["SYNCS.ARRIVE.TRANS64"] > 0, "stages on mbarriers"
    assert ops["WARPGROUP.ARRIVE"] > 0 and ops["WARPGROUP.DEPBAR.LE"] > 0
    assert ops["USETMAXREG.DEALLOC.CTAPOOL"] > 0 and ops["USETMAXREG.TRY_ALLOC.CTAPOOL"] > 0
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
    used = int(res.log.split("Used ")[1].split(" registers")[0])
    assert used <= 168, res.log


def test_wgmma_variant_needs_the_sm90a_target():
    """wgmma.cuh refuses a plain sm_90 build with one clear error (the lowering never asks for one)."""
    launch = _wgmma_launch("moe_down", "bf16")
    with pytest.raises(KernelCompileError, match="sm_90a"):
        compile_cubin(render_launch(launch), launch.name, arch="sm_90")


FUSED_GOLDEN = "tests/codegen/golden/deepseek_v2_lite/moe_expert_ffn__bf16__e66_k8__m1408_d2048__st32__fused.cu"


def test_fused_expert_ffn_has_its_publisher_warp_evict_first_weights_and_chunk_stores():
    """V2-Lite's fused expert FFN as the lowering emits it (its golden): 288 threads (two
    warpgroups and the publisher warp, which alone waits on the release of `a`), tiles of 32+ pairs
    staged through shared memory (STG.E.128), every TMA weight box with an L2 cache policy
    (UTMALDG ... desc[...]), no spills, registers for two CTAs of 288 threads an SM."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = open(os.path.join(root, FUSED_GOLDEN)).read()
    name = os.path.basename(FUSED_GOLDEN)[:-3]
    assert "__launch_bounds__(288, 2)" in src and "#define DSG_WS_STAGED_FROM_BP 32" in src
    res = compile_cubin(src, name, arch="sm_90a", options=("--ptxas-options=-v",))
    (body,) = instructions(res.cubin).values()
    tma = [i for i in body if i.opcode.startswith("UTMALDG")]
    assert tma and all("desc[" in i.operands for i in tma), [i.operands for i in tma]
    ops = opcodes(res.cubin)
    assert ops["STG.E.128"] > 0 and ops["HGMMA.64x64x16.F32.BF16"] > 0 and ops["REDG.E.ADD.STRONG.GPU"] > 0, sorted(ops)
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
    assert int(res.log.split("Used ")[1].split(" registers")[0]) <= 65536 // (2 * 288), res.log
