"""The grouped expert GEMM on Hopper's wgmma + TMA (templates/include/moe_wgmma.cuh) as the
launch of the grouped expert families (moe_gate_up_silu, moe_gate_up, moe_down) above
`_moe.GEMM_WGMMA_TOKENS` tokens: prefill's ~T*K/E pairs per expert.

Not a family (the leading underscore).  `take_over` gets the family's launches (GEMV, mma) and,
where the variant applies, hands every T above the threshold from the mma launch (its grid then
0) to a persistent wgmma launch over the same operands, the weights as TMA tensor maps:

    T <= GEMV_ONLY_TOKENS            the GEMV                              (unchanged)
    GEMV_ONLY_TOKENS < T <= threshold  the mma launch (light slots + tiles) (unchanged)
    T > threshold                    wgmma: grid min(SMS, tile bound), 384 threads, every expert

It applies where the target offers sm_90a (codegen/arch.py: a bundle for sm_90 or sm_90a; the
launch `requires` it, so that kernel alone is built for sm_90a), the activations are 16-bit and
KD % 8 == 0 (16-byte rows: TMA strides, cp.async); elsewhere the launches stay as they are.  Off
while GEMM_WGMMA_TOKENS is None.
"""
from __future__ import annotations

import dataclasses

from codegen.arch import has_feature
from codegen.kernel import KernelLaunch, WeightRef, tensor_map
from codegen.sizes import only_above, only_below

from . import _moe
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


def applies(opts, p: dict) -> bool:
    return (_moe.GEMM_WGMMA_TOKENS is not None and has_feature(opts.arch, FEATURE)
            and opts.dtype in ("bf16", "fp16") and p["KD"] % 8 == 0
            and smem(STAGES) + static_smem(p["E"]) <= smem_limit(opts.arch))   # sm_90: up to ~490 experts


def threshold() -> int:
    """Tokens above which the wgmma launch runs (never at or below the GEMV's)."""
    return max(_moe.GEMM_WGMMA_TOKENS, _moe.GEMV_ONLY_TOKENS)


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
           down: bool) -> KernelLaunch:
    """The persistent wgmma launch over the family's operands, each weight as a tensor map of
    [BOX rows x BK] boxes."""
    cols = BN if down else BN // 2                       # output columns per tile
    tiles = f"{-(-p['N'] // cols)} * (NP // {BM} + min({p['E']}, NP))"   # bound: one partial row tile per expert
    return tma_launch(family, template, name_parts, p, nid, args, variant="wgmma", box=(BOX, BK), threads=THREADS,
                      stages=STAGES, smem_bytes=smem(STAGES), cols=cols,
                      grid=f"min(SMS, {tiles}) * {only_above(threshold())}")


def take_over(launches: list, family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple,
              opts, *, down: bool) -> list:
    """`launches` (GEMV, mma), with the wgmma launch taking T above the threshold where it applies."""
    if not applies(opts, p):
        return launches
    *rest, mma = launches
    assert mma.stage == "mma", mma.stage
    below = dataclasses.replace(mma, grid=(mma.grid[0], f"({mma.grid[1]}) * {only_below(threshold())}",
                                           mma.grid[2]))
    return [*rest, below, launch(family, template, name_parts, p, nid, args, down=down)]
