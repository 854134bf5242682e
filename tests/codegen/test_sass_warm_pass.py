"""The warm passes (off by default; PERF_NOTES v33): the MoE combine's (moe_combine_residual_rms_norm.cu.j2
DSG_COMBINE_WARM_PASS: the row's sum and norm) and mla_v_up's (mla_absorb.cuh DSG_VUP_WARM_PASS:
its first token tile) run once before the PDL wait, storing nothing, so their code is fetched while
the kernel before still runs, and then again after it.  What makes that
safe is in the SASS: one copy of the code, run by a loop whose body holds the wait, and every read
of another kernel's output inside that loop (made again after the wait: vec.cuh ld_cg_fresh, which
the compiler may not hoist out of it), no store before the wait.  Compiled with NVRTC on the CPU from
the committed goldens."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402

from codegen.nvrtc import compile_cubin  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
# (kernel, its switch, the switch's value when on)
KERNELS = [("deepseek_v2_lite/moe_combine_residual_rms_norm__bf16__k8_d2048__shared2", "DSG_COMBINE_WARM_PASS", 8),
           ("deepseek_v3/moe_combine_residual_rms_norm__bf16__k9_d7168__shared1", "DSG_COMBINE_WARM_PASS", 8),
           ("deepseek_v2_lite/mla_v_up__bf16__h16_n128_v128_c512__mma_t32_m2", "DSG_VUP_WARM_PASS", 8),
           ("deepseek_v3/mla_v_up__bf16__h128_n128_v128_c512__mma_t32_m2", "DSG_VUP_WARM_PASS", 8)]


def _sass(path: str, switch: str, value: int):
    name = os.path.basename(path)
    src = open(os.path.join(GOLDEN, path + ".cu")).read()
    cubin = compile_cubin(src, name, arch="sm_90a", options=(f"-D{switch}={value}",)).cubin
    return instructions(cubin)[name]


def _reads_another_kernels_output(i) -> bool:
    # through L2, made fresh: vec.cuh ld_cg_fresh (LDG ... STRONG.GPU) or cp.async (LDGSTS)
    return i.opcode.startswith("LDGSTS") or (i.opcode.startswith("LDG") and ".STRONG.GPU" in i.opcode)


def _target(i) -> int | None:
    m = re.search(r"0x([0-9a-f]+)", i.operands)
    return int(m.group(1), 16) if i.opcode.startswith("BRA") and m else None


@pytest.mark.parametrize("path,switch,value", KERNELS)
def test_the_warm_pass_is_the_same_code_run_twice(path, switch, value):
    off, on = _sass(path, switch, 0), _sass(path, switch, value)
    wait = [i.addr for i in on if i.opcode == "ACQBULK"]
    assert len(wait) == 1
    # the loop: a backward branch from past the wait to before it
    loops = [(t, i.addr) for i in on if (t := _target(i)) is not None and t < wait[0] < i.addr]
    assert loops, "no loop around the wait"
    head, tail = min(t for t, _ in loops), max(a for _, a in loops)
    # every read of another kernel's output (through L2, fresh) is inside the loop, none hoisted out
    fresh = [i for i in on if _reads_another_kernels_output(i)]
    assert fresh and all(head <= i.addr <= tail for i in fresh)
    # and every read inside the loop is one (a plain load in the warm pass could leave a stale L1 line)
    inside = [i for i in on if head <= i.addr <= tail and i.opcode.startswith("LDG") and i.opcode != "LDGDEPBAR"]
    assert all(_reads_another_kernels_output(i) for i in inside), [i.opcode for i in inside]
    # ... and made by one copy of the code: no more loads, nor products, than without the pass
    for kind in ("LDG", "HMMA"):
        assert sum(1 for i in on if i.opcode.startswith(kind)) <= sum(1 for i in off if i.opcode.startswith(kind))
    # the norm's weight (no kernel writes it) is the only read before the loop; nothing is stored before the wait
    assert all(".CONSTANT" in i.opcode for i in on if i.opcode.startswith("LDG") and i.addr < head)
    assert not any(i.opcode.startswith(("STG", "ST.", "RED", "ATOM")) for i in on if i.addr < wait[0])


@pytest.mark.parametrize("path,switch,value", KERNELS)
def test_off_it_waits_once_and_reads_nothing_fresh(path, switch, value):
    off = _sass(path, switch, 0)
    assert sum(1 for i in off if i.opcode == "ACQBULK") == 1
    assert not any(".STRONG.GPU" in i.opcode for i in off if i.opcode.startswith("LDG"))
