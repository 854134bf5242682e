"""The skinny linear kernels (linear_skinny) of every shipped spec compile with NVRTC on the CPU
(sm_90) to the instructions they were written for: tensor-core HMMA fed by 16-byte weight loads
straight from global memory into registers (LDG...128 with the L1 no-allocate / L2 128-byte hints:
no cp.async, no shared-memory copy of the weights), 16-byte x loads, no register spills; fp32 on
CUDA cores (FFMA, no HMMA)."""
from __future__ import annotations

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, opcodes  # noqa: E402

from codegen.bundle import plan_spec  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.nvrtc import compile_cubin  # noqa: E402
from codegen.render import render_launch  # noqa: E402
from tiny import ROOT  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")
SPECS = ("deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
WEIGHT_LOAD = "LDG.E.NA.LTC128B.128.CONSTANT"   # ld.global.nc.L1::no_allocate.L2::128B.v4 (skinny.cuh)
HMMA = {"bf16": "HMMA.16816.F32.BF16", "fp16": "HMMA.16816.F32"}


@functools.lru_cache(maxsize=None)
def skinny_launches(spec: str, dtype: str) -> tuple:
    """Every distinct linear_skinny kernel of a spec's two phases."""
    sp = plan_spec(str(ROOT / "model_specs" / f"{spec}.yaml"), Options(dtype=dtype), strict=False)
    seen = {}
    for plan in sp.plans.values():
        for la in plan.launches:
            if la.family == "linear_skinny":
                seen.setdefault(la.name, la)
    return tuple(seen.values())


def _compile(launch):
    res = compile_cubin(render_launch(launch), launch.name, options=("--ptxas-options=-v",))
    return res, opcodes(res.cubin)


def _no_spills(res):
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log


@pytest.mark.parametrize("spec", SPECS)
def test_every_skinny_kernel_of_the_shipped_specs_runs_on_tensor_cores_from_registers(spec):
    launches = skinny_launches(spec, "bf16")
    # the fused siblings are there: q (or q_a) + kv_a, and gate + up with SwiGLU in the epilogue
    assert any(len(la.params["rows"]) == 2 and not la.params["silu"] for la in launches)
    assert any(la.params["silu"] for la in launches)
    for la in launches:
        res, ops = _compile(la)
        _no_spills(res)
        assert ops[HMMA["bf16"]] > 0, (la.name, sorted(ops))
        assert ops[WEIGHT_LOAD] > 0, (la.name, sorted(ops))
        assert ops["LDG.E.128"] > 0, f"{la.name}: x rows are read with 16-byte loads"
        assert not any(op.startswith(("LDGSTS", "LDSM", "UBLKCP")) for op in ops), \
            f"{la.name}: weights go from global memory to registers, not through shared memory"


def test_fp16_runs_on_tensor_cores_and_fp32_on_cuda_cores():
    (fp16,) = [la for la in skinny_launches("deepseek_v2_lite", "fp16") if la.params["rows"] == [3072, 576]]
    res, ops = _compile(fp16)
    _no_spills(res)
    assert ops[HMMA["fp16"]] > 0 and ops[WEIGHT_LOAD] > 0, sorted(ops)
    (fp32,) = [la for la in skinny_launches("deepseek_v2_lite", "fp32") if la.params["rows"] == [3072, 576]]
    res, ops = _compile(fp32)
    _no_spills(res)
    assert not any(op.startswith("HMMA") for op in ops) and ops["FFMA"] > 0, sorted(ops)
    assert ops["LDG.E.128.CONSTANT"] + ops["LDG.E.128"] > 0, "fp32 rows are read with 16-byte loads too"


def test_every_variant_compiles_without_spills_and_clusters_reduce_through_distributed_shared_memory():
    """The variants bench/perf_linear.py times (tests/gpu/test_kernels_linear.py draws them) at
    V2-Lite's o_proj: no spills; the cluster ones (K split over 2 or 4 CTAs) carry the cluster
    barriers and read the other CTAs' sums from distributed shared memory (generic LD)."""
    from bench.perf_linear import VARIANTS, launch_for
    from bench.perf_decode import lite
    m = lite()
    for v in VARIANTS.split(","):
        launch, _ = launch_for(m, 2048, [2048], v)
        res, ops = _compile(launch)
        _no_spills(res)
        assert ops[HMMA["bf16"]] > 0 and ops[WEIGHT_LOAD] > 0, (v, sorted(ops))
        clustered = launch.params["ks"] > 1
        assert (ops["UCGABAR_ARV"] > 0 and ops["UCGABAR_WAIT"] > 0 and ops["LD.E"] > 0) == clustered, (v, sorted(ops))
