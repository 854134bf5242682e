"""The quantised rows a norm's kernel also writes where ir/passes/norm_rows.py gave the norm them
(attrs["quant"]; rms_norm, fused_add_rms_norm, moe_combine_residual_rms_norm): the norm's launches, with
the extra template parameter, kernel-name part and arguments (templates/include/norm_quant.cuh); and the
readers' side: where they take those rows instead of their own quantiser launch, and the arguments that
bind them.

int8 rows (Tuning.linear.norm_int8; linear_skinny, gemm_int8, the int experts read them at every T): the
norm writes them at every T.  FP8 rows (Tuning.linear.norm_fp8; gemm_fp8 and the grouped experts' FP8 x FP8
gate_up, which run only above a token count): the norm runs its plain launch below the first T at which a
reader runs FP8 x FP8 (its family's `fp8x_from`) and its "qf8" launch from there, so no step writes rows
nobody reads.

Not a family (the leading underscore): what the norm families and the readers share.
"""
from __future__ import annotations

from typing import Callable

from codegen.errors import LoweringError
from codegen.kernel import KernelLaunch, inp, out, work
from codegen.sizes import only_above, only_below
from ir.formats import FP8_BLOCK, cdiv
from ir.formats_int import qrow
from ir.graph import value_producers
from ir.passes.norm_rows import quant_rows, row_names
from ir.passes.rewrite import readers_of

# make(params, kernel-name parts, arguments, grid factor or None: every T) -> the norm's launch
Make = Callable[[dict, list, tuple, "str | None"], KernelLaunch]


def launches(G, nid: str, opts, n: int, make: Make) -> list[KernelLaunch]:
    """The norm node `nid`'s launches (rows of n elements), built by `make` from the extra parameters,
    name parts and arguments of its quantised rows (none for the plain launch) and a grid factor."""
    quant = G.nodes[nid]["attrs"].get("quant")
    if quant != "fp8":
        return [make(*extras(G, nid, opts, n), None)]
    rows = _fp8_extras(G, nid, opts, n)
    lo = fp8_from(G, nid, opts)
    if lo is None:        # no reader multiplies FP8 x FP8 here (no sm_90a, the knob off): the rows stay unwritten
        return [make({}, [], (), None)]
    if lo <= 1:
        return [make(*rows, None)]
    return [make({}, [], (), only_below(lo - 1)), make(*rows, only_above(lo - 1))]


def grid(factor: str | None) -> str:
    """A norm launch's grid: a CTA a token, times its token-range factor (None: every T)."""
    return "T" if factor is None else f"T * {factor}"


def writes_rows(launch) -> bool:
    """Whether a norm's launch also writes quantised rows (its "qi8" / "qf8" variant)."""
    return "quant_i8" in launch.params or "quant_f8" in launch.params


def extras(G, nid: str, opts, n: int) -> tuple[dict, list[str], tuple]:
    """(params, kernel-name parts, arguments) the norm node `nid` (rows of n elements) adds for its
    int8 rows: none where it has none; "quant_i8" (the padded row's bytes), written to the values hq (int8
    rows, qrow(n) bytes apart) and hs (a float32 scale a token)."""
    data = G.nodes[nid]
    quant = data["attrs"].get("quant")
    if quant is None:
        return {}, [], ()
    if quant != "int8":
        raise LoweringError(f"a norm writes int8 or fp8 rows for its readers, not {quant!r} ones")
    _sixteen_bit(opts, quant)
    q, s = row_names(data["outputs"][0], quant)
    return {"quant_i8": {"qrow": qrow(n)}}, ["qi8"], (out("hq", "signed char", q), out("hs", "float", s))


def _fp8_extras(G, nid: str, opts, n: int) -> tuple[dict, list[str], tuple]:
    """The same for e4m3 rows: "quant_f8" (kb: the scales a row), written to the values hq (n e4m3 bytes a
    token) and hs (ceil(n / 128) float32 scales a token)."""
    _sixteen_bit(opts, "fp8")
    if n % 16:
        raise LoweringError(f"a norm's fp8 rows are whole 16-byte chunks; its width {n} is not a multiple of 16")
    q, s = row_names(G.nodes[nid]["outputs"][0], "fp8")
    return {"quant_f8": {"kb": cdiv(n, FP8_BLOCK)}}, ["qf8"], (out("hq", "unsigned char", q), out("hs", "float", s))


def _sixteen_bit(opts, quant: str) -> None:
    if opts.dtype not in ("bf16", "fp16"):
        raise LoweringError(f"a norm's {quant} rows need bf16 or fp16 activations, not {opts.dtype}")


def fp8_from(G, nid: str, opts) -> int | None:
    """The first token count at which a reader of norm `nid`'s output multiplies it FP8 x FP8 and reads the
    norm's rows there (its family's `fp8x_from(node, G, opts)`: gemm_fp8's row of the linear table, the
    grouped experts' wgmma_fp8 row), None: none does or the options do not read them.  The same for
    mla_v_up's rows (ir/passes/fuse_v_up_fp8_quant.py): `nid` may be any node that writes "fp8" rows."""
    from codegen.families import family_for_op
    if not _fp8_rows_on(G, nid, opts):
        return None
    h = G.nodes[nid]["outputs"][0]
    firsts = []
    for r in readers_of(G, nid, h):
        data = G.nodes[r]
        first = getattr(family_for_op(data["op"]), "fp8x_from", None)
        if first is not None and data["inputs"][0] == h:
            firsts.append(first(r, G, opts))
    return min((f for f in firsts if f is not None), default=None)


def int8_rows(G, x: str, opts) -> tuple[str, str] | None:
    """(rows, scales): the int8 rows of x and their per-token scales where the norm that makes x writes
    them and the options read them (Tuning.linear.norm_int8), else None (the reader quantises x itself)."""
    return quant_rows(G, x, "int8") if opts.tuning.linear.norm_int8 else None


def fp8_rows(G, x: str, opts) -> tuple[str, str] | None:
    """(rows, scales): x's e4m3 rows and per-128-column scales where the node that makes x writes them (a norm,
    or mla_v_up) and the options read them (Tuning.linear.norm_fp8, v_up_fp8), else None.  The maker writes
    them from fp8_from's T on, the first T of its readers' FP8 x FP8 launches, so a reader binds them over
    exactly its own range."""
    rows = quant_rows(G, x, "fp8")
    return rows if rows and _fp8_rows_on(G, value_producers(G)[x], opts) else None


def _fp8_rows_on(G, nid: str, opts) -> bool:
    """Whether node `nid`'s e4m3 rows are written and read under `opts`: a norm's with Tuning.linear.norm_fp8,
    mla_v_up's where its family writes them (mla_v_up.writes_fp8_rows: the knob and its tiling)."""
    if G.nodes[nid]["op"] == "mla_v_up":
        from . import mla_v_up
        return mla_v_up.writes_fp8_rows(G, nid, opts)
    return opts.tuning.linear.norm_fp8


def x_args(normed: tuple[str, str] | None, q_ws: str, s_ws: str, q_ctype: str = "signed char") -> tuple:
    """A reader's arguments xq, xs: the norm's rows and scales where `normed` names them (int8_rows,
    fp8_rows), else its own workspaces q_ws, s_ws (the same C types either way, so the reader's kernel is
    the same)."""
    if normed:
        return inp("xq", q_ctype, normed[0]), inp("xs", "float", normed[1])
    return work("xq", q_ctype, q_ws, writes=False), work("xs", "float", s_ws, writes=False)
