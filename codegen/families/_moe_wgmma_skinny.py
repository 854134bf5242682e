"""Decode's grouped expert GEMM on Hopper's wgmma + TMA (templates/include/moe_wgmma_skinny.cuh) as
the launch of the grouped expert families (moe_gate_up_silu, moe_gate_up, moe_down) up to the
prefill wgmma's tokens: decode, where an expert has 1 to ~40 pairs.

Not a family (the leading underscore).  `take_over` gets the family's launches (GEMV, mma[,
wgmma]) and, where the variant applies and `_moe.GEMM_WGMMA_SKINNY` is on, hands every T in
(FROM_TOKENS, upper()] to a persistent launch over the same operands, the weights as TMA tensor
maps of 64-row boxes:

    T <= FROM_TOKENS                   the GEMV                 (left out while FROM_TOKENS is 0)
    FROM_TOKENS < T <= upper()         wgmma_skinny: grid min(2 SMS, tile bound), 256 threads
    T > upper()                        the prefill wgmma where it applies, else the mma launch

A launch that then never runs is left out (the GEMV at FROM_TOKENS 0; the mma launch where the
prefill wgmma takes every T above upper()).  It applies where the prefill wgmma's conditions hold
(an sm_90a target, 16-bit activations, KD % 8 == 0) and two CTAs' shared memory fit an SM;
elsewhere (fp32, odd KD) the GEMV and the mma launch serve decode as before.

FROM_TOKENS 0, measured on the H200 (PERF_NOTES v13, tests/gpu/perf_moe.py, V2-Lite, gate_up_silu
+ down a layer): decode b=1 30.0 us against the GEMV's 34.2, b=8 165.2 against 172.6; b=32 262.6
against the mma launch's 308.9, b=128 271.0 against 302.9.
"""
from __future__ import annotations

import dataclasses

from codegen.arch import has_feature
from codegen.kernel import KernelLaunch, size
from codegen.sizes import only_above, only_below

from . import _moe, _moe_wgmma
from ._moe import gemv_grid

FEATURE = _moe_wgmma.FEATURE
BP, ROWS, BOX, BK = 64, 128, 64, 64   # pairs, weight rows per tile; rows per TMA box; K a stage (moe_wgmma_skinny.cuh WS_*)
THREADS = 256                          # a producer warpgroup and a consumer warpgroup
STAGES = 4                             # 4 x 24 KB in flight per CTA, two CTAs per SM
SM_SHARED = 228 * 1024                 # an H100 / H200 SM's shared memory (each CTA also reserves 1 KB)
UPPER_WITHOUT_PREFILL_WGMMA = 256      # its range's top where the prefill wgmma is off
FROM_TOKENS = 0                        # the GEMV keeps T <= this (0: none; see above)
# Tiles of at least this many pairs store their outputs through shared memory in 16-byte chunks
# (moe_wgmma_skinny.cuh, DSG_WS_STAGED_FROM_BP, rendered into each kernel that includes it); 0:
# every tile stores element by element.  0 for these two launches (decode's 1-3 tokens, where the
# tiles are of 1-3 pairs): on from 32 they read 3% slower at b=1 (PERF_NOTES v22).  The fused
# launch has its own (moe_expert_ffn.STAGED_FROM_BP).
STAGED_FROM_BP = 0
# Gate / up with the shared experts among the pairs (moe_route's shared_experts S): those experts
# are 0..S-1 and every token's, so the walk's first S * cdiv(T, BP) * col_tiles row tiles are known
# from T alone, and a CTA whose first tile is one of them starts its first STAGES weight slices
# before its wait, while the route still runs (moe_wgmma_skinny.cuh SH; the kernel takes the pair
# count NP for T).  False: every gate / up CTA waits before its first read, as before.
SHARED_BEFORE_WAIT = True
# ... and runs that first shared tile's whole K loop before its wait (its pairs' rows gathered too;
# its outputs stored after the wait: moe_wgmma_skinny.cuh SH_WHOLE), so the shared experts' weights
# stream while the route runs, not only their first STAGES slices (PERF_NOTES v28: b=1 -0.025 to
# -0.03 ms a step).  False: only those slices.
SHARED_WHOLE_BEFORE_WAIT = True
# Down at one token (decode's b = 1) as a launch of its own with this many ring stages, one CTA an
# SM (min(SMS, tiles) CTAs; V2-Lite's 8 pairs make 128 tiles): twice the weight slices in flight a
# CTA, and twice the slices of its first tile issued before its wait (down's early start, into
# gate_up_silu's tail).  Measured on the H200 (PERF_NOTES v27): b=1 ctx=512 2.07-2.11 -> 2.01-2.04
# ms a step.  From 2 tokens the two-CTA launch stays (V2-Lite: 256+ tiles).  V2 / V3 get it too,
# unmeasured (320 / 504 tiles at one token: each CTA walks 2-4, the same bytes in flight an SM).
# 0 (or STAGES): no such launch.
ONE_TOKEN_DOWN_STAGES = 8
ONE_TOKEN_STAGE = "wgmma_skinny_t1"     # the launch's stage and kernel-name part


def switch_names(staged: int) -> list:
    """The kernel-name part of the staged epilogue where it is on: its code differs, so its own name."""
    return [f"st{staged}"] * bool(staged)


def smem(stages: int) -> int:
    """The ring and 1 KB of slack to start it on a 1024-byte boundary (wgmma_skinny_smem)."""
    return stages * (ROWS + BP) * BK * 2 + 1024


def static_smem(E: int, stages: int = STAGES) -> int:
    """The full / empty barriers, the row-tile table and a shared tile's pairs (moe_wgmma_skinny.cuh's
    __shared__; the last at most)."""
    return 2 * stages * 8 + 4 * (E + 1) + 4 * BP


def applies(opts, p: dict) -> bool:
    return (_moe.GEMM_WGMMA_SKINNY and has_feature(opts.arch, FEATURE) and opts.dtype in ("bf16", "fp16")
            and p["KD"] % 8 == 0 and 2 * (smem(STAGES) + static_smem(p["E"]) + 1024) <= SM_SHARED)


def upper() -> int:
    """Tokens up to which this launch runs: the prefill wgmma's threshold where that is on."""
    return _moe_wgmma.threshold() if _moe.GEMM_WGMMA_TOKENS is not None else UPPER_WITHOUT_PREFILL_WGMMA


def cols(*, down: bool) -> int:
    """Output columns a tile covers (wgmma_skinny_cols): down's 128 rows, or 64 gate + 64 up rows."""
    return ROWS if down else ROWS // 2


def col_tiles(n: int, *, down: bool) -> int:
    """Column tiles of n output columns (wgmma_skinny_col_tiles)."""
    return -(-n // cols(down=down))


def row_tiles(E: int) -> str:
    """The most row tiles NP pairs over E experts make: one partial tile per expert with pairs, the
    rest whole (moe_wgmma.cuh wgmma_row_tiles); an expression of NP."""
    return f"(NP // {BP} + min({E}, NP))"


def has_one_token_launch(p: dict, *, down: bool) -> bool:
    """Whether down gets its one-token launch (ONE_TOKEN_DOWN_STAGES): deeper than the ring of two
    CTAs an SM, one CTA's shared memory fits, and the range starts at one token (no GEMV below)."""
    st = ONE_TOKEN_DOWN_STAGES
    return (down and st > STAGES and FROM_TOKENS == 0
            and smem(st) + static_smem(p["E"], st) + 1024 <= SM_SHARED)


def grid(p: dict, *, down: bool, run: str | None = None, one_token: bool = False) -> str:
    """The launch's x extent: min(2 SMS, its tile bound) times `run`, the factor that is 1 at the T
    it runs at (default: (FROM_TOKENS, upper()]; moe_expert_ffn narrows it around its own window).
    Where down has its one-token launch, that launch (`one_token`: min(SMS, tiles), one CTA an SM)
    takes T = 1 of the range and this one the rest."""
    tiles = f"{col_tiles(p['N'], down=down)} * {row_tiles(p['E'])}"
    if run is None:
        run = only_below(upper()) if FROM_TOKENS == 0 else f"{only_above(FROM_TOKENS)} * {only_below(upper())}"
    if one_token:
        return f"min(SMS, {tiles}) * {run} * {only_below(1)}"
    split = f" * {only_above(1)}" if has_one_token_launch(p, down=down) else ""
    return f"min(2 * SMS, {tiles}) * {run}{split}"


def launch(family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple, *,
           down: bool, shared: int = 0, one_token: bool = False) -> KernelLaunch:
    """The launch; `shared`: the routing's shared experts, whose first slices gate / up starts before
    its wait (SHARED_BEFORE_WAIT; the kernel then takes NP for T); `one_token`: down's one-token launch
    (ONE_TOKEN_DOWN_STAGES)."""
    sh = 0 if down or not SHARED_BEFORE_WAIT else shared
    if sh:
        args = (*args, size("num_pairs", "NP"))
    whole = bool(sh) and SHARED_WHOLE_BEFORE_WAIT
    names = [*name_parts, *switch_names(STAGED_FROM_BP), *([f"sh{sh}" + "w" * whole] if sh else [])]
    extra = {} if down else {"shared": sh, "shared_whole": whole}
    stages = ONE_TOKEN_DOWN_STAGES if one_token else STAGES
    return _moe_wgmma.tma_launch(family, template, names, p, nid, args,
                                 variant=ONE_TOKEN_STAGE if one_token else "wgmma_skinny", box=(BOX, BK),
                                 threads=THREADS, stages=stages, smem_bytes=smem(stages), cols=cols(down=down),
                                 grid=grid(p, down=down, one_token=one_token), pairs=BP, staged_from=STAGED_FROM_BP,
                                 **extra)


def take_over(launches: list, family: str, template: str, name_parts: list, p: dict, nid: str, args: tuple,
              opts, *, down: bool, shared: int = 0) -> list:
    """`launches` (GEMV, mma[, wgmma]), with this launch taking (FROM_TOKENS, upper()] (down's
    one-token launch, where it has one, T = 1 of it)."""
    if not applies(opts, p) or upper() <= FROM_TOKENS:
        return launches
    out = []
    for la in launches:
        if la.stage == "gemv":
            if FROM_TOKENS > 0:
                out.append(dataclasses.replace(la, grid=gemv_grid(p, FROM_TOKENS)))
            out.append(launch(family, template, name_parts, p, nid, args, down=down, shared=shared))
            if has_one_token_launch(p, down=down):
                out.append(launch(family, template, name_parts, p, nid, args, down=down, one_token=True))
        elif la.stage == "mma":
            if not any(w.stage == "wgmma" for w in launches):   # else 0 below the prefill wgmma and 0 here
                out.append(dataclasses.replace(
                    la, grid=(la.grid[0], f"({la.grid[1]}) * {only_above(upper())}", la.grid[2])))
        else:
            out.append(la)
    return out
