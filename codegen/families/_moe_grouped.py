"""The grouped expert families' lowering (moe_gate_up_silu, moe_gate_up, moe_down): the rows of
codegen/dispatch.py's grouped_experts table, one launch each over the same operands, its grid
multiplied by its token range (codegen.sizes.token_ranges), so a step runs exactly one.

Not a family (the leading underscore).  The launch builders: _moe (gemv, mma), _moe_wgmma
(wgmma), _moe_wgmma_skinny (wgmma_skinny, wgmma_skinny_t1), _moe_fp8 (wgmma_skinny_fp8 and
wgmma_skinny_fp8_t1: FP8 weights, p["fp8"]), _moe_gemm_fp8 (wgmma_fp8: FP8 weights x FP8 activations,
its quantiser first), _moe_int (mma_int: msModelSlim's integer weights, p["int"]: the format's name), _moe_gemm_int (wgmma_int:
per-channel integer weights at prefill, _moe_int's quantiser first); the imports form a tree.
"""
from __future__ import annotations

from codegen import dispatch
from codegen.arch import has_feature
from codegen.kernel import KernelLaunch
from codegen.render import kernel_name
from codegen.sizes import token_ranges
from ir.formats import FP8

from . import _moe, _moe_fp8, _moe_gemm_fp8, _moe_gemm_int, _moe_int, _moe_wgmma, _moe_wgmma_skinny as S


# the launches' order in a node's plan (one of them has work at a given T)
ORDER = ("gemv", "wgmma_skinny", S.ONE_TOKEN_STAGE, _moe_fp8.VARIANT, _moe_fp8.ONE_TOKEN_VARIANT, _moe_int.VARIANT,
         "mma", "wgmma", *_moe_gemm_fp8.VARIANTS, _moe_gemm_int.VARIANT)


def facts(opts, p: dict, *, down: bool) -> dict:
    """The conditions of the grouped_experts table for this node and target (p["fp8"]: FP8 weights;
    p["int"]: an integer format's name)."""
    return {"dtype": opts.dtype, "weight_format": p.get("int") or (FP8.name if p.get("fp8") else "same"),
            **_moe_fp8.facts(opts, p), **_moe_int.facts(opts, p), **_moe_gemm_int.facts(opts, p),
            "fp8x_fits": _moe_gemm_fp8.fits(opts, p["E"]),
            "sm_90a": has_feature(opts.arch, _moe_wgmma.FEATURE),
            "tma_rows": p["KD"] % 8 == 0, "decode_wgmma_fits": S.fits(p["E"]),
            "prefill_wgmma_fits": _moe_wgmma.fits(opts, p["E"]),
            "one_token": down and S.fits(p["E"], opts.tuning.moe.one_token_down_stages, ctas=1)}


def table_rows(opts, p: dict, *, down: bool) -> tuple:
    return dispatch.rows("moe_down" if down else "moe_gate_up_silu", facts(opts, p, down=down), opts.tuning)


def launches(family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple, opts, *,
             down: bool, shared: int = 0, within=None) -> list[KernelLaunch]:
    """One launch per variant of the table's rows; `shared`: the routing's shared experts (decode's
    gate / up runs their first tile before its wait); `within`: token ranges the node's launches are
    limited to (moe_expert_ffn's outside its fused window), None: every T."""
    rows = table_rows(opts, p, down=down)
    if any(r.variant == dispatch.NONE for r in rows):
        (_moe_int.check if p.get("int") else _moe_fp8.check)(nid, opts, p)
    fp8x = {v: _clip(dispatch.row_range(rows, v), within) for v in _moe_gemm_fp8.VARIANTS}
    out = []
    for variant in sorted({r.variant for r in rows}, key=ORDER.index):
        ranges = _clip(dispatch.row_range(rows, variant), within)
        if not ranges:
            continue
        run = token_ranges(ranges)
        if variant == "gemv":
            out.append(_moe.gemv_launch(family, template, kernel_name(family, name_parts), p, nid, args, run))
        elif variant == "mma":
            out.append(_moe.mma_launch(family, template, kernel_name(family, [*name_parts, "mma"]), p, nid, args,
                                       run, opts, down=down))
        elif variant == _moe_int.VARIANT:
            out.extend(_moe_int.launches(family, name_parts, p, nid, args, down=down, run=run))
        elif variant == _moe_gemm_int.VARIANT:
            out += _moe_gemm_int.launches(family, name_parts, p, nid, args, down=down, run=run)
        elif variant in (_moe_fp8.VARIANT, _moe_fp8.ONE_TOKEN_VARIANT):
            out.append(_moe_fp8.launch(family, template, name_parts, p, nid, args, opts, down=down, run=run,
                                       one_token=variant == _moe_fp8.ONE_TOKEN_VARIANT, shared=shared))
        elif variant in _moe_gemm_fp8.VARIANTS:
            if variant == _moe_gemm_fp8.MC_VARIANT and fp8x[_moe_gemm_fp8.VARIANT]:
                continue        # emitted with the plain GEMM: one quantiser launch for both
            out += _moe_gemm_fp8.launches(family, template, name_parts, p, nid, args, opts, down=down,
                                          ranges=fp8x[_moe_gemm_fp8.VARIANT], mc_ranges=fp8x[_moe_gemm_fp8.MC_VARIANT])
        elif variant == "wgmma":
            out.append(_moe_wgmma.launch(family, template, name_parts, p, nid, args, down=down, run=run))
        else:
            # A shared expert's early tile (before the wait) takes its pairs in token order, the walk's
            # later tiles of the same expert take the route's `order` (its order inside an expert follows
            # atomics): the two agree only while a shared expert is one row tile, T <= S.BP.
            early = _clip(ranges, [(1, S.BP)]) if shared else []
            late = _clip(ranges, [(S.BP + 1, None)]) if shared else ranges
            for part, sh in ((early, shared), (late, 0)):
                if part:
                    out.append(S.launch(family, template, name_parts, p, nid, args, opts, down=down,
                                        run=token_ranges(part), shared=sh, one_token=variant == S.ONE_TOKEN_STAGE))
    return out


def fp8x_from(opts, p: dict, within=None) -> int | None:
    """The first token count at which gate / up's launches (params p, token ranges `within` as in
    `launches`) run FP8 x FP8 (the table's wgmma_fp8 row), None: never (_norm_quant.fp8_from)."""
    rows = table_rows(opts, p, down=False)
    ranges = [r for v in _moe_gemm_fp8.VARIANTS for r in _clip(dispatch.row_range(rows, v), within)]
    return min((lo for lo, _ in ranges), default=None)


def _clip(ranges, within):
    """`ranges` intersected with `within` (both lists of (lo, hi), hi None: no end)."""
    if within is None:
        return ranges
    out = []
    for lo, hi in ranges:
        for wlo, whi in within:
            a = max(lo, wlo)
            b = hi if whi is None else (whi if hi is None else min(hi, whi))
            if b is None or a <= b:
                out.append((a, b))
    return out
