"""The quantised rows a norm's kernel also writes where ir/passes/norm_rows.py gave the norm them
(attrs["quant"]; rms_norm, fused_add_rms_norm, moe_combine_residual_rms_norm): the launch's extra
template parameter, kernel-name part and arguments (templates/include/norm_quant.cuh); and the int8
readers' side (linear_skinny, gemm_int8, the int experts): where they take those rows instead of their
own quantiser launch (Tuning.linear.norm_int8), and the arguments that bind them.

Not a family (the leading underscore): what the norm families and the int8 readers share.
"""
from __future__ import annotations

from codegen.errors import LoweringError
from codegen.kernel import inp, out, work
from ir.formats_int import qrow
from ir.passes.norm_rows import quant_rows, row_names


def extras(G, nid: str, opts, n: int) -> tuple[dict, list[str], tuple]:
    """(params, kernel-name parts, arguments) the norm node `nid` (rows of n elements) adds for its
    quantised rows: none where it has none; "quant_i8" (the padded row's bytes) for int8 rows, written to
    the values hq (int8 rows, qrow(n) bytes apart) and hs (a float32 scale a token)."""
    data = G.nodes[nid]
    quant = data["attrs"].get("quant")
    if quant is None:
        return {}, [], ()
    if quant != "int8":
        raise LoweringError(f"a norm writes int8 rows for its readers, not {quant!r} ones")
    if opts.dtype not in ("bf16", "fp16"):
        raise LoweringError(f"a norm's int8 rows need bf16 or fp16 activations, not {opts.dtype}")
    q, s = row_names(data["outputs"][0], quant)
    return {"quant_i8": {"qrow": qrow(n)}}, ["qi8"], (out("hq", "signed char", q), out("hs", "float", s))


def int8_rows(G, x: str, opts) -> tuple[str, str] | None:
    """(rows, scales): the int8 rows of x and their per-token scales where the norm that makes x writes
    them and the options read them (Tuning.linear.norm_int8), else None (the reader quantises x itself)."""
    return quant_rows(G, x, "int8") if opts.tuning.linear.norm_int8 else None


def x_args(normed: tuple[str, str] | None, q_ws: str, s_ws: str) -> tuple:
    """A reader's arguments xq, xs: the norm's int8 rows and scales where `normed` names them (int8_rows),
    else its own workspaces q_ws, s_ws (the same C types either way, so the reader's kernel is the same)."""
    if normed:
        return inp("xq", "signed char", normed[0]), inp("xs", "float", normed[1])
    return work("xq", "signed char", q_ws, writes=False), work("xs", "float", s_ws, writes=False)
