"""The MoE combine at decode (moe_combine_residual_rms_norm, one CTA a token) is latency: after its
PDL wait it reads the token's routed rows, its shared experts' rows and its residual, and at one
token nothing else runs meanwhile.  moe_combine.cuh combine_row issues all of those loads before the
first sum where they fit the registers, so the kernel waits on memory once, not once for the routed
rows, again for the shared rows and again for the residual (PERF_NOTES v31).  Compiled with NVRTC
on the CPU from the committed goldens."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402

from codegen.nvrtc import compile_cubin  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def _after_wait(path: str):
    name = os.path.basename(path)
    src = open(os.path.join(GOLDEN, path + ".cu")).read()
    instrs = instructions(compile_cubin(src, name, arch="sm_90a").cubin)[name]
    wait = min(i.addr for i in instrs if i.opcode == "ACQBULK")
    return [i for i in instrs if i.addr > wait]


def test_every_row_of_the_token_is_loaded_before_the_first_sum():
    # V2-Lite: 6 routed rows, 2 shared experts' rows and the residual, one 16-byte load a thread each
    ins = _after_wait("deepseek_v2_lite/moe_combine_residual_rms_norm__bf16__k8_d2048__shared2")
    first_sum = min(i.addr for i in ins if i.opcode.startswith(("FADD", "FFMA")))
    rows = [i for i in ins if i.opcode.startswith("LDG.E.128")]
    assert len(rows) == 6 + 2 + 1
    assert all(i.addr < first_sum for i in rows), "a row's load waits for an earlier row's sum"
