"""The FP8 expert GEMM (templates/include/moe_fp8.cuh, sm_90a, NVRTC on the CPU) compiles to what it was
written for: HGMMA with A from registers (the widened FP8 weights), B from a shared-memory descriptor
(the gathered pair rows), N = 16 and 32; the widening on the conversion units (F2FP.F16.E4M3.UNPACK_B);
the weights' fragments read with 16-byte shared loads; TMA boxes on mbarriers; no local memory."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402
from test_moe_fp8_lowering import _node  # noqa: E402

from codegen import families  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.nvrtc import compile_cubin  # noqa: E402
from codegen.render import render_launch  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")


@pytest.mark.parametrize("op,KD,N", [("moe_gate_up_silu", 2048, 1408), ("moe_down", 1408, 2048)])
def test_fp8_expert_gemm_widens_into_wgmmas_a_registers(op, KD, N):
    G, nid = _node(op, KD, N, E=64, K=6)
    (la,) = [s for s in families.family_for_op(op).lower(nid, G, Options(dtype="bf16")) if s.stage == "wgmma_skinny_fp8"]
    res = compile_cubin(render_launch(la), la.name, arch="sm_90a", options=("--ptxas-options=-v",))
    (body,) = instructions(res.cubin).values()
    # (the opcode pattern stops at the shape's lower-case x: whole text, then split)
    hgmma = [(i.opcode + i.operands).split(" ", 1) for i in body if i.opcode.startswith("HGMMA.")]
    assert {h for h, _ in hgmma} == {"HGMMA.64x16x16.F32.BF16", "HGMMA.64x32x16.F32.BF16"}, hgmma
    # operands: d, a, b: A a register, B a descriptor
    assert all(ops.split(",")[1].strip().startswith("R") and "gdesc" in ops.split(",")[2] for _, ops in hgmma), hgmma
    ops = {i.opcode for i in body}
    assert "F2FP.F16.E4M3.UNPACK_B" in ops and "LDS.128" in ops, sorted(ops)
    assert any(o.startswith("UTMALDG.3D") for o in ops), sorted(ops)
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "no local memory"
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
