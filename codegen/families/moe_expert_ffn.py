"""moe_expert_ffn: [x [T, D], routing] -> eo [NP, D] = (silu(x Wg[e]^T) * (x Wu[e]^T)) Wd[e]^T per
pair: decode's expert FFN (ir/passes/fuse_expert_ffn.py), one persistent launch where decode's
wgmma + TMA expert GEMM runs (templates/include/moe_expert_ffn.cuh), else the two grouped launches.
Which at which T is codegen/dispatch.py's expert_ffn table:

    expert_ffn_from <= T <= expert_ffn_upto, sm_90a,    "fused": gate_up_silu's tiles then down's, one grid
    16-bit, decode's wgmma serving both halves
    otherwise                                          moe_gate_up_silu's launches, then moe_down's

Why a window: with its tiles taken in order from a counter the one launch makes decode steps
0.5-2% shorter than the two from 8 to 192 tokens; at 1 and 2 tokens, where the tiles are about one
round, it is 3-9% slower (docs/PERF_NOTES.md).  With PDL the two launches already overlap (down
starts its weights in gate_up_silu's tail), so the gain is packing: one walk of both kernels'
tiles, taken by whichever CTA is free, leaves fewer part-empty rounds than two.  To measure it
again: `dsgraph bench --tune moe.expert_ffn_upto=0 ...` against the default, the same tokens routed.

The intermediate a [NP, M] is a workspace ("expert_act") of the node: the fused launch writes and
reads it within the launch, the two-launch path passes it from one launch to the next.  The
two-launch path is the moe_gate_up_silu and moe_down families' own lowering (their kernel names,
so a prefill graph's unfused nodes and this node share those kernels), limited to the T outside
the window.

The fused launch's grid is min(2 SMS, its tiles), two CTAs an SM; its CTAs take tiles in order
from a counter, so a down tile only ever waits for gate_up_silu tiles that running CTAs hold, and
the walk finishes whatever number of its CTAs the GPU runs at once (moe_expert_ffn.cuh).  Its
per-row-tile counters are a __device__ array of RT entries: the most row tiles a launch at the top
of decode's wgmma range can have, whatever the window, so a kernel of one name is one module.
"""
from __future__ import annotations

import dataclasses

from codegen import dispatch, sizes
from codegen.arch import has_feature
from codegen.errors import LoweringError
from codegen.kernel import KernelLaunch, Options, Workspace, inp, out, tensor_map, work

from ir.formats import FP8, UNSCALED

from . import _moe, _moe_fp8, _moe_gemm_fp8, _moe_grouped, _moe_int, _moe_wgmma_skinny as S, moe_down, moe_gate_up_silu

FAMILY = "moe_expert_ffn"
TEMPLATE = "moe_expert_ffn.cu.j2"
OPS = ("moe_expert_ffn",)
# FP8, msModelSlim's integer layouts: the two grouped launches (no wgmma_skinny rows: `facts`)
WEIGHT_FORMATS = (*UNSCALED, FP8.name, *_moe_int.SERVED)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)
WORKSPACE = "expert_act"
THREADS = S.THREADS + 32   # + the publisher warp (moe_expert_ffn.cuh FFN_THREADS)


def row_tile_bound(E: int, pairs: int) -> int:
    """S.row_tiles(E) at NP = pairs."""
    return sizes.evaluate(S.row_tiles(E), {"NP": pairs})


def decode_upper(opts, gu: dict) -> int:
    """The top of decode's wgmma range (the grouped table's wgmma_skinny row)."""
    return max(hi for _, hi in dispatch.row_range(_moe_grouped.table_rows(opts, gu, down=False), "wgmma_skinny"))


def fused_launch(nid: str, opts: Options, gu: dict, dn: dict, args: tuple, run: str | None) -> KernelLaunch:
    from codegen.render import kernel_name
    staged = opts.tuning.moe.expert_ffn_staged_from
    E, K, M, D = gu["E"], gu["K"], gu["N"], dn["N"]
    nct = S.col_tiles(M, down=False) + S.col_tiles(D, down=True)   # a row tile's: gate_up_silu's + down's
    tiles = f"{nct} * {S.row_tiles(E)}"
    params = {"act": gu["act"], "E": E, "M": M, "D": D, "K": K, "variant": "fused", "threads": THREADS,
              "stages": S.STAGES, "smem": S.smem(S.STAGES), "box_rows": S.BOX, "box_k": S.BK, "pairs": S.BP,
              "staged_from": staged,
              "row_tiles": row_tile_bound(E, decode_upper(opts, gu) * K)}   # the widest: one module for any window
    return KernelLaunch(
        family=FAMILY, template=TEMPLATE,
        name=kernel_name(FAMILY, [opts.dtype, f"e{E}_k{K}", f"m{M}_d{D}", *S.switch_names(staged), "fused"]),
        params=params, nodes=(nid,), grid=(_moe.when(f"min(2 * SMS, {tiles})", run), 1, 1),
        block=(THREADS, 1, 1), args=args, smem=S.smem(S.STAGES), stage="fused", requires=(S.FEATURE,))


def facts(opts, gu: dict, dn: dict) -> dict:
    """The expert_ffn table's conditions: decode's wgmma serves both halves where the grouped
    table gives both a wgmma_skinny row (FP8 weights: wgmma_skinny_fp8 rows, so the two launches)."""
    both = all(any(r.variant == "wgmma_skinny" for r in _moe_grouped.table_rows(opts, p, down=down))
               for p, down in ((gu, False), (dn, True)))
    return {"dtype": opts.dtype, "sm_90a": has_feature(opts.arch, S.FEATURE), "decode_wgmma": both}


def params(nid: str, G, opts: Options) -> tuple[dict, dict]:
    """The gate / up and down halves' grouped params (their weights' format as p["fp8"] / p["int"], the
    norm's quantised rows of x as gate / up's p["x_f8"] / p["x_rows"])."""
    attrs, (x, routing), _, _ = _moe.node_io(G, nid)
    E, M, D = attrs["num_experts"], attrs["inner_dim"], attrs["out_dim"]
    if _moe.inner(G, nid, x) != D:
        raise LoweringError(f"moe_expert_ffn {nid}: x has width {_moe.inner(G, nid, x)}, its out_dim is {D}")
    K = _moe.pairs_top_k(G, nid, routing)
    _moe.require_dense(G, nid, x)
    gu = _moe.grouped_params(nid, opts, E=E, N=M, KD=D, K=K, rows_per_warp=moe_gate_up_silu.ROWS_PER_WARP)
    dn = _moe.grouped_params(nid, opts, E=E, N=D, KD=M, K=1, rows_per_warp=moe_down.ROWS_PER_WARP)
    if _moe_fp8.is_fp8(G, nid, ("gate", "up", "down"), opts):
        gu["fp8"] = dn["fp8"] = True
        _moe_gemm_fp8.take_norm_rows(G, x, opts, gu)
    ifmt = _moe_int.int_format(G, nid, ("gate", "up", "down"), opts)
    if ifmt:
        gu["int"] = dn["int"] = ifmt
        _moe_int.take_norm_rows(G, x, opts, gu)
    return gu, dn


def fp8x_from(nid: str, G, opts: Options) -> int | None:
    """The first token count at which gate / up's two-launch path multiplies x FP8 x FP8, None: never
    (_norm_quant.fp8_from)."""
    gu, dn = params(nid, G, opts)
    two = dispatch.row_range(dispatch.rows(FAMILY, facts(opts, gu, dn), opts.tuning), "two_launch")
    return _moe_grouped.fp8x_from(opts, gu, within=two)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, (x, routing), (y,), bound = _moe.node_io(G, nid)
    M = attrs["inner_dim"]
    gu, dn = params(nid, G, opts)
    act, fp8, ifmt = gu["act"], gu.get("fp8", False), gu.get("int")
    ws = Workspace(WORKSPACE, ("NP", M), "act")
    order, offsets = inp("order", "i32", f"{routing}.order"), inp("offsets", "i32", f"{routing}.offsets")
    if ifmt:
        gu_w = _moe_int.args({"w_gate": bound["gate"], "w_up": bound["up"]}, ifmt)
        dn_w = _moe_int.args({"w": bound["down"]}, ifmt)
    else:
        gu_w = _moe_fp8.args({"w_gate": bound["gate"], "w_up": bound["up"]}, act, fp8)
        dn_w = _moe_fp8.args({"w": bound["down"]}, act, fp8)
    gu_args = (inp("x", act, x), *gu_w, order, offsets, work("out", act, WORKSPACE))
    dn_args = (work("a", act, WORKSPACE, writes=False), *dn_w, order, offsets, out("out", act, y))
    rows = dispatch.rows(FAMILY, facts(opts, gu, dn), opts.tuning)
    two = dispatch.row_range(rows, "two_launch")
    launches = []
    for lo, hi in dispatch.row_range(rows, "fused"):
        args = (inp("x", act, x), tensor_map("w_gate", bound["gate"], (S.BOX, S.BK)),
                tensor_map("w_up", bound["up"], (S.BOX, S.BK)), tensor_map("w_down", bound["down"], (S.BOX, S.BK)),
                order, offsets, work("a", act, WORKSPACE), out("out", act, y))
        launches.append(fused_launch(nid, opts, gu, dn, args, sizes.token_range(lo, hi)))
    launches += moe_gate_up_silu.launches(nid, gu, gu_args, opts, shared=_moe.routing_shared(G, routing), within=two)
    launches += moe_down.launches(nid, dn, dn_args, opts, within=two)
    # the FP8 x FP8 and int launches keep their own workspaces beside it (their quantised inputs)
    return [dataclasses.replace(la, workspace=(ws, *la.workspace)) for la in launches]
