"""phases.cuh's marks (bench/perf_phases.py): without DSG_PHASES the kernels read no timer (the
marks are nothing; their machine code is the same as without the header, checked when the marks
landed); with it, the kernels on b=1's decode path read the global timer and the SM clock at thread
0's pdl_wait() call and return and keep their exit with atomic maxima.  Compiled with NVRTC on the
CPU from the committed goldens."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402

from codegen.nvrtc import compile_cubin  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "deepseek_v2_lite")
# b=1's decode layer, one kernel a family (perf_phases.py reads their exit marks)
KERNELS = ["linear_skinny__bf16__k2048__o3072_576",
           "mla_decode_query__bf16__h16_n128_c512__r64__adj_il__rope18a8cfb6__mma_t32_w4_kv",
           "mla_decode_attention__bf16__c512_r64__h16__page64__s8",
           "mla_v_up__bf16__h16_n128_v128_c512__mma_t32_m2",
           "fused_add_rms_norm__bf16__d2048",
           "moe_route__bf16__d2048__e64_k6__softmax_greedy__shared2__fused_t256",
           "moe_gate_up_silu__bf16__e66_k8__m1408_d2048__sh2w__wgmma_skinny",
           "moe_down__bf16__e66__d2048_m1408__wgmma_skinny_t1",
           "moe_combine_residual_rms_norm__bf16__k8_d2048__shared2"]


def _instrs(name: str, marks: bool):
    src = open(os.path.join(GOLDEN, name + ".cu")).read()
    opts = ("-DDSG_PHASES=1",) if marks else ()
    return instructions(compile_cubin(src, name, arch="sm_90a", options=opts).cubin)[name]


@pytest.mark.parametrize("name", KERNELS)
def test_phase_marks_are_nothing_unless_asked_for(name):
    off, on = _instrs(name, False), _instrs(name, True)
    assert not any("SR_GLOBALTIMER" in i.operands for i in off)
    timers = [i.addr for i in on if "SR_GLOBALTIMER" in i.operands]
    waits = [i.addr for i in on if i.opcode == "ACQBULK"]
    assert waits and timers, "no pdl_wait or no mark"
    assert min(timers) < min(waits) < max(timers), "no mark before the wait and after it"
    assert any(i.opcode.startswith(("RED", "ATOM")) and ".MAX" in i.opcode for i in on), "no exit mark"


def test_the_decode_attention_marks_its_entry_before_its_pre_wait_chain():
    # ENTRY apart from WAIT_CALL: the step metadata, block table and first tiles it reads before its
    # wait come between them (perf_phases.py's `entered` and `called`)
    on = _instrs("mla_decode_attention__bf16__c512_r64__h16__page64__s8", True)
    timers = [i.addr for i in on if "SR_GLOBALTIMER" in i.operands]
    loads = [i.addr for i in on if i.opcode.startswith(("LDG", "LDGSTS"))]
    waits = [i.addr for i in on if i.opcode == "ACQBULK"]
    assert timers and loads and waits
    assert min(timers) < min(loads) < min(waits), "no mark before the first load, or no load before the wait"
    assert sum(1 for t in timers if t < min(waits)) >= 2, "entry and the wait's call: two marks before the wait"
