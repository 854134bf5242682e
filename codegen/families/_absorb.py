"""What the two tensor-core absorbed projections (mla_decode_query, mla_v_up) share: how the
step's T tokens are dealt to token chunks (grid x). Not a family (the leading underscore keeps it
out of the registry).

Token chunks: a CTA holds its weight slice in registers and walks token tiles of TN tokens, so
the weight is re-read (from L2) once per chunk and the tokens once per weight block: cdiv(T, TN)
chunks, at most max_chunks (beyond, CTAs loop over several tiles).
"""
from __future__ import annotations


def token_chunks(tn: int, max_chunks: int) -> str:
    """The grid-x size expression: token chunks for T tokens in tiles of tn."""
    return f"min(cdiv(T, {tn}), {max_chunks})"
