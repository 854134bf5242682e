"""Tuning.linear.gemm_multi on the CPU: a multi_linear's dense one-byte GEMMs (gemm_fp8, gemm_int8) as ONE launch
(codegen/families/_gemm_multi.py, templates/include/gemm_multi.cuh).  Off (the default): the launches as without
the knob.  On: the quantiser's launch unchanged, one GEMM launch for q + kv_a whose grid is the parts' grids'
sum, each part's `splits` its own launch's, the CTA -> (part, CTA of the part) map covering exactly each part's
own launch's CTAs, the partials workspace the parts' rows one after another (2, 3 and 4 weights: a
multi_linear's most); a linear and a gate_up_silu untouched; explain says so.  NVRTC + ptxas -v of the fused
kernel at V2-Lite's q + kv_a: no spills, no more registers than the single launch, wgmma (QGMMA / IGMMA) in the
SASS."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_linear_fp8 import _lite  # noqa: E402
from test_linear_int8 import I8  # noqa: E402
from tiny import ROOT  # noqa: E402

from codegen import sizes  # noqa: E402
from codegen.families import gemm_fp8, gemm_int8, linear_skinny  # noqa: E402
from codegen.kernel import KernelLaunch, Options  # noqa: E402
from codegen.tuning import LinearTuning, Tuning  # noqa: E402
from ir.formats import FP8  # noqa: E402
from ir.ops import TType  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import single_op_graph  # noqa: E402

FAMILIES = {"fp8": (FP8.name, gemm_fp8, "fp8_wgmma"), "int8": (I8, gemm_int8, "i8_wgmma")}
LITE = (3072, 576)        # V2-Lite's q + kv_a


def _node(fmt: str, widths=LITE, K: int = 2048):
    """A multi_linear of `widths` over x [T, K], every weight in `fmt`."""
    G, nid = single_op_graph(_lite(), "multi_linear", {"out_dims": list(widths)}, {"x": TType(("T", K), "act")},
                             {f"weight{i}": f"w{i}" for i in range(len(widths))})
    for name in G.graph["weights"]:
        G.graph["weights"][name] = dataclasses.replace(G.graph["weights"][name], format=fmt)
    return G, nid


def _launches(family: str, multi: bool | None, widths=LITE, K: int = 2048, dtype: str = "bf16"):
    """The node's launches of the family (the quantiser first, then the GEMMs); the knob as asked (None: its
    default)."""
    fmt, fam, _ = FAMILIES[family]
    knob = {} if multi is None else {"gemm_multi": multi}
    G, nid = _node(fmt, widths, K)
    return [s for s in linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=Tuning(linear=LinearTuning(**knob))))
            if isinstance(s, KernelLaunch) and s.family == fam.FAMILY]


def _value(expr, T: int, sms: int = 132) -> int:
    return sizes.evaluate(expr, {"T": T, "SMS": sms})


def _size(launch: KernelLaunch, name: str, T: int, sms: int = 132) -> int:
    return _value(next(a.ref.expr for a in launch.args if a.name == name), T, sms)


def _running(launches, T: int) -> list[KernelLaunch]:
    """The launches with work at T (the runtime skips an empty grid)."""
    return [la for la in launches if _value(la.grid[0], T) > 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_knob_is_off_by_default_and_off_changes_nothing(family):
    default, off = _launches(family, None), _launches(family, False)
    assert default == off
    assert len(off) == 3 and all("parts" not in la.params for la in off)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [128, 16384])
def test_one_gemm_launch_for_q_and_kv_a(family, T):
    _, _, stage = FAMILIES[family]
    off, on = (_running(_launches(family, m), T) for m in (False, True))
    assert [la.stage for la in off][1:] == [stage, stage] and [la.stage for la in on][1:] == [stage]
    assert on[0] == off[0]                                   # the quantiser's launch unchanged
    (fused,) = on[1:]
    assert fused.name == off[1].name.replace("__o3072", "__o3072_o576")
    assert fused.params == {**{k: v for k, v in off[1].params.items() if k not in ("O", "silu")},
                            "variant": "multi", "parts": list(LITE)}
    assert (fused.block, fused.smem, fused.requires, fused.pdl) == (off[1].block, off[1].smem, off[1].requires,
                                                                    off[1].pdl)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_one_launch_survives_the_manifest(family):
    import json

    from codegen.manifest import step_from_json, step_to_json
    (fused,) = _launches(family, True)[1:]
    assert step_from_json(json.loads(json.dumps(step_to_json(fused)))) == fused


def _refs(launch: KernelLaunch, suffix: str = "") -> dict:
    """Argument name (less `suffix`) -> (C type, what it binds), of the weight, scale and output arguments."""
    return {a.name.removesuffix(suffix): (a.ctype, a.ref) for a in launch.args
            if a.name.removesuffix(suffix) in ("w", "sw", "y")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sms", [132, 114, 78])
def test_the_grid_is_the_parts_sum_and_each_part_keeps_its_own_splits_and_operands(family, sms):
    off, on = _launches(family, False), _launches(family, True)
    singles, (fused,) = off[1:], on[1:]
    for p, la in enumerate(singles):
        assert _refs(fused, str(p)) == _refs(la) and len(_refs(la)) == 3
    x_args = [a for a in fused.args if a.name in ("xq", "xs")]
    assert x_args == [a for a in singles[0].args if a.name in ("xq", "xs")]
    for T in (17, 33, 64, 65, 100, 128, 129, 200, 256, 257, 1000, 4096, 16384):
        grids = [_value(la.grid[0], T, sms) for la in singles]
        assert _value(fused.grid[0], T, sms) == sum(grids), T
        for p, la in enumerate(singles):
            assert _size(fused, f"splits{p}", T, sms) == _size(la, "splits", T, sms)
            if p and sum(grids):                                     # (no launch below the GEMM's range)
                assert _size(fused, f"base{p}", T, sms) == sum(grids[:p])


def _slot(cta: int, base: list[int], grid: int) -> tuple[int, int, int]:
    """gemm_multi.cuh slot_of: (part, CTA of the part, the part's CTAs)."""
    s = (0, cta, base[1] if len(base) > 1 else grid)
    for q in range(1, len(base)):
        if cta >= base[q]:
            s = (q, cta - base[q], (base[q + 1] if q + 1 < len(base) else grid) - base[q])
    return s


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("widths", [LITE, (3072, 576, 200), (1536, 576, 64, 2048)])
def test_each_cta_runs_a_cta_of_its_parts_own_launch_and_the_partials_do_not_meet(family, widths):
    """The kernel's map of blockIdx.x to (part, CTA of the part) gives every CTA of every part's own launch
    exactly once, with that launch's grid; part p's partial rows [poff_p, poff_p + rows_p) lie one after
    another inside the workspace."""
    off, on = _launches(family, False, widths), _launches(family, True, widths)
    singles, (fused,) = off[1:], on[1:]
    (ws,) = [w for w in fused.workspace if w.name.endswith("partials")]
    for sms in (132, 78):
        for T in (65, 128, 256, 300, 2048):                             # the GEMMs' range, fp8's and int8's
            grid = _value(fused.grid[0], T, sms)
            assert grid > 0
            base = [0] + [_size(fused, f"base{p}", T, sms) for p in range(1, len(widths))]
            seen = sorted(_slot(c, base, grid) for c in range(grid))
            want = sorted((p, c, _value(la.grid[0], T, sms)) for p, la in enumerate(singles)
                          for c in range(_value(la.grid[0], T, sms)))
            assert seen == want, (T, sms)
            start = 0
            for p, (O, la) in enumerate(zip(widths, singles)):
                S = _size(la, "splits", T, sms)
                rows = 0 if S == 1 else S * -(-T // 128) * -(-O // 128)
                if p:
                    assert _size(fused, f"poff{p}", T, sms) == start
                start += rows
            assert _value(ws.shape[0], T, sms) == start >= max(
                _value(w.shape[0], T, sms) for w in off[1].workspace if w.name == ws.name)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_linear_and_a_gate_up_silu_are_not_touched(family):
    from test_linear_fp8 import _node as fp8_node
    from test_linear_int8 import _node as int8_node
    fmt, fam, _ = FAMILIES[family]
    node = fp8_node if family == "fp8" else int8_node
    for op in ("linear", "gate_up_silu"):
        G, nid = node(op, (fmt, fmt))
        steps = [linear_skinny.lower(nid, G, Options(tuning=Tuning(linear=LinearTuning(gemm_multi=m))))
                 for m in (False, True)]
        assert steps[0] == steps[1], op


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_kernel_compiles_without_spills_and_no_more_registers(family):
    """NVRTC + ptxas -v for sm_90a at V2-Lite's q + kv_a (with the default overlap and early weights): 0 spills,
    no serialised wgmma (C7514 / C7517), registers at most the single launch's, wgmma in the SASS; on a path
    before either part's PDL wait its weights' TMA boxes and nothing else of global memory, no exit
    (test_sass_pdl.wait_problem, as test_gemm_early checks the single launches)."""
    import re

    from sass import cuobjdump, instructions, opcodes
    from test_gemm_early import _before_wait
    from test_sass_pdl import wait_problem

    from codegen.arch import kernel_target
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch

    def regs(la):
        res = compile_cubin(render_launch(la), la.name, arch=kernel_target("sm_90", la.requires),
                            options=("--ptxas-options=-v",))
        assert "0 bytes spill stores" in res.log and "0 bytes spill loads" in res.log, res.log
        assert "C7514" not in res.log and "C7517" not in res.log, res.log
        return int(re.search(r"Used (\d+) registers", res.log).group(1)), res.cubin
    (fused,) = _launches(family, True)[1:]
    single, _ = regs(_launches(family, False)[1])
    n, cubin = regs(fused)
    assert n <= single, (n, single)
    if cuobjdump() is not None:
        assert any("GMMA." in op for op in opcodes(cubin)), "no wgmma in the fused kernel"   # QGMMA (e4m3), IGMMA (s8)
        (body,) = instructions(cubin).values()
        early = {i.opcode.split(".")[0] for i in _before_wait(body)}
        assert "UTMALDG" in early and not early & {"LDG", "LDGSTS", "STG", "ATOMG", "RED", "EXIT", "RET"}, sorted(early)
        assert wait_problem(body, two_back=True) is None, wait_problem(body, two_back=True)


@pytest.mark.slow
@pytest.mark.parametrize("weights, name", [("fp8", "gemm_fp8__bf16_wfp8__k2048__o3072_o576__ovl__ew"),
                                           ("w4a8", "gemm_int8__bf16_wi8__k2048__o3072_o576__ew")])
def test_explain_shows_the_one_launch(weights, name):
    from runtime.cli_explain import explain_lines
    spec = str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")
    lines = explain_lines(spec, tokens=[128], phases=("decode",), arch="sm_90a", weights=weights,
                          tuning=["linear.gemm_multi=true"])
    at = next(i for i, line in enumerate(lines) if "multi_linear" in line)
    assert lines[at + 1].split() == ["runs", name]
    assert "2 weights' GEMMs are one launch" in lines[at + 2] and "linear.gemm_multi" in lines[at + 2]
