"""The grouped expert GEMMs with FP8 weights and FP8 activations at prefill
(templates/include/moe_gemm_fp8.cuh): the "wgmma_fp8" row of codegen/dispatch.py's grouped_experts
table, above decode's range, where _moe_wgmma serves 16-bit weights.  Two launches a node:

    quant_x     the node's input (gate_up: x [T, D]; down: a [NP, M]) -> e4m3 rows and fp32 scales per
                row per 128 columns (templates/include/quant_fp8.cuh: gemm_fp8's quantiser kernel, the
                same one the FP8 linears run), into the node's workspaces.  gate_up quantises each token
                once for its K pairs; down each pair's SwiGLU output.
    wgmma_fp8   the persistent grouped GEMM: the quantised rows gathered by the routing's order, the
                FP8 weights by TMA ([64 rows x 128 bytes] boxes, 128B swizzle), e4m3 x e4m3 wgmma, fp32
                promotion per 128-K block with the row's and the weight block's scales.

With Tuning.moe.fp8_multicast, above decode's range (the table's wgmma_fp8_mc row) the GEMM runs on clusters
of two CTAs, two row tiles of one expert an item, each CTA multicasting half of a stage's weight boxes to both
(moe_gemm_fp8.cuh MC); decode's sizes keep the plain launch.

With Tuning.linear.norm_fp8, where the RMSNorm that makes gate / up's x writes x's e4m3 rows and scales
(ir/passes/fuse_norm_fp8_quant.py), gate / up's GEMM reads those and has no quantiser launch.

Not a family (the leading underscore): a launch builder for _moe_grouped.py.  It serves where the
target offers sm_90a, the activations are 16-bit, KD % 16 == 0 and Tuning.moe.fp8_activations is on
(the e4m3 activations are a numerics choice: off, the weight-only FP8 kernel serves every T).
"""
from __future__ import annotations

from codegen.kernel import Arg, KernelLaunch, SizeRef, TensorMapRef, Workspace, size, tensor_map, work
from codegen.render import kernel_name
from codegen.sizes import token_ranges
from ir.formats import FP8_BLOCK, cdiv

from . import _norm_quant, gemm_fp8
from ._moe import when
from .mla_decode_attention import smem_limit

VARIANT = "wgmma_fp8"          # the GEMM launch's stage and kernel-name part
MC_VARIANT = "wgmma_fp8_mc"    # the table's row of the multicast GEMM (Tuning.moe.fp8_multicast; stage VARIANT)
VARIANTS = (VARIANT, MC_VARIANT)
CLUSTER = 2                    # CTAs of a multicast cluster (moe_gemm_fp8.cuh MC: __cluster_dims__(2, 1, 1))
NAME = "wfp8_afp8"             # the kernel-name part of FP8 weights x FP8 activations
QUANT_STAGE = "quant_x"        # the quantiser launch's stage (gemm_fp8's)
FEATURE = gemm_fp8.FEATURE
BM, BN, BK, BOX = gemm_fp8.BM, gemm_fp8.BN, gemm_fp8.BK, gemm_fp8.BOX   # moe_gemm_fp8.cuh takes gemm_fp8.cuh's tile
THREADS = gemm_fp8.THREADS
STAGES = gemm_fp8.STAGES
# The node's workspaces: its input quantised (4 e4m3 bytes a word) and the scales; gate_up's and
# down's differ by name, since moe_expert_ffn's node runs both.
WORKSPACES = {False: ("moe_xq", "moe_xs"), True: ("moe_aq", "moe_as")}


def row_variant(launch) -> str:
    """The table row behind a launch of the grouped families: the multicast GEMM's (its stage is VARIANT's), else
    the launch's stage."""
    return MC_VARIANT if launch.stage == VARIANT and launch.params.get("multicast") else launch.stage


def smem(stages: int = STAGES) -> int:
    """moe_gemm_fp8.cuh fp8x_smem: gemm_fp8.cuh's ring, staging and alignment slack."""
    return gemm_fp8.smem(stages)


def static_smem(E: int) -> int:
    """The __shared__ arrays: the ring's barriers and the row-tile table."""
    return 2 * STAGES * 8 + 4 * (E + 1)


def fits(opts, E: int) -> bool:
    """Its ring, staging and tables fit a CTA's shared memory on the target (sm_90: up to ~480 experts)."""
    return smem() + static_smem(E) <= smem_limit(opts.arch)


def facts(opts, p: dict) -> dict:
    """The conditions of the grouped_experts table's FP8 x FP8 row."""
    return {"fp8_activations": opts.tuning.moe.fp8_activations, "fp8x_fits": fits(opts, p["E"])}


def cols(*, down: bool) -> int:
    """Output columns a tile (moe_gemm_fp8.cuh fp8x_tile_cols)."""
    return BN if down else BN // 2


def take_norm_rows(G, x: str, opts, p: dict) -> None:
    """p["x_f8"]: the e4m3 rows of the experts' input x and their scales where the norm that makes x writes
    them (_norm_quant.fp8_rows; FP8 weights only): gate / up's FP8 x FP8 GEMM reads them, no quantiser."""
    rows = _norm_quant.fp8_rows(G, x, opts) if p.get("fp8") else None
    if rows:
        p["x_f8"] = rows


def launches(family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple, opts, *, down: bool,
             ranges: list, mc_ranges: list = ()) -> list[KernelLaunch]:
    """The quantiser's launch over the node's input (args[0]: x or a), then the grouped FP8 GEMM over the
    rest of `args` (the FP8 weights' tensor maps re-boxed for 128-byte rows, their scales, order, offsets,
    the outputs): the plain GEMM over the token ranges `ranges` (the table's wgmma_fp8 row), the multicast
    one (clusters of two, Tuning.moe.fp8_multicast: parameter `multicast`, name part mc) over `mc_ranges`
    (its wgmma_fp8_mc row), the quantiser over both; each grid multiplied by its ranges' factor.  gate / up's
    GEMM alone where p["x_f8"] holds its input's e4m3 rows (take_norm_rows).  Tuning.moe.fp8_overlap: the GEMM's
    consumers promote each K block under the next block's wgmma (parameter `overlap`, name part ovl)."""
    act, KD, KB = p["act"], p["KD"], cdiv(p["KD"], FP8_BLOCK)
    q_ws, s_ws = WORKSPACES[down]
    rows = "NP" if down else "T"
    ws = (Workspace(q_ws, (rows, KD // 4), "i32"), Workspace(s_ws, (rows, KB), "f32"))
    src = args[0]
    run = token_ranges([*ranges, *mc_ranges])
    quant = KernelLaunch(
        family=gemm_fp8.FAMILY, template=gemm_fp8.TEMPLATE,
        name=kernel_name(gemm_fp8.FAMILY, [name_parts[0], f"k{KD}", "quant_x"]),
        params={"variant": "quant", "act": act, "K": KD, "KB": KB, "warps": gemm_fp8.QUANT_WARPS,
                "group": FP8_BLOCK},
        nodes=(nid,), grid=(when(f"cdiv({rows} * {KB}, {gemm_fp8.QUANT_WARPS})", run), 1, 1),
        block=(gemm_fp8.QUANT_WARPS * 32, 1, 1),
        # the MoE families take dense inputs (_moe.require_dense): a row is KD elements apart
        args=(Arg("x", src.ctype, src.ref), Arg("x_stride", "i64", SizeRef(str(KD))), work("xq", "int", q_ws),
              work("xs", "float", s_ws), size("T", rows)),
        workspace=ws, stage=QUANT_STAGE)
    rest = tuple(tensor_map(a.name, a.ref.weight, (BOX, BK)) if isinstance(a.ref, TensorMapRef) else a
                 for a in args[1:])
    normed = None if down else p.get("x_f8")
    gemm_args = (*_norm_quant.x_args(normed, q_ws, s_ws, "int"), *rest)
    gemms = [_gemm(family, template, name_parts, p, nid, gemm_args, opts, down=down, multicast=mc,
                   workspace=() if normed else ws, run=token_ranges(part))
             for mc, part in ((False, ranges), (True, mc_ranges)) if part]
    return gemms if normed else [quant, *gemms]


def _gemm(family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple, opts, *, down: bool,
          multicast: bool, workspace: tuple, run: str | None) -> KernelLaunch:
    """The grouped FP8 GEMM's launch: a persistent grid of one CTA an SM, or (multicast) of clusters of two
    over items of two row tiles -- an even grid, 2 * floor(SMS / 2) CTAs at most."""
    c = cols(down=down)
    overlap = opts.tuning.moe.fp8_overlap
    if multicast:   # bound: one partial item (two row tiles) per expert
        grid = f"{CLUSTER} * min(SMS // {CLUSTER}, {cdiv(p['N'], c)} * (NP // {CLUSTER * BM} + min({p['E']}, NP)))"
    else:           # bound: one partial row tile per expert
        grid = f"min(SMS, {cdiv(p['N'], c)} * (NP // {BM} + min({p['E']}, NP)))"
    # (off, the parameters, and so the source, are as they were without the knobs)
    params = {"act": p["act"], "E": p["E"], "N": p["N"], "KD": p["KD"], "K": p["K"], "variant": VARIANT,
              "threads": THREADS, "stages": STAGES, "smem": smem(), "cols": c, "box_rows": BOX, "box_k": BK, "bm": BM,
              **({"overlap": True} if overlap else {}), **({"multicast": True} if multicast else {})}
    return KernelLaunch(
        family=family, template=template, name=kernel_name(family, [f"{name_parts[0]}_{NAME}", *name_parts[1:],
                                                                   *(["ovl"] * overlap), *(["mc"] * multicast),
                                                                   VARIANT]),
        params=params, nodes=(nid,), grid=(when(grid, run), 1, 1), block=(THREADS, 1, 1),
        args=args, smem=smem(), workspace=workspace, stage=VARIANT, requires=(FEATURE,))
