"""At one token the small kernels of a decode layer are latency: after their PDL wait, each memory
round trip they wait for in turn adds to the step.  These kernels issue every load their result
needs before the first instruction that waits on one.  Compiled with NVRTC on
the CPU from the committed goldens (V2-Lite, and V3's combine)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402

from codegen.nvrtc import compile_cubin  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
QUERY = "mla_decode_query__bf16__h16_n128_c512__r64__adj_il__rope18a8cfb6__mma_t32_w4_kv"


def _after_waits(name: str, spec: str = "deepseek_v2_lite") -> list[list]:
    """The kernel's instructions after each of its pdl_wait() calls, up to the next one (a kernel
    whose CTAs take different paths has a wait on each)."""
    src = open(os.path.join(GOLDEN, spec, name + ".cu")).read()
    instrs = instructions(compile_cubin(src, name, arch="sm_90a").cubin)[name]
    waits = sorted(i.addr for i in instrs if i.opcode == "ACQBULK") + [1 << 62]
    return [[i for i in instrs if a < i.addr < b] for a, b in zip(waits, waits[1:])]


@pytest.mark.parametrize("spec,name", [("deepseek_v2_lite", "moe_combine_residual_rms_norm__bf16__k8_d2048__shared2"),
                                       ("deepseek_v2", "moe_combine_residual_rms_norm__bf16__k8_d5120__shared2")])
def test_the_combine_loads_every_row_of_the_token_before_the_first_sum(spec, name):
    # moe_combine.cuh combine_row: 6 routed rows, 2 shared experts' rows and the residual, one
    # 16-byte load a thread each (v25 summed the routed rows before it loaded the shared rows, and
    # those before the residual: three round trips)
    (ins,) = _after_waits(name, spec)
    first_sum = min(i.addr for i in ins if i.opcode.startswith(("FADD", "FFMA")))
    rows = [i for i in ins if i.opcode.startswith("LDG.E.128")]
    assert len(rows) == 6 + 2 + 1
    assert all(i.addr < first_sum for i in rows), "a row's load waits for an earlier row's sum"


def test_v3s_combine_loads_its_routed_rows_a_group_at_a_time():
    # 896 threads leave registers for 4 rows of 8 items at once: two groups of the 8 routed rows, not
    # a row at a time (eight round trips)
    (ins,) = _after_waits("moe_combine_residual_rms_norm__bf16__k9_d7168__shared1", "deepseek_v3")
    first_sum = min(i.addr for i in ins if i.opcode.startswith("FFMA"))
    assert sum(1 for i in ins if i.opcode.startswith("LDG.E.128") and i.addr < first_sum) >= 4


def _before_position(ins) -> tuple[list, list]:
    """Global loads before and after the first conversion of a position (I2F of a 64-bit int: the
    rope angle's, which waits on the position's load)."""
    conv = min(i.addr for i in ins if i.opcode.startswith("I2F") and ".S64" in i.opcode)
    loads = [i for i in ins if i.opcode.startswith("LDG") and not i.opcode.startswith("LDGSTS")]
    return [i for i in loads if i.addr < conv], [i for i in loads if i.addr > conv]


def _query_paths() -> tuple[list, list]:
    """mla_decode_query's two paths after their waits: the query CTAs' (they stage q_nope with
    cp.async) and the cache-write row's."""
    paths = _after_waits(QUERY)
    assert len(paths) == 2
    query = [p for p in paths if any(i.opcode.startswith("LDGSTS") for i in p)]
    kv = [p for p in paths if not any(i.opcode.startswith("LDGSTS") for i in p)]
    assert len(query) == len(kv) == 1
    return query[0], kv[0]


def test_the_query_ropes_q_pe_with_its_inputs_loaded_beside_the_position():
    # mla_decode_query.cu.j2: a pair's two q_pe elements load with the position, not after the
    # angle's sine (which waited for the position first)
    query, kv = _query_paths()
    before, after = _before_position(query)
    assert len(before) >= 3 and not after


def test_the_cache_write_loads_the_tokens_inputs_before_the_angles():
    # mla_kv_write.cuh: slot, position, the latent row, the norm's weight and the k_pe pair in one
    # round trip; the rotated pair goes to k_rot and the cache row from registers (no read back)
    query, kv = _query_paths()
    before, after = _before_position(kv)
    assert sum(i.opcode.startswith("LDG.E.128") for i in before) == 2, "the latent row and the weight"
    assert len(before) >= 2 + 2 + 2 and not after
