"""What the two tensor-core absorbed projections (mla_decode_query, mla_v_up) share: how the
step's T tokens are dealt to token chunks (grid x), and kv_b's storage format. Not a family (the
leading underscore keeps it out of the registry).

Token chunks: a CTA holds its weight slice in registers and walks token tiles of TN tokens, so
the weight is re-read (from L2) once per chunk and the tokens once per weight block: cdiv(T, TN)
chunks, at most max_chunks (beyond, CTAs loop over several tiles).

kv_b in FP8 (fp8_e4m3_block128): the tensor-core kernels with templates/include/mla_absorb_fp8.cuh's
weight sides; the kernel takes the bytes as `kv_b` and the block scales as `kv_b_s`, and its name
carries "wfp8" after the activation dtype (as linear_skinny's).
"""
from __future__ import annotations

from codegen import dispatch
from codegen.kernel import weight
from ir.formats import FP8, companion_names, weight_format

from ._dense_util import LoweringError

FP8_NAME = "wfp8"   # the kernel-name part of FP8 weights


def token_chunks(tn: int, max_chunks: int) -> str:
    """The grid-x size expression: token chunks for T tokens in tiles of tn."""
    return f"min(cdiv(T, {tn}), {max_chunks})"


def kv_b_format(G, nid: str, kv_b: str, opts, table: str, mma: bool) -> tuple[bool, tuple]:
    """(whether kv_b is FP8, the rows of dispatch table `table` that serve the node).  FP8 kv_b where
    no FP8 kernel serves (fp32 activations, dims off the tensor-core tiling) is the table's "none" row:
    one LoweringError naming the node."""
    fp8 = weight_format(G, kv_b, opts.dtype) is FP8
    rows = dispatch.rows(table, {"mma": mma, "weight_format": FP8.name if fp8 else "same"}, opts.tuning)
    if any(r.variant == dispatch.NONE for r in rows):
        raise LoweringError(f"{G.nodes[nid]['op']} {nid} ({opts.dtype}): {rows[0].reason}")
    return fp8, rows


def kv_b_args(kv_b: str, act: str, fp8: bool) -> tuple:
    """kv_b's kernel arguments: the weight in the activation type, or its FP8 bytes and block scales."""
    if not fp8:
        return (weight("kv_b", act, kv_b),)
    return weight("kv_b", "unsigned char", kv_b), weight("kv_b_s", "float", companion_names(kv_b, FP8)[0])


def dtype_part(dtype: str, fp8: bool) -> str:
    """The kernel name's first part: the activation dtype, and "wfp8" for FP8 kv_b."""
    return f"{dtype}_{FP8_NAME}" if fp8 else dtype
