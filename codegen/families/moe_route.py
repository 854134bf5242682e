"""moe_route: x [T, D] -> ids [T, P], weights [T, P] fp32, routing; one launch at decode sizes.

P = K + S: with shared_experts S > 0 (ir/passes/fuse_shared_experts.py) every token's K routed
pairs are followed by S pairs of the shared experts (weight 1), aligned with the routed ones over
E + S experts: the shared experts are 0..S-1, routed expert e is S + e (moe_router.cuh topk_scored).

Which launches serve which T is codegen/dispatch.py's route table (Tuning.route).
While T <= route.fused_upto, one launch ("fused", templates/include/moe_route.cuh):
  the router GEMV's CTAs (EPB experts x TT tokens each, so decode's T = 1 spreads the fp32 gate
  over E / EPB CTAs) write the logits; the last CTA of each token tile to finish (an atomic
  ticket) runs scoring, group selection, top-k, normalisation and scaling for the tile's TT
  tokens, a warp each; the last tile to finish aligns every pair (counts, scan, scatter) in its
  CTA.  The tickets reset themselves, so CUDA-graph replays need no memset launch.
Above it, three launches:
  1. router logits [T, E] = x.float() @ gate.T in fp32 (workspace): while T <= route.gemm_above the
                   GEMV (EPB experts x TT tokens a CTA), above it the tiled GEMM of
                   templates/include/router_gemm.cuh (BM tokens x BN experts a CTA, so x is read
                   cdiv(E, BN) times instead of cdiv(E, EPB); D split over CTAs while the tiles are
                   fewer than the SMs);
  2. top-k         one warp per token (the moe_topk kernel's math);
  3. align         counts, scan and scatter of the pairs by expert in one CTA (the moe_align
                   kernel's), or count / scan / scatter launches above moe.align_parallel_above pairs.
Which runs is chosen on the host from T alone (grid factors: codegen.sizes.only_below /
only_above), so a decode step captured at a batch size carries only the launches that do work; a
launch whose T range is empty under the bounds is not emitted.  No device-to-host copy: the grouped expert
kernels read the routing from device memory.
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, Options, Workspace, WorkspaceRef, inp, out, size, weight, work
from codegen.render import kernel_name
from codegen import dispatch
from codegen.sizes import only_below, token_range

from . import _moe

FAMILY = "moe_route"
TEMPLATE = "moe_route.cu.j2"
OPS = ("moe_route",)
PDL = True                # every kernel of moe_route.cu.j2 waits before its first dependent access

GEMV_THREADS = 256
EXPERTS_PER_CTA = 2
TOKENS_PER_CTA = 8        # a token tile; in the fused launch, one warp per token for the top-k
# The fused launch runs each tile's top-k in one CTA of the tile and the alignment of all T*K
# pairs in one CTA of GEMV_THREADS threads (the three-launch align has ALIGN_THREADS), so at large
# T the three launches win.  The three-launch route's logits: the GEMV re-reads each token's x once
# per expert pair, so above route.gemm_above the tiled GEMM; at the fused bound the GEMM, split
# over D, already fills the SMs, so the two bounds meet.
# The GEMM's tiles (templates/include/router_gemm.cuh): BM tokens x BN experts a CTA of GEMM_THREADS,
# BK of D a stage, TM x TN outputs a thread (16 FMAs per two 16-byte shared loads).  Two CTAs an SM:
# 36.9 KB of shared memory each and at most 128 registers a thread.
GEMM_BM, GEMM_BN, GEMM_BK = 64, 64, 32
GEMM_TM, GEMM_TN = 4, 4
GEMM_THREADS = 256
# Split D over up to GEMM_SPLIT_MAX CTAs a tile, each at least GEMM_SPLIT_MIN_D of it, while the
# tiles are fewer than the SMs (S = SMS // tiles): prefill 1 x 2048 at V2-Lite has 32 tiles, S = 4.
# Each split writes a partial tile and the last one sums them (tickets: at most GEMM_TICKETS tiles).
GEMM_SPLIT_MAX, GEMM_SPLIT_MIN_D = 8, 128
GEMM_TICKETS = 512


def fused_tiles(ft: int) -> int:
    """Token tiles the fused launch has tickets for (T <= tiles * TOKENS_PER_CTA)."""
    return -(-ft // TOKENS_PER_CTA)


def fused_smem(E: int, P: int, tiles: int) -> int:
    """Dynamic shared memory of the fused launch: the top-k scratch (two rows of E floats per warp),
    then, in the last CTA, the pairs' ids (int each; P pairs a token, shared experts included)."""
    return max(2 * (GEMV_THREADS // 32) * E * 4, tiles * TOKENS_PER_CTA * P * 4)


def gemm_smem(bm: int, bn: int, bk: int) -> int:
    """Dynamic shared memory of the GEMM: two stages of (BM + BN) rows of BK + 4 floats."""
    return 2 * (bm + bn) * (bk + 4) * 4


def gemm_split_cap(D: int) -> int:
    """Most splits of D: GEMM_SPLIT_MAX, each at least GEMM_SPLIT_MIN_D (whole BK slices)."""
    slices = -(-D // GEMM_BK)
    return max(1, min(GEMM_SPLIT_MAX, slices // -(-GEMM_SPLIT_MIN_D // GEMM_BK)))


def gemm_tiles(E: int) -> str:
    """Output tiles of the GEMM at T tokens."""
    return f"cdiv(T, {GEMM_BM}) * {-(-E // GEMM_BN)}"


def gemm_splits(E: int, D: int) -> int | str:
    """S, the GEMM's grid z: enough splits of D that tiles * S reaches the SM count, capped; 1 when
    the tiles alone fill the SMs or would not fit the tickets (S > 1 means tiles <= GEMM_TICKETS)."""
    cap = gemm_split_cap(D)
    if cap == 1:
        return 1
    return f"max(1, min({cap}, min(SMS, {GEMM_TICKETS}) // ({gemm_tiles(E)})))"


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, (x,), (ids, weights, routing), bound = _moe.node_io(G, nid)
    dt, ct = _moe.act(nid, opts)
    E, D = attrs["num_experts"], _moe.inner(G, nid, x)
    _moe.require_dense(G, nid, x)
    bias = bound.get("bias")
    topk = {"stage": "topk", **_moe.topk_params(nid, attrs, E, bias is not None)}
    K, S = topk["K"], topk["S"]          # S shared experts: aligned as experts 0..S-1, the routed after
    gemv = {"act": ct, "E": E, "D": D, "epb": EXPERTS_PER_CTA, "tt": TOKENS_PER_CTA, "threads": GEMV_THREADS,
            "vec": _moe.vec_width(D, 4)}
    logits = Workspace("router_logits", ("T", E), "f32")
    cta_cols = -(-E // EXPERTS_PER_CTA)
    rows = dispatch.rows(FAMILY, {}, opts.tuning)
    fused_rows = dispatch.row_range(rows, "fused")
    launches = []

    for _, ft in fused_rows:
        tiles = fused_tiles(ft)
        smem = fused_smem(E, K + S, tiles)
        fused = {**gemv, **topk, "stage": "fused", "warps": GEMV_THREADS // 32, "tiles": tiles, "smem": smem}
        args = [inp("x", ct, x), weight("gate", "float", bound["gate"])]
        if bias is not None:
            args.append(weight("bias", "float", bias))
        args += [work("logits", "float", "router_logits"), out("ids", "i64", ids), out("weights", "float", weights),
                 out("order", "i32", f"{routing}.order"), out("offsets", "i32", f"{routing}.offsets"),
                 size("num_tokens", "T")]
        launches.append(KernelLaunch(
            family=FAMILY, template=TEMPLATE,
            name=kernel_name(FAMILY, [dt, f"d{D}", *_moe.topk_name_parts(topk), f"fused_t{tiles * TOKENS_PER_CTA}"]),
            params=fused, nodes=(nid,), grid=(f"{cta_cols} * {only_below(ft)}", f"cdiv(T, {TOKENS_PER_CTA})", 1),
            block=(GEMV_THREADS, 1, 1), args=tuple(args), smem=smem, workspace=(logits,), stage="fused"))
    # the three launches: top-k and align wherever the fused launch does not run
    above = token_range(fused_rows[0][1] + 1, None) if fused_rows else None

    for lo, hi in dispatch.row_range(rows, "router_gemv"):
        launches.append(KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [dt, f"e{E}_d{D}", "gemv"]),
            params={**gemv, "stage": "router_gemv"}, nodes=(nid,),
            grid=(_moe.when(cta_cols, token_range(lo, hi)), f"cdiv(T, {TOKENS_PER_CTA})", 1), block=(GEMV_THREADS, 1, 1),
            args=(inp("x", ct, x), weight("gate", "float", bound["gate"]),
                  work("logits", "float", "router_logits"), size("num_tokens", "T")),
            workspace=(logits,), stage="router_gemv"))
    for lo, hi in dispatch.row_range(rows, "router_gemm"):
        launches.append(_gemm_launch(nid, dt, ct, x, bound["gate"], E, D, logits, token_range(lo, hi)))
    launches.append(_moe.topk_launch(
        FAMILY, TEMPLATE, kernel_name(FAMILY, [*_moe.topk_name_parts(topk), "topk"]), topk, nid,
        WorkspaceRef("router_logits"), bias, ids, weights, workspace=(logits,), stage="topk", only=above))
    align = {"stage": "align", **_moe.align_params(E + S)}
    launches += _moe.align_launches(FAMILY, TEMPLATE, kernel_name(FAMILY, [f"e{E + S}", "align"]), align,
                                    nid, ids, routing, opts, stage="align", only=above)
    return launches


def _gemm_launch(nid, dt, ct, x, gate, E, D, logits, only) -> KernelLaunch:
    """The GEMM's launch: grid (expert blocks, token tiles, splits of D); `only`: its T factor."""
    bm, bn, bk, tm, tn, nt = GEMM_BM, GEMM_BN, GEMM_BK, GEMM_TM, GEMM_TN, GEMM_THREADS
    smem = gemm_smem(bm, bn, bk)
    params = {"stage": "router_gemm", "act": ct, "E": E, "D": D, "bm": bm, "bn": bn, "bk": bk, "tm": tm, "tn": tn,
              "threads": nt, "min_blocks": 2 if tm * tn <= 16 else 1, "xvec": _moe.vec_width(D, _moe.ELEM_BYTES[dt]),
              "gvec": _moe.vec_width(D, 4), "tickets": GEMM_TICKETS, "partial_width": tm * tn, "smem": smem}
    S = gemm_splits(E, D)
    # one row of TM * TN floats per thread of every split's CTA; none when S = 1
    rows = 0 if S == 1 else f"({S}) * {gemm_tiles(E)} * {nt} * min(1, ({S}) - 1)"
    partials = Workspace("router_partials", (rows, tm * tn), "f32")
    return KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [dt, f"e{E}_d{D}", "gemm"]),
        params=params, nodes=(nid,),
        grid=(-(-E // bn), _moe.when(f"cdiv(T, {bm})", only), S), block=(nt, 1, 1),
        args=(inp("x", ct, x), weight("gate", "float", gate), work("logits", "float", "router_logits"),
              work("partials", "float", "router_partials"), size("num_tokens", "T")),
        smem=smem, workspace=(logits, partials), stage="router_gemm")
