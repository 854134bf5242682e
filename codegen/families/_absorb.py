"""What the two tensor-core absorbed projections (mla_decode_query, mla_v_up) share: how the
step's T tokens are dealt to token chunks (grid x), their register budget, and the name part
that tells these choices apart. Not a family (the leading underscore keeps it out of the registry).

Token chunks: a CTA holds its weight slice in registers and walks token tiles of TN tokens, so
the weight is re-read (from L2) once per chunk and the tokens once per weight block. Plain:
cdiv(T, TN) chunks. Balanced (TC_BALANCED): half tiles (cdiv(T, TN / 2) chunks) while that
stays at MIN_CHUNKS or fewer, full tiles above, and a tile is the chunk's share of T rounded up
to whole n8 MMA columns (mla_absorb.cuh tile_tokens). H200, V2-Lite, us per layer
(perf_decode.py --absorb): TN / 2 tiles won at T = 32..64 (query 4.3 -> 3.4, v_up 3.7 -> 3.4),
TN tiles at T = 128..256 (query 5.5 vs 5.7, v_up 5.0 vs 6.9), which is what the balanced
dealing picks; measured once as a whole, with an unexplained 7.3 -> 10.2 us at T = 256 for the
query (mma_balanced in perf_decode.py; plain is the default until it is measured again).
In both, at most max_chunks chunks: beyond, CTAs loop over several tiles.
"""
from __future__ import annotations

MIN_CHUNKS = 4
REGS_PER_SM = 64 * 1024   # the register file of an SM, sm_80 .. sm_90


def token_chunks(tn: int, max_chunks: int, balanced: bool) -> str:
    """The grid-x size expression: token chunks for T tokens in tiles of at most tn."""
    if balanced:
        return f"min(min(cdiv(T, {tn // 2}), max({MIN_CHUNKS}, cdiv(T, {tn}))), {max_chunks})"
    return f"min(cdiv(T, {tn}), {max_chunks})"


def min_blocks(threads: int, max_regs: int | None) -> int:
    """__launch_bounds__' CTAs-per-SM argument that caps ptxas at max_regs registers a thread
    (0: no cap, ptxas chooses)."""
    return 0 if max_regs is None else max(1, REGS_PER_SM // (threads * max_regs))


def variant_tag(base: str, balanced: bool, blocks: int) -> str:
    """The kernel-name part of a tensor-core variant: base (tiling), _bal, _b<CTAs per SM>."""
    return base + ("_bal" if balanced else "") + (f"_b{blocks}" if blocks else "")
