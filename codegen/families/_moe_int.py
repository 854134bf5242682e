"""The grouped expert GEMMs with msModelSlim's integer weights (templates/include/moe_int.cuh): packed
int4 (int4_channel, W4A8_DYNAMIC 1.0.0; int4_group256_packed, its older per-group form) and one value a
byte (int8_channel: W8A8_DYNAMIC experts; int4_channel_byte; int4_group256).  A quantiser launch
(quant_int8.cuh: the rows the experts read, int8 per row -- x's token rows for moe_gate_up_silu, one
quantisation a token shared by its pairs; the SwiGLU's pair rows for moe_down) into two workspaces,
then the grouped int x int8 mma.sync launch, exact against ir/formats_int.py's arithmetic (per group:
the group scales applied to each 64-k step's exact sums in float32, within ~2^-22 of the reference's
float64 sums).  Kernel names carry the format (TAGS); the template is moe_int.cu.j2 (the families'
roles: moe_gate_up_silu, moe_down).

Not a family (the leading underscore): the launch builder of the "mma_int" row of codegen/dispatch.py's
grouped_experts table (moe_gate_up_silu, moe_down; moe_expert_ffn runs them as its two launches).
int8_static experts (a per-tensor static activation scale) get the table's "none" row: one LoweringError
(`check`).
"""
from __future__ import annotations

import dataclasses

from codegen.errors import LoweringError
from codegen.kernel import KernelLaunch, Workspace, size, weight, work
from ir.formats import FORMATS, INT_FORMATS, companion_names, weight_format

from . import _norm_quant
from ._moe import slots, when

# The formats the kernel reads and their kernel-name parts (PACK 2: two int4 a byte along N; PACK 1: one
# value a byte; "g256": per-group second-stage scales).
TAGS = {"int4_channel": "wi4", "int4_group256_packed": "wi4g256", "int8_channel": "wi8",
        "int4_channel_byte": "wi4b", "int4_group256": "wi4bg256"}
SERVED = tuple(TAGS)
INT_NAMES = tuple(f.name for f in INT_FORMATS)
VARIANT = "mma_int"                # the launch's stage
QUANT_STAGE = "quant_i8"
QUANT_NAME = "qi8"
TEMPLATE = "moe_int.cu.j2"
THREADS = 128                      # moe_int.cuh WI4_THREADS
QUANT_THREADS = 256                # the quantiser's CTA (one a row)


def channels(*, down: bool) -> int:
    """Output channels a CTA covers (moe_int.cuh wi4_channels)."""
    return 32 if down else 16


def qrow(kd: int) -> int:
    """Bytes of a quantised row (quant_int8.cuh qrow: KD rounded up to 16)."""
    return -(-kd // 16) * 16


def int_format(G, nid: str, roles, opts) -> str | None:
    """The integer format of the node's expert weights (`roles` of its bound weights), or None where
    none is an integer format; a LoweringError where they mix formats."""
    bound = G.nodes[nid]["weights"]
    fmts = {weight_format(G, bound[r], opts.dtype).name for r in roles}
    if not fmts & set(INT_NAMES):
        return None
    if len(fmts) != 1:
        raise LoweringError(f"{G.nodes[nid]['op']} {nid}: expert weights all in one integer format, got "
                            f"{', '.join(sorted(fmts))}")
    return fmts.pop()


def check(nid: str, opts, p: dict) -> None:
    """A LoweringError where no int expert kernel serves the node (the table's "none" row)."""
    fmt = p["int"]
    if fmt not in SERVED:
        raise LoweringError(f"node {nid}: no cuda kernel for {fmt} expert weights (the grouped int kernel reads "
                            f"{', '.join(SERVED)}); run it with backend='reference'")
    if opts.dtype not in ("bf16", "fp16"):
        raise LoweringError(f"node {nid}: {fmt} expert weights need bf16 or fp16 activations, not {opts.dtype}")
    f = FORMATS[fmt]
    if p["N"] % f.pack:
        raise LoweringError(f"node {nid}: {fmt} packs two output channels a byte; {p['N']} do not pair")
    if f.group and p["KD"] % f.group:
        raise LoweringError(f"node {nid}: {fmt} groups {f.group} input channels; {p['KD']} do not divide")


def facts(opts, p: dict) -> dict:
    """The int case's conditions of the grouped_experts table."""
    if not p.get("int"):
        return {"int_rows": False}
    f = FORMATS[p["int"]]
    return {"int_rows": p["N"] % f.pack == 0 and (not f.group or p["KD"] % f.group == 0)}


def args(weights: dict, fmt: str) -> tuple:
    """The weight operands of `weights` (argument name -> bound weight name): each weight as bytes,
    then each one's per-channel scale (s_<suffix of the name>: w_gate -> s_gate, w -> s), then per group
    each one's second-stage scales (g_gate, g)."""
    f = FORMATS[fmt]
    second = (*(weight("g" + a[1:], "float", companion_names(b, f)[2]) for a, b in weights.items()),) \
        if f.group else ()
    return (*(weight(a, "signed char", b) for a, b in weights.items()),
            *(weight("s" + a[1:], "float", companion_names(b, f)[0]) for a, b in weights.items()), *second)


def take_norm_rows(G, x: str, opts, p: dict) -> None:
    """p["x_rows"]: the int8 rows of the experts' input x and their scales where the norm that makes x
    writes them (_norm_quant.int8_rows; integer weights only): gate / up read them, no quantiser launch."""
    rows = _norm_quant.int8_rows(G, x, opts) if p.get("int") else None
    if rows:
        p["x_rows"] = rows


def workspaces(p: dict, *, down: bool) -> tuple[Workspace, Workspace]:
    """The quantised rows the experts read (4 bytes a word) and their scales; names apart for gate_up_silu and
    down: moe_expert_ffn's two launches are one node's (one workspace set)."""
    q, s = ("aq_i8", "as_f32") if down else ("xq_i8", "xs_f32")
    rows = "NP" if down else "T"
    return Workspace(q, (rows, qrow(p["KD"]) // 4), "i32"), Workspace(s, (rows,), "f32")


def quantiser(family: str, name_parts: list, p: dict, nid: str, x, *, down: bool, run: str | None) -> KernelLaunch:
    """The launch quantising the rows the experts read (x's token rows, or down's pair rows `x`) per row into
    `workspaces`; `run`: its token-range factor.  The grouped int GEMMs (mma_int, _moe_gemm_int's wgmma_int)
    read them."""
    from codegen.render import kernel_name
    kd = p["KD"]
    ws = workspaces(p, down=down)
    rows = ws[1].shape[0]
    return KernelLaunch(
        family=family, template=TEMPLATE, name=kernel_name(family, [f"{name_parts[0]}_{QUANT_NAME}", f"k{kd}"]),
        params={"act": p["act"], "KD": kd, "qrow": qrow(kd), "threads": QUANT_THREADS, "variant": QUANT_STAGE},
        nodes=(nid,), grid=(when(rows, run), 1, 1), block=(QUANT_THREADS, 1, 1),
        args=(dataclasses.replace(x, name="x"), work("q", "signed char", ws[0].name),
              work("s", "float", ws[1].name), size("rows", rows)),
        workspace=ws, stage=QUANT_STAGE)


def launches(family: str, name_parts: list, p: dict, nid: str, args_: tuple, *, down: bool,
             run: str | None) -> list[KernelLaunch]:
    """The quantiser's launch and the grouped int launch over the family's operands (args_: the rows
    the experts read first, then the weights from `args`, order, offsets, out); `run`: their token-range
    factor.  The int launch alone where p["x_rows"] holds gate / up's quantised input (take_norm_rows)."""
    from codegen.render import kernel_name
    x, rest = args_[0], args_[1:]
    ws = workspaces(p, down=down)
    quant = quantiser(family, name_parts, p, nid, x, down=down, run=run)
    cols = channels(down=down)
    f = FORMATS[p["int"]]
    params = {"act": p["act"], "E": p["E"], "N": p["N"], "KD": p["KD"], "K": p["K"], "variant": VARIANT,
              "threads": THREADS, "channels": cols, "down": down, "wfmt": f.name, "pack": f.pack,
              "group": f.group or 0}
    normed = None if down else p.get("x_rows")
    x_args = _norm_quant.x_args(normed, ws[0].name, ws[1].name)
    gemm = KernelLaunch(
        family=family, template=TEMPLATE,
        name=kernel_name(family, [f"{name_parts[0]}_{TAGS[f.name]}", *name_parts[1:]]),
        params=params, nodes=(nid,), grid=(-(-p["N"] // cols), when(slots(p["E"]), run), 1),
        block=(THREADS, 1, 1), args=(*x_args, *rest), workspace=() if normed else ws, stage=VARIANT)
    return [gemm] if normed else [quant, gemm]
