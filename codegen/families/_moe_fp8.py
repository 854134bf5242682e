"""The grouped expert GEMMs with FP8 weights (fp8_e4m3_block128; templates/include/moe_fp8.cuh):
decode's wgmma + TMA tiles of _moe_wgmma_skinny with the weights' bytes halved.  The FP8 bytes
come as TMA tensor maps of 64-row x 64-byte boxes (64B swizzle), each weight's block scales
("<weight>_scale_inv", float32 [E, ceil(N / 128), ceil(KD / 128)]) as a pointer beside it.

Not a family (the leading underscore): the launch builder of the "wgmma_skinny_fp8" row of
codegen/dispatch.py's grouped_experts table (moe_gate_up_silu, moe_gate_up, moe_down; moe_expert_ffn
runs them as its two launches).  It serves where the target offers sm_90a, the activations are
16-bit and KD % 16 == 0 (the FP8 rows' TMA stride); elsewhere an FP8 expert node is a
LoweringError (`check`).
"""
from __future__ import annotations

from codegen.errors import LoweringError
from codegen.kernel import KernelLaunch, size, tensor_map, weight
from ir.formats import FP8, companion_names, weight_format

from . import _moe_wgmma, _moe_wgmma_skinny as S
from ._moe import when

VARIANT = "wgmma_skinny_fp8"   # the launch's stage and kernel-name part
NAME = "wfp8"                  # the kernel-name part of FP8 weights (as linear_skinny's)
BP = 32                        # pairs a row tile (moe_fp8.cuh WF_BP)
BOX, BK = S.BOX, S.BK          # 64 rows x 64 K (bytes) a box
SWIZZLE = 64                   # an FP8 box row is 64 bytes
STAGES = 8                     # 8 x 12 KB in flight a CTA, two CTAs an SM
# Down at one token (Tuning.moe.fp8_one_token_down): a launch of its own, one CTA an SM, as the bf16
# one-token launch (_moe_wgmma_skinny), with a ring that holds as many weight bytes as that one's
# (one_token_stages): twice the slices in flight a CTA, and twice its first tile's issued before the wait.
ONE_TOKEN_VARIANT = f"{VARIANT}_t1"    # its stage and kernel-name part


def smem(stages: int = STAGES) -> int:
    """The ring (128 x 64 FP8 weight bytes + 32 pair rows of 128 bytes a stage) and 1 KB of slack
    (moe_fp8.cuh wgmma_fp8_smem)."""
    return stages * (S.ROWS * BK + BP * BK * 2) + 1024


def fits(E: int, stages: int = STAGES, ctas: int = 2) -> bool:
    """`ctas` CTAs of this ring and its tables fit an SM's shared memory."""
    return ctas * (smem(stages) + 2 * stages * 8 + 4 * (E + 1) + 1024) <= S.SM_SHARED


def one_token_stages(tuning) -> int:
    """Down's one-token ring: the weight bytes of the bf16 one-token ring (moe.one_token_down_stages
    stages of 128 rows x 64 bf16) in FP8 stages (128 rows x 64 bytes).  Its shared memory is the bf16
    ring's and its tables are smaller (no shared tile's pairs), so the table's one_token fact
    (_moe_wgmma_skinny.fits at one CTA an SM) says whether it fits too."""
    return tuning.moe.one_token_down_stages * (S.ROWS * S.BK * 2) // (S.ROWS * BK)


def is_fp8(G, nid: str, roles, opts) -> bool:
    """Whether the node's expert weights (`roles` of its bound weights) are FP8: all or none."""
    bound = G.nodes[nid]["weights"]
    fmts = {weight_format(G, bound[r], opts.dtype).name for r in roles}
    if FP8.name not in fmts:
        return False
    if fmts != {FP8.name}:
        raise LoweringError(f"{G.nodes[nid]['op']} {nid}: expert weights all in {opts.dtype} or all in {FP8.name}, "
                            f"got {', '.join(sorted(fmts))}")
    return True


def facts(opts, p: dict) -> dict:
    """The FP8 case's conditions of the grouped_experts table."""
    from codegen.arch import has_feature
    return {"fp8_rows": p["KD"] % 16 == 0, "fp8_fits": fits(p["E"]),
            "sm_90a": has_feature(opts.arch, _moe_wgmma.FEATURE)}


def check(nid: str, opts, p: dict) -> None:
    """A LoweringError where no FP8 expert kernel serves the node."""
    f = facts(opts, p)
    why = [w for w, bad in (("an sm_90a target", not f["sm_90a"]), ("bf16 or fp16 activations", opts.dtype not in
                            ("bf16", "fp16")), (f"an inner width that is a multiple of 16 (got {p['KD']})",
                            not f["fp8_rows"]), (f"shared memory for {p['E']} experts", not f["fp8_fits"])) if bad]
    if why:
        raise LoweringError(f"node {nid}: {FP8.name} expert weights need {' and '.join(why)}")


def args(weights: dict, act: str, fp8: bool) -> tuple:
    """The weight operands of `weights` (argument name -> bound weight name): with `fp8`, each as a tensor
    map, then each one's scales (s_<suffix of the name>: w_gate -> s_gate, w -> s); else each in `act`."""
    if not fp8:
        return tuple(weight(a, act, b) for a, b in weights.items())
    maps = tuple(tensor_map(a, b, (BOX, BK), SWIZZLE) for a, b in weights.items())
    scales = tuple(weight("s" + a[1:], "float", companion_names(b, FP8)[0]) for a, b in weights.items())
    return maps + scales


def launch(family: str, template: str, name_parts: list, p: dict, nid: str, args_: tuple, opts, *, down: bool,
           run: str | None, one_token: bool = False, shared: int = 0) -> KernelLaunch:
    """The FP8 launch over the family's operands (the FP8 ones from `args`); `run`: its token-range
    factor; `one_token`: down's one-token launch (one CTA an SM, the deeper ring); `shared`: the
    routing's shared experts, whose first tile gate / up runs before its wait where
    Tuning.moe.fp8_shared_before_wait is on (the kernel then takes NP for T; name part sh{S}w);
    Tuning.moe.fp8_widen_ahead: the consumer's widen-ahead tiles (name part wa)."""
    from codegen.render import kernel_name
    cols = S.cols(down=down)
    tiles = f"{S.col_tiles(p['N'], down=down)} * (NP // {BP} + min({p['E']}, NP))"
    variant = ONE_TOKEN_VARIANT if one_token else VARIANT
    stages = one_token_stages(opts.tuning) if one_token else STAGES
    sh = shared if not down and opts.tuning.moe.fp8_shared_before_wait else 0
    if sh:
        args_ = (*args_, size("num_pairs", "NP"))
    ahead = opts.tuning.moe.fp8_widen_ahead
    # (knobs that are off leave the parameters, and so the source, as they were without them)
    params = {"act": p["act"], "E": p["E"], "N": p["N"], "KD": p["KD"], "K": p["K"], "variant": variant,
              "threads": S.THREADS, "stages": stages, "smem": smem(stages), "cols": cols, "box_rows": BOX,
              "box_k": BK, "pairs": BP, **({"shared": sh} if sh else {}), **({"ahead": True} if ahead else {})}
    grid = when(f"min(SMS, {tiles})" if one_token else f"min(2 * SMS, {tiles})", run)
    names = [f"{name_parts[0]}_{NAME}", *name_parts[1:], *([f"sh{sh}w"] if sh else []), *(["wa"] * ahead), variant]
    return KernelLaunch(
        family=family, template=template, name=kernel_name(family, names), params=params,
        nodes=(nid,), grid=(grid, 1, 1), block=(S.THREADS, 1, 1), args=args_, smem=smem(stages), stage=variant,
        requires=(S.FEATURE,))
