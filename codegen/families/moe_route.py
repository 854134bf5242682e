"""moe_route: x [T, D] -> ids [T, K], weights [T, K] fp32, routing; one launch at decode sizes.

While T <= ROUTE_FUSED_TOKENS, one launch ("fused", templates/include/moe_route.cuh):
  the router GEMV's CTAs (EPB experts x TT tokens each, so decode's T = 1 spreads the fp32 gate
  over E / EPB CTAs) write the logits; the last CTA of each token tile to finish (an atomic
  ticket) runs scoring, group selection, top-k, normalisation and scaling for the tile's TT
  tokens, a warp each; the last tile to finish aligns every pair (counts, scan, scatter) in its
  CTA.  The tickets reset themselves, so CUDA-graph replays need no memset launch.
Above it, three launches:
  1. router GEMV   logits [T, E] = x.float() @ gate.T in fp32 (workspace);
  2. top-k         one warp per token (the moe_topk kernel's math);
  3. align         counts, scan and scatter of the pairs by expert in one CTA (the moe_align
                   kernel's), or count / scan / scatter launches above _moe.ALIGN_PARALLEL_PAIRS.
Which runs is chosen on the host from T alone (grid factors, _moe.only_below / only_above), so a
decode step captured at a batch size carries only the launches that do work.  No device-to-host
copy: the grouped expert kernels read the routing from device memory.
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, Options, Workspace, WorkspaceRef, inp, out, size, weight, work
from codegen.render import kernel_name

from . import _moe

FAMILY = "moe_route"
TEMPLATE = "moe_route.cu.j2"
OPS = ("moe_route",)
PDL = True                # every kernel of moe_route.cu.j2 waits before its first dependent access

GEMV_THREADS = 256
EXPERTS_PER_CTA = 2
TOKENS_PER_CTA = 8        # a token tile; in the fused launch, one warp per token for the top-k
# Up to this many tokens the route is the one fused launch; above it, the three launches.  The
# fused launch runs each tile's top-k in one CTA of the tile and the alignment of all T*K pairs in
# one CTA of GEMV_THREADS threads (the three-launch align has ALIGN_THREADS), so at large T the
# three launches win; where they cross is for the H200 to say (tests/gpu/perf_route.py).  None:
# always the three launches.
ROUTE_FUSED_TOKENS = 256


def fused_tiles(ft: int) -> int:
    """Token tiles the fused launch has tickets for (T <= tiles * TOKENS_PER_CTA)."""
    return -(-ft // TOKENS_PER_CTA)


def fused_smem(E: int, K: int, tiles: int) -> int:
    """Dynamic shared memory of the fused launch: the top-k scratch (two rows of E floats per warp),
    then, in the last CTA, the pairs' ids (int each)."""
    return max(2 * (GEMV_THREADS // 32) * E * 4, tiles * TOKENS_PER_CTA * K * 4)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, (x,), (ids, weights, routing), bound = _moe.node_io(G, nid)
    dt, ct = _moe.act(nid, opts)
    E, D = attrs["num_experts"], _moe.inner(G, nid, x)
    _moe.require_dense(G, nid, x)
    bias = bound.get("bias")
    topk = {"stage": "topk", **_moe.topk_params(nid, attrs, E, bias is not None)}
    K = topk["K"]
    gemv = {"act": ct, "E": E, "D": D, "epb": EXPERTS_PER_CTA, "tt": TOKENS_PER_CTA, "threads": GEMV_THREADS,
            "vec": _moe.vec_width(D, 4)}
    logits = Workspace("router_logits", ("T", E), "f32")
    cta_cols = -(-E // EXPERTS_PER_CTA)
    ft = ROUTE_FUSED_TOKENS
    launches = []

    if ft is not None:
        tiles = fused_tiles(ft)
        smem = fused_smem(E, K, tiles)
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
            params=fused, nodes=(nid,), grid=(f"{cta_cols} * {_moe.only_below(ft)}", f"cdiv(T, {TOKENS_PER_CTA})", 1),
            block=(GEMV_THREADS, 1, 1), args=tuple(args), smem=smem, workspace=(logits,), stage="fused"))
    above = None if ft is None else _moe.only_above(ft)

    launches.append(KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [dt, f"e{E}_d{D}", "gemv"]),
        params={**gemv, "stage": "router_gemv"}, nodes=(nid,),
        grid=(_moe.when(cta_cols, above), f"cdiv(T, {TOKENS_PER_CTA})", 1), block=(GEMV_THREADS, 1, 1),
        args=(inp("x", ct, x), weight("gate", "float", bound["gate"]),
              work("logits", "float", "router_logits"), size("num_tokens", "T")),
        workspace=(logits,), stage="router_gemv"))
    launches.append(_moe.topk_launch(
        FAMILY, TEMPLATE, kernel_name(FAMILY, [*_moe.topk_name_parts(topk), "topk"]), topk, nid,
        WorkspaceRef("router_logits"), bias, ids, weights, workspace=(logits,), stage="topk", only=above))
    align = {"stage": "align", **_moe.align_params(E)}
    launches += _moe.align_launches(FAMILY, TEMPLATE, kernel_name(FAMILY, [f"e{E}", "align"]), align,
                                    nid, ids, routing, stage="align", only=above)
    return launches
