"""The FP8 expert GEMM (templates/include/moe_fp8.cuh, sm_90a, NVRTC on the CPU) compiles to what it was
written for: HGMMA with A from registers (the widened FP8 weights), B from a shared-memory descriptor
(the gathered pair rows), N = 16 and 32; the widening on the conversion units (F2FP.F16.E4M3.UNPACK_B);
the weights' fragments read with 16-byte shared loads; TMA boxes on mbarriers; no local memory.  With
moe.fp8_shared_before_wait, what runs before the PDL wait; with moe.fp8_widen_ahead, the one-group wait."""
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


def _before_wait(instrs) -> list:
    """The instructions on a path from the entry that has not passed a griddepcontrol.wait (ACQBULK),
    following branches both ways (test_sass_pdl.wait_problem's walk, which checks the same kernels first)."""
    from test_sass_pdl import _TARGET
    index = {ins.addr: n for n, ins in enumerate(instrs)}
    seen: set = set()
    todo = [0]
    while todo:
        n = todo.pop()
        while n < len(instrs) and n not in seen and instrs[n].opcode != "ACQBULK":
            seen.add(n)
            if instrs[n].opcode.startswith("BRA"):
                todo.append(index[int(_TARGET.search(instrs[n].operands).group(1), 16)])
                if not instrs[n].guarded:
                    break
            n += 1
    return [instrs[n] for n in sorted(seen)]


@pytest.mark.parametrize("op", ["moe_gate_up_silu", "moe_gate_up"])
def test_fp8_shared_tile_runs_before_the_wait_and_stores_after_it(op, monkeypatch):
    """moe.fp8_shared_before_wait: on a path before the PDL wait the shared tile's weight boxes (TMA), its
    pair rows' gathers (L2-only cp.async or loads: x, two launches back), its block scales (read-only loads:
    weights)
    and its wgmma; no store, no other load (the route's `order` and `offsets` come after the wait);
    pdl.cuh's contract otherwise (test_sass_pdl.wait_problem, weights allowed); 0 spills."""
    from test_moe_fp8_lowering import _shared_launch
    from test_sass_pdl import _two_back_load, wait_problem
    la = _shared_launch(op, monkeypatch, True)
    res = compile_cubin(render_launch(la), la.name, arch="sm_90a", options=("--ptxas-options=-v",))
    (body,) = instructions(res.cubin).values()
    assert wait_problem(body, weight_loads=True) is None, wait_problem(body, weight_loads=True)
    early = [i.opcode for i in _before_wait(body)]
    assert any(o.startswith("UTMALDG") for o in early) and any(o.startswith("HGMMA") for o in early), early
    assert any(o.startswith("LDGSTS") and ".BYPASS" in o for o in early), early
    loads = {o for o in early if o.split(".")[0] in ("LDG", "LD", "LDGSTS", "UBLKCP", "SULD")}
    assert all(o.startswith("LDG.E.CONSTANT") or _two_back_load(o, gathers=True) for o in loads), loads
    assert not any(o.split(".")[0] in ("STG", "ST", "ATOM", "ATOMG", "RED") for o in early), early
    assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log


def test_fp8_widen_ahead_waits_for_one_wgmma_group_of_two():
    """moe.fp8_widen_ahead: a slice's two boxes go as two wgmma groups, and the consumer waits for the
    first one alone (WARPGROUP.DEPBAR.LE gsb0, 0x1) before it widens the next slice's first box; main's
    tile waits for all (0x0) only."""
    from test_moe_fp8_lowering import _fp8_tuning
    G, nid = _node("moe_gate_up_silu", 2048, 1408, E=64, K=6)
    depbars = {}
    for on in (False, True):
        (la,) = [s for s in families.family_for_op("moe_gate_up_silu").lower(
            nid, G, Options(dtype="bf16", tuning=_fp8_tuning(fp8_widen_ahead=on))) if s.stage == "wgmma_skinny_fp8"]
        (body,) = instructions(compile_cubin(render_launch(la), la.name, arch="sm_90a").cubin).values()
        depbars[on] = {i.operands.split(",")[-1].strip() for i in body if i.opcode.startswith("WARPGROUP.DEPBAR")}
    assert "0x1" in depbars[True] and "0x1" not in depbars[False], depbars
