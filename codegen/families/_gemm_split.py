"""Split K for the persistent wgmma GEMMs (gemm_fp8, gemm_int8; templates/include/gemm_split.cuh), as size
expressions of T and SMS: at decode batches a linear has fewer 128 x 128 tiles than SMs, so K is split over
`splits` CTAs a tile, the grid is tiles * splits, and each tile's last CTA sums the splits' partial tiles
(the node's partials workspace) in split order.  Both the grid and the kernel's `splits` argument come
from T at run time, so one bundle serves every captured batch size."""
from __future__ import annotations

from codegen.kernel import Workspace
from ir.formats import cdiv

BM, BN, BK = 128, 128, 128     # tokens, weight rows, K bytes of one-byte operands per tile and stage (gemm_ring.cuh)
PARTIAL_WORDS = 2 * 128 * 64   # a partial tile: each consumer thread's 64 sums (gemm_split.cuh PARTIAL_WORDS)
# Split K over at most SPLIT_MAX CTAs a tile: the tile's last CTA reads the other S - 1 partials
# (up to 64 KB each at 128 tokens) from L2 alone, so past a few splits that sum costs more than
# the SMs it adds stream; 8 takes o_proj's 16 tiles to 128 CTAs and q's 24 to 120 (5 splits).
SPLIT_MAX = 8
TICKETS = 1024                 # split tickets a kernel: one per tile; splits only where tiles <= this


def tiles(O: int, silu: bool) -> str:
    """Output tiles at T tokens: 128-token row tiles x column tiles (64 output columns for gate_up_silu)."""
    return f"cdiv(T, {BM}) * {cdiv(O, BN // 2 if silu else BN)}"


def splits(O: int, K: int, silu: bool, min_kb: int = 1) -> str:
    """CTAs a tile (the kernel's `splits`): enough splits of K that tiles * splits reaches the SM count,
    at most SPLIT_MAX and `min_kb` K blocks each (Tuning.linear.gemm_split_min_kb); 1 where the tiles
    alone fill the SMs or would not fit the tickets."""
    cap = max(1, min(SPLIT_MAX, cdiv(K, BK) // min_kb))
    if cap == 1:
        return "1"
    return f"max(1, min({cap}, min(SMS, {TICKETS}) // max(1, {tiles(O, silu)})))"


def grid(O: int, K: int, silu: bool, min_kb: int = 1) -> str:
    """The GEMM's grid: one CTA a tile up to the SM count (a persistent walk past it), times the
    splits (> 1 only where the tiles are fewer than half the SMs: then exactly tiles * splits)."""
    return f"min(SMS, {tiles(O, silu)}) * {splits(O, K, silu, min_kb)}"


def partial_rows(O: int, K: int, silu: bool, min_kb: int = 1) -> str:
    """Partial tiles a split GEMM writes (splits * tiles; none where it does not split)."""
    S = splits(O, K, silu, min_kb)
    return "0" if S == "1" else f"({S}) * {tiles(O, silu)} * min(1, ({S}) - 1)"


def partials(name: str, dtype: str, K: int, widths: list[int], silu: bool, min_kb: int = 1) -> Workspace:
    """The node's partials workspace (rows of PARTIAL_WORDS `dtype` words): its GEMMs (output widths
    `widths`) run one after another, so one workspace as large as the largest needs."""
    need = sorted({partial_rows(O, K, silu, min_kb) for O in widths} - {"0"})
    rows = need[0] if need else "0"
    for r in need[1:]:
        rows = f"max({rows}, {r})"
    return Workspace(name, (rows, PARTIAL_WORDS), dtype)
