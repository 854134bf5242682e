"""moe_expert_ffn: [x [T, D], routing] -> eo [NP, D] = (silu(x Wg[e]^T) * (x Wu[e]^T)) Wd[e]^T per
pair: decode's expert FFN (ir/passes/fuse_expert_ffn.py), one persistent launch where decode's
wgmma + TMA expert GEMM runs (templates/include/moe_expert_ffn.cuh), else the two grouped launches.

    FUSED_FROM <= T <= FUSED_UPTO, sm_90a, 16-bit,    "fused": gate_up_silu's tiles then down's, one grid
    D and M % 8 == 0
    otherwise                                          moe_gate_up_silu's launches, then moe_down's

Why a window, measured on the H200 (`dsgraph bench`, the two paths and v19's fixed walk side by
side in each of three runs, the same tokens routed; PERF_NOTES v20): with its tiles taken in
order from a counter the one launch makes decode steps 0.5-2% shorter than the two from 8 to 192
tokens and even to 0.5% shorter at 256; at 4 the two tie, and at 1 and 2 the one launch is 3-9%
slower (there the tiles are about one round; v19's fixed walk, tile b on CTA b, was the fastest at
1-4 tokens, why is open, and it is gone because it deadlocks where not all of its CTAs run at
once).  With PDL the two launches already
overlap (down starts its weights in gate_up_silu's tail), so the gain is packing: one walk of both
kernels' tiles, taken by whichever CTA is free, leaves fewer part-empty rounds than two.
To measure it again: `dsgraph bench --no-transformers --prefill none --decode 1x512,2x512,...,256x512`
from a script that sets FUSED = False in one process and FUSED_FROM, FUSED_UPTO = 1, 256 in
another, each with its own DSGRAPH_CACHE_DIR (the bundle cache's key sees the compiler's source,
not a constant changed at run time); the bench routes the same tokens in every run.

The intermediate a [NP, M] is a workspace ("expert_act") of the node: the fused launch writes and
reads it within the launch, the two-launch path passes it from one launch to the next.  The
two-launch path is the moe_gate_up_silu and moe_down families' own lowering (their kernel names,
so a prefill graph's unfused nodes and this node share those kernels), their decode wgmma
launches narrowed to the T outside the window.

The fused launch's grid is min(2 SMS, its tiles), two CTAs an SM; its CTAs take tiles in order
from a counter, so a down tile only ever waits for gate_up_silu tiles that running CTAs hold, and
the walk finishes whatever number of its CTAs the GPU runs at once (moe_expert_ffn.cuh).  Its
per-row-tile counters are a __device__ array of RT entries: the most row tiles a launch at the top
of decode's wgmma range (S.upper()) can have, whatever the window, so a kernel of one name is one
module.
"""
from __future__ import annotations

import dataclasses

from codegen.errors import LoweringError
from codegen.kernel import KernelLaunch, Options, Workspace, inp, out, tensor_map, weight, work
from codegen import sizes
from codegen.sizes import only_above, only_below

from . import _moe, _moe_wgmma_skinny, moe_down, moe_gate_up_silu

FAMILY = "moe_expert_ffn"
TEMPLATE = "moe_expert_ffn.cu.j2"
OPS = ("moe_expert_ffn",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)
WORKSPACE = "expert_act"
FUSED_FROM, FUSED_UPTO = 4, 256   # the tokens the fused launch serves (see above)

S = _moe_wgmma_skinny
THREADS = S.THREADS + 32   # + the publisher warp (moe_expert_ffn.cuh FFN_THREADS)
# The fused launch's tiles of at least this many pairs store through shared memory (the staged
# epilogue of moe_wgmma_skinny.cuh; 0: element stores).  Measured on the H200 (PERF_NOTES v22):
# the expert kernels at b=256 3.995 -> 4.02 TB/s, b=8-128 within noise; from 16 every batch lost.
STAGED_FROM_BP = 32
# gate_up_silu tiles of 128 columns (x gathered once for both halves) measured 2-3.5% slower (PERF_NOTES v24).


def row_tile_bound(E: int, pairs: int) -> int:
    """S.row_tiles(E) at NP = pairs."""
    return sizes.evaluate(S.row_tiles(E), {"NP": pairs})


def fused_launch(nid: str, opts: Options, gu: dict, dn: dict, args: tuple) -> KernelLaunch:
    from codegen.render import kernel_name
    E, K, M, D = gu["E"], gu["K"], gu["N"], dn["N"]
    nct = S.col_tiles(M, down=False) + S.col_tiles(D, down=True)   # a row tile's: gate_up_silu's + down's
    tiles = f"{nct} * {S.row_tiles(E)}"
    params = {"act": gu["act"], "E": E, "M": M, "D": D, "K": K, "variant": "fused", "threads": THREADS,
              "stages": S.STAGES, "smem": S.smem(S.STAGES), "box_rows": S.BOX, "box_k": S.BK, "pairs": S.BP,
              "staged_from": STAGED_FROM_BP,
              "row_tiles": row_tile_bound(E, S.upper() * K)}   # the window's widest: one module for any window
    return KernelLaunch(
        family=FAMILY, template=TEMPLATE,
        name=kernel_name(FAMILY, [opts.dtype, f"e{E}_k{K}", f"m{M}_d{D}", *S.switch_names(STAGED_FROM_BP), "fused"]),
        params=params, nodes=(nid,), grid=(f"min(2 * SMS, {tiles}) * {fused_range()}", 1, 1),
        block=(THREADS, 1, 1), args=args, smem=S.smem(S.STAGES), stage="fused", requires=(S.FEATURE,))


def upto() -> int:
    return min(FUSED_UPTO, S.upper())


def fused_range() -> str:
    """1 while FUSED_FROM <= T <= upto(), else 0."""
    return f"{only_above(FUSED_FROM - 1)} * {only_below(upto())}"


def two_launch_range() -> str:
    """Where decode's wgmma launches of the two families run instead: the rest of (0, S.upper()]."""
    return f"({only_below(FUSED_FROM - 1)} + {only_above(upto())} * {only_below(S.upper())})"


def around_window(launches: list, p: dict, *, down: bool) -> list:
    """A family's launches with its decode wgmma launch narrowed to the T outside the window."""
    return [dataclasses.replace(la, grid=(S.grid(p, down=down, run=two_launch_range(),
                                                 one_token=la.stage == S.ONE_TOKEN_STAGE), 1, 1))
            if la.stage in ("wgmma_skinny", S.ONE_TOKEN_STAGE) else la for la in launches]


def fused_applies(opts, gu: dict, dn: dict) -> bool:
    """Where decode's wgmma expert GEMM serves both halves (same conditions), one CTA more of
    static shared memory aside (the fused kernel's is the skinny kernel's)."""
    return S.applies(opts, gu) and S.applies(opts, dn)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, (x, routing), (y,), bound = _moe.node_io(G, nid)
    E, M, D = attrs["num_experts"], attrs["inner_dim"], attrs["out_dim"]
    if _moe.inner(G, nid, x) != D:
        raise LoweringError(f"moe_expert_ffn {nid}: x has width {_moe.inner(G, nid, x)}, its out_dim is {D}")
    K = _moe.pairs_top_k(G, nid, routing)
    _moe.require_dense(G, nid, x)
    gu = _moe.grouped_params(nid, opts, E=E, N=M, KD=D, K=K, rows_per_warp=moe_gate_up_silu.ROWS_PER_WARP)
    dn = _moe.grouped_params(nid, opts, E=E, N=D, KD=M, K=1, rows_per_warp=moe_down.ROWS_PER_WARP)
    act = gu["act"]
    ws = Workspace(WORKSPACE, ("NP", M), "act")
    order, offsets = inp("order", "i32", f"{routing}.order"), inp("offsets", "i32", f"{routing}.offsets")
    gu_args = (inp("x", act, x), weight("w_gate", act, bound["gate"]), weight("w_up", act, bound["up"]),
               order, offsets, work("out", act, WORKSPACE))
    dn_args = (work("a", act, WORKSPACE, writes=False), weight("w", act, bound["down"]), order, offsets,
               out("out", act, y))
    gu_launches = moe_gate_up_silu.launches(nid, gu, gu_args, opts, shared=_moe.routing_shared(G, routing))
    dn_launches = moe_down.launches(nid, dn, dn_args, opts)
    if fused_applies(opts, gu, dn):
        args = (inp("x", act, x), tensor_map("w_gate", bound["gate"], (S.BOX, S.BK)),
                tensor_map("w_up", bound["up"], (S.BOX, S.BK)), tensor_map("w_down", bound["down"], (S.BOX, S.BK)),
                order, offsets, work("a", act, WORKSPACE), out("out", act, y))
        gu_launches = [fused_launch(nid, opts, gu, dn, args), *around_window(gu_launches, gu, down=False)]
        dn_launches = around_window(dn_launches, dn, down=True)
    return [dataclasses.replace(la, workspace=(ws,)) for la in (*gu_launches, *dn_launches)]
