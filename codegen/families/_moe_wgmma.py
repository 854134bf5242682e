"""The grouped expert GEMM on Hopper's wgmma + TMA (templates/include/moe_wgmma.cuh): prefill's
~T*K/E pairs per expert, a persistent warp-specialised grid of 128 x 256 x 64 tiles over every
expert, 384 threads, the weights as TMA tensor maps.

Not a family (the leading underscore): a launch builder for _moe_grouped.py, which lowers the
rows of codegen/dispatch.py's grouped_experts table ("wgmma").  It serves where the target offers
sm_90a (codegen/arch.py: a bundle for sm_90 or sm_90a; the launch `requires` it, so that kernel
alone is built for sm_90a), the activations are 16-bit and KD % 8 == 0 (16-byte rows: TMA
strides, cp.async), and its shared memory fits (`fits`).
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, WeightRef, tensor_map

from ._moe import when
from .mla_decode_attention import smem_limit

FEATURE = "sm_90a"
BM, BN, BK = 128, 256, 64      # pairs, weight rows, K per tile and stage  (moe_wgmma.cuh WG_*)
BOX = 128                      # weight rows per TMA box (two boxes a stage)
THREADS = 384                  # a producer warpgroup and two consumer warpgroups
# Slices in flight: 4 x 48 KB = 192 KB of the 227 KB a CTA may have (one CTA per SM).
STAGES = 4
OUT_STAGING = 2 * 64 * 128 * 2  # each consumer warpgroup's 64 rows x 128 output columns (WG_OUT_BYTES)


def smem(stages: int) -> int:
    """The ring, the epilogue's staging, and 1 KB of slack to start the ring on a 1024-byte
    boundary (moe_wgmma.cuh wgmma_smem): 225 KB at 4 stages."""
    return stages * (BM + BN) * BK * 2 + OUT_STAGING + 1024


def static_smem(E: int) -> int:
    """moe_wgmma.cuh's __shared__ arrays: the full / empty barriers and the row-tile table."""
    return 2 * STAGES * 8 + 4 * (E + 1)


def fits(opts, E: int) -> bool:
    """Its ring and tables fit a CTA's shared memory on the target (sm_90: up to ~490 experts)."""
    return smem(STAGES) + static_smem(E) <= smem_limit(opts.arch)


def tma_launch(family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple, *, variant: str,
               box: tuple[int, int], threads: int, stages: int, smem_bytes: int, cols: int, grid: str,
               **extra) -> KernelLaunch:
    """A grouped-expert launch of a wgmma variant over the family's operands, each weight as a
    tensor map of `box` ([rows, K]) boxes (128-byte rows: the 128B swizzle wgmma reads); its name
    part and stage are `variant`, and it requires sm_90a.  Shared with _moe_wgmma_skinny."""
    from codegen.render import kernel_name
    targs = tuple(tensor_map(a.name, a.ref.name, box) if isinstance(a.ref, WeightRef) else a for a in args)
    params = {"act": p["act"], "E": p["E"], "N": p["N"], "KD": p["KD"], "K": p["K"], "variant": variant,
              "threads": threads, "stages": stages, "smem": smem_bytes, "cols": cols, "box_rows": box[0],
              "box_k": box[1], **extra}
    return KernelLaunch(
        family=family, template=template, name=kernel_name(family, [*name_parts, variant]), params=params,
        nodes=(nid,), grid=(grid, 1, 1), block=(threads, 1, 1), args=targs, smem=smem_bytes, stage=variant,
        requires=(FEATURE,))


def launch(family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple, *,
           down: bool, run: str | None) -> KernelLaunch:
    """The persistent wgmma launch over the family's operands, each weight as a tensor map of
    [BOX rows x BK] boxes; `run`: its token-range factor."""
    cols = BN if down else BN // 2                       # output columns per tile
    tiles = f"{-(-p['N'] // cols)} * (NP // {BM} + min({p['E']}, NP))"   # bound: one partial row tile per expert
    return tma_launch(family, template, name_parts, p, nid, args, variant="wgmma", box=(BOX, BK), threads=THREADS,
                      stages=STAGES, smem_bytes=smem(STAGES), cols=cols, grid=when(f"min(SMS, {tiles})", run))
