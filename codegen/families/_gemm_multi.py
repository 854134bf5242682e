"""Tuning.linear.gemm_multi: a multi_linear's dense one-byte GEMMs (gemm_fp8, gemm_int8) as the parts of ONE
launch (templates/include/gemm_multi.cuh) instead of a launch a weight.

    today      quant? -> GEMM(q) -> GEMM(kv_a)          under PDL kv_a's launch waits for the whole of q's
    gemm_multi quant? -> GEMM(q | kv_a)                 grid = q's grid + kv_a's grid

Each part keeps its own launch's grid and `splits` (the same size expressions of T and SMS), so part p's CTAs
are CTAs [base_p, base_p + grid_p) of the one grid and each runs its own launch's walk: its outputs are bit-equal
to its own launch's.  The partials workspace holds every part's partial rows one after another (part p's from
row poff_p: the launches no longer run one after another, so they cannot share rows), the tickets are the
kernel's, TICKETS a part.
"""
from __future__ import annotations

import dataclasses

from codegen.kernel import KernelLaunch, Workspace, size

from ._gemm_split import PARTIAL_WORDS, grid, partial_rows, splits


def fuses(op: str, widths: list[int], tuning) -> bool:
    """Whether the node's GEMMs are one launch: the knob on and a multi_linear (2 to MULTI_LINEAR_MAX weights,
    all of one format -- else the node does not lower to these GEMMs at all -- of any widths: every part is
    the single launch's kernel; the kernel's parts are a template loop, so no count is refused)."""
    return tuning.linear.gemm_multi and op == "multi_linear" and len(widths) >= 2


def _total(exprs: list[str]) -> str:
    """The sum of size expressions ("0" for none)."""
    terms = [e for e in exprs if e != "0"]
    return " + ".join(f"({e})" for e in terms) if terms else "0"


def partials(name: str, dtype: str, K: int, widths: list[int], min_kb: int) -> Workspace:
    """The partials workspace of one launch of all the parts: the sum of the parts' partial rows."""
    return Workspace(name, (_total([partial_rows(O, K, False, min_kb) for O in widths]), PARTIAL_WORDS), dtype)


def fuse(gemms: list[KernelLaunch], widths: list[int], K: int, min_kb: int, factor: str | None) -> KernelLaunch:
    """The one launch of `gemms` (a GEMM launch a weight, in the node's order, all alike but for the weight,
    its scales, its output and O = widths[p]; their partials workspace `partials` above): the weight, scale
    and output arguments numbered by part, each part's `splits`, the first CTA (base_p) and first partial row
    (poff_p) of parts 1.., the grid the parts' sum (times the row's `factor`)."""
    first = gemms[0]
    names = [a.name for a in first.args]
    x_args = first.args[:names.index("w")]
    numbered = []
    for p, la in enumerate(gemms):
        numbered += [dataclasses.replace(a, name=f"{a.name}{p}") for a in la.args if a.name in ("w", "sw", "y")]
    grids = [grid(O, K, False, min_kb) for O in widths]
    rows = [partial_rows(O, K, False, min_kb) for O in widths]
    args = (*x_args, *numbered, next(a for a in first.args if a.name == "partials"), size("T", "T"),
            *(size(f"splits{p}", splits(O, K, False, min_kb)) for p, O in enumerate(widths)),
            *(size(f"base{p}", _total(grids[:p])) for p in range(1, len(widths))),
            *(size(f"poff{p}", _total(rows[:p])) for p in range(1, len(widths))))
    total = _total(grids)
    parts = first.name.split("__")
    at = parts.index(f"o{widths[0]}")
    name = "__".join([*parts[:at], "_".join(f"o{O}" for O in widths), *parts[at + 1:]])
    params = {k: v for k, v in first.params.items() if k not in ("O", "silu")}
    return dataclasses.replace(
        first, name=name, params={**params, "variant": "multi", "parts": list(widths)},
        grid=(total if factor is None else f"({total}) * {factor}", 1, 1), args=args)
