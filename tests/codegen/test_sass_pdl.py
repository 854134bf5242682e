"""Every kernel launched with programmatic dependent launch keeps templates/include/pdl.cuh's
contract in its machine code (sm_90, NVRTC on the CPU), so a family that declares PDL = True
without the wait fails here, not on the GPU as a rare race.

In SASS, griddepcontrol.wait is ACQBULK and griddepcontrol.launch_dependents is PREEXIT (read off a
kernel compiled for it; prefetch.global.L2 is CCTL.E.PF2).  The check reads a kernel's instructions
in address order up to its first ACQBULK:
  - no EXIT / RET before it, and no branch past it (every path from the entry reaches the wait:
    a CTA that returned without waiting could let the grid complete before the kernel it depends
    on, and the kernel after it would then read unfinished data);
  - no global store or atomic before it (the contract's "before its first global write");
  - no global load before it, unless the family is in WEIGHT_LOADS_BEFORE_WAIT (the contract allows
    weights, which no SASS check can tell from activations: a family that reads weights first says
    so there, where a reviewer sees it) or STEP_INPUTS_BEFORE_WAIT (the step's inputs and earlier
    steps' cache rows, likewise), or the load is a TMA box or an L2-coherent load of a family
    in TWO_BACK_LOADS_BEFORE_WAIT (what the kernel two launches back wrote), or that or an
    L2-only cp.async gather of a family in TWO_BACK_GATHERS_BEFORE_WAIT;
  - a PREEXIT after it (launch_dependents: else the next kernel waits for this one to exit).
The planted kernels at the end prove the check catches each way of breaking it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass import cuobjdump, instructions  # noqa: E402
from tiny import ROOT  # noqa: E402

from codegen import families  # noqa: E402
from codegen.bundle import compile_kernels, disambiguate, plan_spec, unique_kernels  # noqa: E402
from codegen.kernel import DEFAULTS  # noqa: E402
from codegen.nvrtc import compile_cubin  # noqa: E402
from codegen.render import include_closure  # noqa: E402
from codegen.tuning import MoeTuning, PersistentTuning, Tuning  # noqa: E402

pytestmark = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump and nvdisasm (the test extra)")

SPECS = ("deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
# Families whose kernels read weights with global loads before pdl_wait() (pdl.cuh allows weights
# only).  The absorbed projections load their kv_b slice into registers first (mla_absorb.cuh;
# tests/codegen/test_sass_absorb.py checks that those loads are the weight's), the skinny linears
# their first batch of weight chunks (skinny.cuh mma_tiles: load_weights(0), then the wait); the
# router's gate goes towards L2 with prefetches, which are not loads.  The row norms load their
# weight row first (rms_norm.cu.j2, fused_add_rms_norm.cu.j2, moe_combine_residual_rms_norm.cu.j2).  The
# dense one-byte GEMMs issue their first ring stages' weight boxes by TMA (linear.gemm_weights_early, on by
# default; tests/codegen/test_gemm_early.py checks that nothing but those UTMALDG precedes their wait).
WEIGHT_LOADS_BEFORE_WAIT: frozenset = frozenset({"mla_decode_query", "mla_v_up", "linear_skinny", "rms_norm",
                                                 "fused_add_rms_norm", "moe_combine_residual_rms_norm",
                                                 "gemm_fp8", "gemm_int8"})
# Families whose kernels read before pdl_wait() what the kernel two launches back wrote (pdl.cuh: the
# kernel between waits before it lets them launch), through L2 only (LDG ... .STRONG.GPU), and start
# weight boxes by TMA (UTMALDG: tensor maps bind weights only); any other load before the wait is
# still refused.  moe_down: the route's offsets behind gate_up_silu (moe_wgmma_skinny.cuh).
TWO_BACK_LOADS_BEFORE_WAIT: frozenset = frozenset({"moe_down"})
# Families whose kernels read before pdl_wait() the step's inputs and the KV-cache rows of earlier
# steps (pdl.cuh's third allowance; loads only, as for weights): the decode attention's first tiles
# (mla_decode.cuh; test_sass_decode_prefetch.py, and on the GPU
# tests/gpu/test_kernels_mla.py's race test, check that this step's rows wait).
STEP_INPUTS_BEFORE_WAIT: frozenset = frozenset({"mla_decode_attention"})
# Families whose kernels, besides TWO_BACK_LOADS_BEFORE_WAIT's loads, gather rows that the kernel two
# launches back wrote with L2-only cp.async (LDGSTS.E.BYPASS: cp.async.cg) before pdl_wait():
# decode's gate / up runs a shared expert's tile's K loop before its wait, its weight boxes by TMA
# and its pair rows (x, the route's input) gathered (moe_wgmma_skinny.cuh SH); it stores after.
TWO_BACK_GATHERS_BEFORE_WAIT: frozenset = frozenset({"moe_gate_up_silu", "moe_gate_up"})
# Of those, the FP8 weights' kernels (name part `_wfp8`) also read their weight blocks' scales with constant-cache
# loads (LDG.E.CONSTANT: moe_fp8.cuh's __ldg of sc0 / sc1) in the shared tile's K loop before the wait: weights,
# which no kernel writes.  The check cannot tell a scale's load from x's, so on the GPU
# tests/gpu/test_kernels_moe_fp8.py's shared-tile race test and its mutant (the tile reading the route's ids
# before they are written) stand for it.
SCALE_LOADS_BEFORE_WAIT = "_wfp8"

_EXITS = ("EXIT", "RET", "KILL", "BRX", "JMX", "CALL", "JMP")
_WRITES = ("STG", "ST", "ATOM", "ATOMG", "RED", "SUST", "SURED", "SUATOM", "UTMASTG", "UTMAREDG")
_LOADS = ("LDG", "LD", "LDGSTS", "UBLKCP", "UTMALDG", "SULD")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def _two_back_load(opcode: str, gathers: bool = False, scales: bool = False) -> bool:
    return (opcode.startswith("UTMALDG") or (opcode.startswith("LDG.") and ".STRONG.GPU" in opcode)
            or (gathers and opcode.startswith("LDGSTS.") and ".BYPASS" in opcode)
            or (scales and opcode.startswith("LDG.") and ".CONSTANT" in opcode))


def wait_problem(instrs, *, weight_loads: bool = False, two_back: bool = False, gathers: bool = False,
                 scales: bool = False) -> str | None:
    """Why a kernel's instructions break the PDL contract, or None.  Every path from the entry is
    followed (conditional branches both ways, unconditional ones to their target) until it reaches a
    wait: none may exit, write, or load (but weights, where allowed) before it.  A kernel may wait on
    two paths, e.g. its vector and element instantiations, each after its own weight prefetch."""
    if not any(i.opcode == "ACQBULK" for i in instrs):
        return "never calls griddepcontrol.wait (no ACQBULK)"
    index = {ins.addr: n for n, ins in enumerate(instrs)}
    seen: set = set()
    todo = [0]
    while todo:
        n = todo.pop()
        while True:
            if n >= len(instrs):
                return "a path runs off the end of the kernel without waiting"
            if n in seen:
                break
            seen.add(n)
            ins = instrs[n]
            if ins.opcode == "ACQBULK":
                break   # this path waited
            head = ins.opcode.split(".")[0]
            where = f"{ins.opcode} {ins.operands} at {ins.addr:#x}, on a path that has not waited"
            if head in _EXITS:
                return f"leaves the prologue: {where}"
            if head in _WRITES or ins.opcode.startswith("UBLKCP.G"):
                return f"writes global memory: {where}"
            if (head in _LOADS and not weight_loads
                    and not ((two_back or gathers) and _two_back_load(ins.opcode, gathers, gathers and scales))):
                return (f"reads global memory: {where} (weights only, and then its family belongs in "
                        f"WEIGHT_LOADS_BEFORE_WAIT)")
            if head == "BRA":
                target = _TARGET.search(ins.operands)
                if target is None or int(target.group(1), 16) not in index:
                    return f"branches where the check cannot follow: {where}"
                todo.append(index[int(target.group(1), 16)])
                if not ins.guarded:
                    break   # no fall-through
            n += 1
    first = min(i.addr for i in instrs if i.opcode == "ACQBULK")
    if not any(i.opcode == "PREEXIT" and i.addr > first for i in instrs):
        return "never calls griddepcontrol.launch_dependents after the wait (no PREEXIT)"
    return None


def _pdl_sources(plans_list) -> dict:
    """name -> KernelSource of every PDL launch in these plans."""
    out = {}
    for plans in plans_list:
        pdl = {la.name for p in plans.values() for la in p.launches if la.pdl}
        out.update({k.name: k for k in unique_kernels(plans) if k.name in pdl})
    return out


def _plans_after(spec: str, passes: list, opts=DEFAULTS, extra: str = "") -> dict:
    """The phases lowered after `passes` (none: straight from the graph builder); `extra`: YAML appended
    to the spec (a weight_formats section)."""
    import ir
    from codegen.lower import lower_graph
    from ir.passes import run_pipeline
    text = (ROOT / "model_specs" / f"{spec}.yaml").read_text() + extra
    parsed = ir.parse_spec(text, f"{spec}.yaml")
    return disambiguate({ph: lower_graph(run_pipeline(ir.build_graph(parsed, ph), passes), opts, strict=False)
                         for ph in ("prefill", "decode")})


def _unfused_plans(spec: str, opts=DEFAULTS) -> dict:
    """No passes: the families the pipeline fuses away (add, moe_topk, moe_align, moe_gate_up,
    moe_combine) lower here."""
    return _plans_after(spec, [], opts)


def _partly_fused_plans(spec: str) -> dict:
    """The pipeline without fuse_add_rms_norm and fuse_decode_prologue: the kernels those two fuse
    away in the shipped specs (moe_combine_residual, mla_decode_query, decode's mla_kv_cache_write)."""
    from ir.passes import PIPELINE
    return _plans_after(spec, [p for p in PIPELINE if p.name not in ("fuse_add_rms_norm", "fuse_decode_prologue")])


def _fp8_plans() -> dict:
    """V2-Lite with DeepSeek-V3's FP8 weights (the FP8 linears: skinny and gemm_fp8's launches; what has
    no FP8 kernel yet is left unlowered)."""
    from ir.formats import FP8, FP8_CHECKPOINT_GLOBS, weight_formats_yaml
    from ir.passes import PIPELINE
    return _plans_after("deepseek_v2_lite", list(PIPELINE), extra="\n" + weight_formats_yaml(FP8_CHECKPOINT_GLOBS, FP8))


def _int_plans() -> dict:
    """V2-Lite in msModelSlim's W4A8 layout (int8 linears: the skinny kernel's and gemm_int8's launches,
    their quantisers; packed int4 experts)."""
    from ir.config_to_spec import msmodelslim_weight_formats
    from ir.passes import PIPELINE
    return _plans_after("deepseek_v2_lite", list(PIPELINE),
                        extra=msmodelslim_weight_formats("w8a8_dynamic", "w4a8_dynamic", True))


def _key(k) -> str:
    return json.dumps([k.name, k.template, k.params], sort_keys=True)


@functools.lru_cache(maxsize=None)
def _problems(case: str) -> dict:
    """(kernel name, template, params) -> (family, problem or None) of every PDL kernel of one case;
    "unfused" and "variants" compile only what the V2-Lite cases before them did not."""
    lite = ROOT / "model_specs" / "deepseek_v2_lite.yaml"
    seen: dict = {}
    if case == "unfused":
        seen = _problems("deepseek_v2_lite")
        plans = [_unfused_plans("deepseek_v2_lite"), _partly_fused_plans("deepseek_v2_lite")]
    elif case == "variants":   # the parallel align below its default bound; the GEMV and the mma; FP8 and int weights;
        # persistent segments
        # launch (decode's wgmma off: they serve fp32, odd KD, other targets)
        seen = {**_problems("deepseek_v2_lite"), **_problems("unfused")}
        opts = dataclasses.replace(DEFAULTS, tuning=Tuning(moe=MoeTuning(align_parallel_above=512, decode_wgmma=False)))
        segments = dataclasses.replace(DEFAULTS, tuning=Tuning(persistent=PersistentTuning(segments=True)))
        plans = [_unfused_plans("deepseek_v2_lite", opts), plan_spec(str(lite), opts).plans, _fp8_plans(),
                 _int_plans(), plan_spec(str(lite), segments).plans]
    else:
        plans = [plan_spec(str(ROOT / "model_specs" / f"{case}.yaml"), DEFAULTS).plans]
    sources = [k for k in _pdl_sources(plans).values() if _key(k) not in seen]
    cubins = compile_kernels(sources, "sm_90", jobs=2)
    out = {}
    for k in sources:
        funcs = instructions(cubins[k.name])
        early_loads = k.family in WEIGHT_LOADS_BEFORE_WAIT | STEP_INPUTS_BEFORE_WAIT
        out[_key(k)] = (k.family, wait_problem(funcs[k.name], weight_loads=early_loads,
                                               two_back=k.family in TWO_BACK_LOADS_BEFORE_WAIT,
                                               gathers=k.family in TWO_BACK_GATHERS_BEFORE_WAIT,
                                               scales=SCALE_LOADS_BEFORE_WAIT in k.name))
    return out


CASES = ["deepseek_v2_lite", "unfused", "variants",
         *(pytest.param(s, marks=pytest.mark.slow) for s in SPECS if s != "deepseek_v2_lite")]


@pytest.mark.parametrize("case", CASES)
def test_every_pdl_kernel_waits_before_it_touches_another_kernels_data(case):
    problems = _problems(case)
    assert problems, f"{case}: no PDL kernel at all (or none new)"
    bad = [f"{json.loads(key)[0]} ({family}): {p}" for key, (family, p) in problems.items() if p]
    assert not bad, "\n".join(bad)


def test_every_pdl_family_is_checked():
    """Each family that declares PDL = True has kernels among those checked above (V2-Lite)."""
    checked = {family for case in ("deepseek_v2_lite", "unfused", "variants") for family, _ in _problems(case).values()}
    declared = {f.FAMILY for f in families.families() if families.uses_pdl(f)}
    assert declared <= checked, sorted(declared - checked)


def test_lowering_marks_only_pdl_families_and_no_pdl_turns_them_all_off(monkeypatch):
    """Every V2-Lite family declares PDL now, so one is switched off here to see the mark follow the
    family's declaration, not a blanket default."""
    spec = str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")
    by_family = {f.FAMILY: families.uses_pdl(f) for f in families.families()}
    plans = plan_spec(spec, DEFAULTS).plans
    launches = [la for p in plans.values() for la in p.launches]
    assert all(la.pdl == by_family[la.family] for la in launches)
    assert any(la.pdl for la in launches)
    norm = families.family_for_op("fused_add_rms_norm")
    monkeypatch.setattr(norm, "PDL", False)
    mixed = [la for p in plan_spec(spec, DEFAULTS).plans.values() for la in p.launches]
    assert {la.pdl for la in mixed if la.family == norm.FAMILY} == {False}
    assert all(la.pdl for la in mixed if la.family != norm.FAMILY and by_family[la.family])
    import dataclasses
    off = plan_spec(spec, dataclasses.replace(DEFAULTS, pdl=False)).plans
    assert not any(la.pdl for p in off.values() for la in p.launches)


def test_two_back_allowance_takes_only_l2_loads_and_tma():
    """The allowance for moe_down lets an L2-coherent load and a TMA box through before the wait,
    not a plain (L1-cached or read-only) load nor a cp.async gather."""
    from sass import Instr
    mk = lambda n, op: Instr(addr=16 * n, opcode=op, operands="", guarded=False)   # noqa: E731
    tail = [mk(8, "ACQBULK"), mk(9, "PREEXIT"), mk(10, "EXIT")]
    for op in ("LDG.E.STRONG.GPU", "UTMALDG.3D"):
        assert wait_problem([mk(0, op), *tail], two_back=True) is None
        assert "reads global memory" in wait_problem([mk(0, op), *tail])
    for op in ("LDG.E.CONSTANT", "LDG.E", "LDGSTS.E.BYPASS.128"):
        assert "reads global memory" in wait_problem([mk(0, op), *tail], two_back=True)


def test_gather_allowance_takes_only_l2_loads_tma_and_l2_gathers():
    """The allowance for decode's gate / up (a shared expert's tile before the wait) lets an L2-only
    cp.async gather through as well, not one that may fill L1 (.ACCESS: cp.async.ca) nor a plain
    load, and no store: the tile's outputs wait."""
    from sass import Instr
    mk = lambda n, op: Instr(addr=16 * n, opcode=op, operands="", guarded=False)   # noqa: E731
    tail = [mk(8, "ACQBULK"), mk(9, "PREEXIT"), mk(10, "EXIT")]
    for op in ("LDGSTS.E.BYPASS.LTC128B.128", "UTMALDG.3D", "LDG.E.STRONG.GPU"):
        assert wait_problem([mk(0, op), *tail], gathers=True) is None
    assert "reads global memory" in wait_problem([mk(0, "LDGSTS.E.BYPASS.LTC128B.128"), *tail])
    for op in ("LDG.E.CONSTANT", "LDG.E", "LDGSTS.E.LTC128B.128"):
        assert "reads global memory" in wait_problem([mk(0, op), *tail], gathers=True)
    for op in ("STG.E.U16", "STG.E.128"):
        assert "writes global memory" in wait_problem([mk(0, op), *tail], gathers=True)
    # the FP8 tile's weight-block scales: a constant-cache load, with the gathers only, never a plain one
    assert wait_problem([mk(0, "LDG.E.CONSTANT"), *tail], gathers=True, scales=True) is None
    assert "reads global memory" in wait_problem([mk(0, "LDG.E.CONSTANT"), *tail], scales=True)
    assert "reads global memory" in wait_problem([mk(0, "LDG.E"), *tail], gathers=True, scales=True)
