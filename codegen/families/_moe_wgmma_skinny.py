"""Decode's grouped expert GEMM on Hopper's wgmma + TMA (templates/include/moe_wgmma_skinny.cuh):
decode, where an expert has 1 to ~40 pairs.  A persistent grid of min(2 SMS, tiles) CTAs, 256
threads, the weights as TMA tensor maps of 64-row boxes, the pairs as wgmma's N.

Not a family (the leading underscore): a launch builder for _moe_grouped.py (the "wgmma_skinny"
and "wgmma_skinny_t1" rows of codegen/dispatch.py's grouped_experts table) and the tiles of
moe_expert_ffn's fused launch.  It serves where the prefill wgmma's conditions hold (an sm_90a
target, 16-bit activations, KD % 8 == 0) and two CTAs' shared memory fit an SM (`fits`).
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, size

from . import _moe_wgmma
from ._moe import when

FEATURE = _moe_wgmma.FEATURE
BP, ROWS, BOX, BK = 64, 128, 64, 64   # pairs, weight rows per tile; rows per TMA box; K a stage (moe_wgmma_skinny.cuh WS_*)
THREADS = 256                          # a producer warpgroup and a consumer warpgroup
STAGES = 4                             # 4 x 24 KB in flight per CTA, two CTAs per SM
SM_SHARED = 228 * 1024                 # an H100 / H200 SM's shared memory (each CTA also reserves 1 KB)
# Gate / up with the shared experts among the pairs (moe_route's shared_experts S): those experts
# are 0..S-1 and every token's, so the walk's first S * cdiv(T, BP) * col_tiles row tiles are known
# from T alone, and a CTA whose first tile is one of them runs that tile's whole K loop before its
# wait, its pairs' rows gathered too (its outputs stored after the wait: moe_wgmma_skinny.cuh SH;
# the kernel takes the pair count NP for T), so the shared experts' weights stream while
# the route still runs.
# Down at one token (decode's b = 1) runs as a launch of its own with Tuning.moe.one_token_down_stages
# ring stages, one CTA an SM: twice the weight slices in flight a CTA, and twice the slices of its
# first tile issued before its wait (down's early start, into gate_up_silu's tail).
ONE_TOKEN_STAGE = "wgmma_skinny_t1"     # the launch's stage and kernel-name part


def switch_names(staged: int) -> list:
    """The kernel-name part of the staged epilogue where it is on: its code differs, so its own name."""
    return [f"st{staged}"] * bool(staged)


def smem(stages: int) -> int:
    """The ring and 1 KB of slack to start it on a 1024-byte boundary (wgmma_skinny_smem)."""
    return stages * (ROWS + BP) * BK * 2 + 1024


def static_smem(E: int, stages: int = STAGES) -> int:
    """The full / empty barriers, the row-tile table and a shared tile's pairs (moe_wgmma_skinny.cuh's
    __shared__; the last at most)."""
    return 2 * stages * 8 + 4 * (E + 1) + 4 * BP


def fits(E: int, stages: int = STAGES, ctas: int = 2) -> bool:
    """`ctas` CTAs of this ring and its tables fit an SM's shared memory."""
    return ctas * (smem(stages) + static_smem(E, stages) + 1024) <= SM_SHARED


def cols(*, down: bool) -> int:
    """Output columns a tile covers (wgmma_skinny_cols): down's 128 rows, or 64 gate + 64 up rows."""
    return ROWS if down else ROWS // 2


def col_tiles(n: int, *, down: bool) -> int:
    """Column tiles of n output columns (wgmma_skinny_col_tiles)."""
    return -(-n // cols(down=down))


def row_tiles(E: int) -> str:
    """The most row tiles NP pairs over E experts make: one partial tile per expert with pairs, the
    rest whole (moe_wgmma.cuh wgmma_row_tiles); an expression of NP."""
    return f"(NP // {BP} + min({E}, NP))"


def launch(family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple, opts, *,
           down: bool, run: str | None, shared: int = 0, one_token: bool = False) -> KernelLaunch:
    """The launch over the family's operands; `run`: its token-range factor; `shared`: the routing's
    shared experts, whose first tile gate / up runs before its wait (the kernel then takes NP for
    T); `one_token`: down's one-token launch (one CTA an SM, the deeper ring)."""
    staged = opts.tuning.moe.decode_staged_from
    sh = 0 if down else shared
    if sh:
        args = (*args, size("num_pairs", "NP"))
    names = [*name_parts, *switch_names(staged), *([f"sh{sh}w"] if sh else [])]
    extra = {} if down else {"shared": sh}
    stages = opts.tuning.moe.one_token_down_stages if one_token else STAGES
    tiles = f"{col_tiles(p['N'], down=down)} * {row_tiles(p['E'])}"
    grid = when(f"min(SMS, {tiles})" if one_token else f"min(2 * SMS, {tiles})", run)
    return _moe_wgmma.tma_launch(family, template, names, p, nid, args,
                                 variant=ONE_TOKEN_STAGE if one_token else "wgmma_skinny", box=(BOX, BK),
                                 threads=THREADS, stages=stages, smem_bytes=smem(stages), cols=cols(down=down),
                                 grid=grid, pairs=BP, staged_from=staged, **extra)
