"""The warm passes (off by default; PERF_NOTES v33): the MoE combine's (moe_combine_residual_rms_norm.cu.j2
DSG_COMBINE_WARM_PASS: the row's sum and norm), mla_v_up's (mla_absorb.cuh DSG_VUP_WARM_PASS: its
first token tile) and the skinny linears' (skinny.cuh DSG_SKINNY_WARM_PASS: a batch of K steps and
the reduction) run once before the PDL wait, storing nothing, so their code is fetched while the
kernel before still runs, and then again after it.  What makes that
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
# (kernel, its switch, the switch's value when on, whether it streams weights inside the loop)
COMBINE, VUP, SKINNY = "DSG_COMBINE_WARM_PASS", "DSG_VUP_WARM_PASS", "DSG_SKINNY_WARM_PASS"
KERNELS = [("deepseek_v2_lite/moe_combine_residual_rms_norm__bf16__k8_d2048__shared2", COMBINE, 8, False),
           ("deepseek_v3/moe_combine_residual_rms_norm__bf16__k9_d7168__shared1", COMBINE, 8, False),
           ("deepseek_v2_lite/mla_v_up__bf16__h16_n128_v128_c512__mma_t32_m2", VUP, 8, False),
           ("deepseek_v3/mla_v_up__bf16__h128_n128_v128_c512__mma_t32_m2", VUP, 8, False),
           ("deepseek_v2_lite/linear_skinny__bf16__k2048__o2048", SKINNY, 8, True),
           ("deepseek_v2_lite/linear_skinny__bf16__k2048__o3072_576", SKINNY, 8, True),
           ("deepseek_v3/linear_skinny__bf16__k16384__o7168", SKINNY, 8, True)]


def _sass(path: str, switch: str, value: int):
    name = os.path.basename(path)
    src = open(os.path.join(GOLDEN, path + ".cu")).read()
    cubin = compile_cubin(src, name, arch="sm_90a", options=(f"-D{switch}={value}",)).cubin
    return instructions(cubin)[name]


def _fresh(i) -> bool:
    # a read of another kernel's output through L2, made fresh: vec.cuh ld_cg_fresh (LDG ... STRONG.GPU)
    # or cp.async (LDGSTS)
    return i.opcode.startswith("LDGSTS") or (i.opcode.startswith("LDG") and ".STRONG.GPU" in i.opcode)


def _loads(ins) -> list:
    return [i for i in ins if i.opcode.startswith("LDG") and i.opcode != "LDGDEPBAR"]


def _target(i) -> int | None:
    m = re.search(r"0x([0-9a-f]+)", i.operands)
    return int(m.group(1), 16) if i.opcode.startswith("BRA") and m else None


@pytest.mark.parametrize("path,switch,value,weights", KERNELS)
def test_the_warm_pass_is_the_same_code_run_twice(path, switch, value, weights):
    off, on = _sass(path, switch, 0), _sass(path, switch, value)
    waits = [i.addr for i in on if i.opcode == "ACQBULK"]
    assert len(waits) == sum(1 for i in off if i.opcode == "ACQBULK")   # one a code path, as without
    # the waits of the paths a warm pass runs on inside a loop: a backward branch from past the wait
    # to before it, its trips the passes (the skinny linear's two-n8-tile paths, above 8 tokens,
    # keep the kernel as it was)
    loops = []
    for w in waits:
        spans = [(t, i.addr) for i in on if (t := _target(i)) is not None and t < w < i.addr]
        if spans:
            loops.append((min(t for t, _ in spans), max(a for _, a in spans)))
    assert loops, "no loop around a wait"
    inside = lambda i: any(h <= i.addr <= t for h, t in loops)   # noqa: E731
    # every read of another kernel's output is fresh and inside a loop: none hoisted out of it
    fresh = [i for i in on if _fresh(i)]
    assert fresh and all(inside(i) for i in fresh)
    if weights:
        # the skinny linear streams its weights inside the loop (L1::no_allocate, or element loads
        # off the 16-byte path); x's 16-byte loads there are all fresh, no plain one is left
        assert not any(i.opcode == "LDG.E.128" and inside(i) for i in on)
    else:
        # every read inside the loop is fresh (a plain load in the warm pass could leave a stale L1 line)
        assert all(_fresh(i) for i in _loads(on) if inside(i)), [i.opcode for i in _loads(on) if inside(i)]
        # the weights (no kernel writes them) are the only reads before the loop
        assert all(".CONSTANT" in i.opcode for i in _loads(on) if i.addr < min(h for h, _ in loops))
    # one copy of the code: as many loads and products as without the pass
    assert len(_loads(on)) <= len(_loads(off))
    assert sum(1 for i in on if i.opcode.startswith("HMMA")) <= sum(1 for i in off if i.opcode.startswith("HMMA"))
    # nothing is stored before the first wait
    assert not any(i.opcode.startswith(("STG", "ST.", "RED", "ATOM")) for i in on if i.addr < min(waits))


@pytest.mark.parametrize("path,switch,value,weights", KERNELS)
def test_off_it_reads_nothing_fresh(path, switch, value, weights):
    off = _sass(path, switch, 0)
    assert not any(".STRONG.GPU" in i.opcode for i in _loads(off))
