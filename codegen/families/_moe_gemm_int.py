"""The grouped expert GEMMs with per-channel integer weights at prefill (templates/include/moe_gemm_int.cuh):
the "wgmma_int" row of codegen/dispatch.py's grouped_experts table, above Tuning.moe.int_wgmma_above (None:
off), where the target offers sm_90a.  Two launches a node, the FP8 x FP8 grouped GEMM's twin
(_moe_gemm_fp8.py):

    quant_i8    _moe_int's quantiser launch, unchanged: x's token rows (gate_up, one quantisation a token
                shared by its K pairs) or down's pair rows -> int8 per row and fp32 scales, into the node's
                workspaces (gate / up's GEMM alone where the norm writes x's int8 rows: _moe_int.take_norm_rows).
    wgmma_int   the persistent grouped GEMM: the int8 rows gathered by the routing's order, the weights by TMA
                ([64 rows x 128 bytes] boxes, 128B swizzle; int4_channel's packed rows unpacked to int8 in
                shared memory), s8 x s8 -> s32 wgmma over all of K, then moe_int.cuh's epilogue arithmetic:
                bit-equal to mma_int where both sums are exact (always: |acc| < KD * 2^14 < 2^31).

Formats: int4_channel (msModelSlim W4A8_DYNAMIC 1.0.0) and int8_channel (W8A8_DYNAMIC experts).  The others
keep mma_int (the table's reason): per-group int4 needs each 256-k group's sums promoted with its scale, and
int4_channel_byte has no checkpoint among the benchmarks of record.  Not a family (the leading underscore).
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, WeightRef, tensor_map
from codegen.render import kernel_name
from ir.formats import FORMATS, cdiv

from . import _moe_int, _norm_quant, gemm_int8
from ._moe import when
from .mla_decode_attention import smem_limit

VARIANT = "wgmma_int"          # the GEMM launch's stage and kernel-name part
SERVED = ("int4_channel", "int8_channel")
FEATURE = gemm_int8.FEATURE
BM, BN, BK, BOX = gemm_int8.BM, gemm_int8.BN, gemm_int8.BK, gemm_int8.BOX
THREADS = gemm_int8.THREADS
MAX_KD = gemm_int8.MAX_K      # exact int32 sums below it
# packed int4 stages carry 8 KB more (the packed boxes before unpacking): 4 x 40 KB + 32 KB of staging
STAGES = {1: gemm_int8.STAGES, 2: 4}


def unpack_bytes(pack: int) -> int:
    """moe_gemm_int.cuh iwg_unpack_bytes: a stage's packed staging."""
    return BOX * BK if pack == 2 else 0


def smem(pack: int) -> int:
    """moe_gemm_int.cuh iwg_smem: gemm_ring.cuh's ring, staging and slack, then the packed staging."""
    st = STAGES[pack]
    return gemm_int8.smem(st) + st * unpack_bytes(pack)


def static_smem(pack: int, E: int) -> int:
    """The __shared__ arrays: the ring's three barrier sets and the row-tile table."""
    return 3 * STAGES[pack] * 8 + 4 * (E + 1)


def cols(*, down: bool) -> int:
    """Output columns a tile (moe_gemm_int.cuh iwg_tile_cols)."""
    return BN if down else BN // 2


def facts(opts, p: dict) -> dict:
    """The conditions of the grouped_experts table's wgmma_int row: int_wgmma_rows (a served format, KD % 16 == 0
    for whole 16-byte chunks and tensor-map strides, KD < 2^17 for exact int32 sums, packed int4's N even) and
    int_wgmma_fits (the ring, staging and row-tile table in a CTA's shared memory)."""
    fmt = p.get("int")
    if fmt not in SERVED:
        return {"int_wgmma_rows": False, "int_wgmma_fits": False}
    pack = FORMATS[fmt].pack
    rows = p["KD"] % 16 == 0 and p["KD"] < MAX_KD and p["N"] % pack == 0
    return {"int_wgmma_rows": rows, "int_wgmma_fits": smem(pack) + static_smem(pack, p["E"]) <= smem_limit(opts.arch)}


def launches(family: str, name_parts: list, p: dict, nid: str, args: tuple, *, down: bool,
             run: str | None) -> list[KernelLaunch]:
    """The quantiser's launch over args[0] (x or a), then the grouped int8 wgmma GEMM over the rest of `args`
    (_moe_int.args' operands: the stored weights, here as tensor maps of [64 rows x 128 bytes] boxes -- packed
    int4's gate / up of 32 packed rows, the tile's 64 channels -- then the scales, order, offsets, out); both
    grids multiplied by `run`, the row's token-range factor."""
    f = FORMATS[p["int"]]
    KD, st = p["KD"], STAGES[f.pack]
    ws = _moe_int.workspaces(p, down=down)
    quant = _moe_int.quantiser(family, name_parts, p, nid, args[0], down=down, run=run)
    rows = BOX if f.pack == 1 or down else BOX // 2
    # the stored weights (w, w_gate, w_up: _moe_int.args) as tensor maps; their scales stay pointers
    rest = tuple(tensor_map(a.name, a.ref.name, (rows, BK)) if isinstance(a.ref, WeightRef) and a.name[0] == "w" else a
                 for a in args[1:])
    c = cols(down=down)
    tiles = f"{cdiv(p['N'], c)} * (NP // {BM} + min({p['E']}, NP))"   # bound: one partial row tile per expert
    params = {"act": p["act"], "E": p["E"], "N": p["N"], "KD": KD, "K": p["K"], "variant": VARIANT, "threads": THREADS,
              "stages": st, "smem": smem(f.pack), "cols": c, "box_k": BK, "bm": BM, "down": down, "wfmt": f.name,
              "pack": f.pack}
    normed = None if down else p.get("x_rows")
    gemm = KernelLaunch(
        family=family, template=_moe_int.TEMPLATE,
        name=kernel_name(family, [f"{name_parts[0]}_{_moe_int.TAGS[f.name]}", *name_parts[1:], VARIANT]),
        params=params, nodes=(nid,), grid=(when(f"min(SMS, {tiles})", run), 1, 1), block=(THREADS, 1, 1),
        args=(*_norm_quant.x_args(normed, ws[0].name, ws[1].name), *rest), smem=params["smem"],
        workspace=() if normed else ws, stage=VARIANT, requires=(FEATURE,))
    return [gemm] if normed else [quant, gemm]
