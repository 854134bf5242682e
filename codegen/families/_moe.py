"""Helpers the MoE families share: node data, vector widths, the top-k and align launches.

Not a family (the leading underscore keeps it out of the registry).  Device code lives in
templates/include/moe_*.cuh (moe_router.cuh: router, top-k, align; moe_grouped.cuh: the grouped
expert GEMV / GEMM; moe_combine.cuh: combine); the families only choose constants and launch
geometry.

Dimension legend: T tokens, D hidden, E routed experts, K experts per token, G expert
groups, M expert intermediate size, NP = T*K token-expert pairs (pair p = t*K + k).
"""
from __future__ import annotations

from codegen import dispatch
from codegen.errors import LoweringError
from codegen.kernel import DTYPES, Arg, KernelLaunch, Workspace, inp, out, size, weight, work
from ir.graph import value_producers
from ir.ops.moe import pairs_per_token

from ._dense_util import c_float

ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MAX_EXPERTS = 1024        # top-k keeps E / 32 scores per lane; align keeps E counters in shared memory
MAX_TOP_K = 32            # one lane per chosen expert
TOPK_WARPS = 4            # tokens per top-k CTA (one warp each)
ALIGN_THREADS = 1024      # the single align CTA (and the scan of the parallel one)
# Above Tuning.moe.align_parallel_above pairs the alignment runs as count / scan / scatter over
# ALIGN_CHUNK-pair chunks (moe_router.cuh 3b) instead of one CTA (codegen/dispatch.py align).
ALIGN_CHUNK, ALIGN_CHUNK_THREADS = 2048, 256


def node_io(G, nid: str) -> tuple[dict, list[str], list[str], dict]:
    """(attrs, input value names, output value names, weights role -> bound name)."""
    data = G.nodes[nid]
    return dict(data["attrs"]), list(data["inputs"]), list(data["outputs"]), dict(data["weights"])


def vtype(G, name: str):
    return G.graph["values"][name]


def inner(G, nid: str, name: str, dim: int = 1) -> int:
    d = vtype(G, name).shape[dim]
    if not isinstance(d, int):
        raise LoweringError(f"value {name} has a symbolic dim {dim} ({vtype(G, name)})")
    return d


def act(nid: str, opts) -> tuple[str, str]:
    """(dtype tag, C type) of activations and expert weights."""
    if opts.dtype not in DTYPES:
        raise LoweringError(f"unsupported activation dtype {opts.dtype!r} "
                               f"(one of {', '.join(DTYPES)})")
    return opts.dtype, DTYPES[opts.dtype]


def pairs_top_k(G, nid: str, routing: str) -> int:
    """K from a routing value's pair dim ("T*K")."""
    rows = vtype(G, routing).shape[0]
    K = pairs_per_token(rows)
    if K is None:
        raise LoweringError(f"routing {routing} has pair dim {rows!r}, expected 'T*K'")
    return K


def routing_shared(G, routing: str) -> int:
    """S, the shared experts a routing value's pairs hold (moe_route's shared_experts: experts
    0..S-1, each token's last S pairs; ir/passes/fuse_shared_experts.py); 0 for any other maker."""
    src = value_producers(G).get(routing)
    if src is None or G.nodes[src]["op"] != "moe_route":
        return 0
    return int(G.nodes[src]["attrs"].get("shared_experts", 0))


def require_dense(G, nid: str, *names: str) -> None:
    """The MoE kernels take no strides: row r of an operand of width n is at base + r * n, and
    their vector widths (vec_width) are chosen from n alone.  A strided view (a split output,
    which the runtime makes with the parent's row stride at an element offset) would be read at
    the wrong rows, or misaligned: refuse it here.  Dense buffers are fresh allocations."""
    from codegen import families                     # (both import the families: not at module level)
    from codegen.lower import LIBRARY_CALLS
    view_ops = {op for op, call in LIBRARY_CALLS.items() if call == "view" and families.family_for_op(op) is None}
    producers = value_producers(G)
    for name in names:
        src = producers.get(name)
        if src is not None and G.nodes[src]["op"] in view_ops:
            raise LoweringError(f"{G.nodes[nid]['op']} needs {name} as dense rows (no strides), but it is a "
                                f"strided view made by {G.nodes[src]['op']} node {src}")


def vec_width(n: int, elem_bytes: int) -> int:
    """Elements per load along a row of n: 16 bytes' worth, else 8 bytes', else 1 (odd dims)."""
    for nbytes in (16, 8):
        v = nbytes // elem_bytes
        if v >= 1 and n % v == 0:
            return v
    return 1


def _tag(x: float) -> str:
    return repr(float(x)).replace(".", "p").replace("-", "m").replace("+", "")


def check_experts(nid: str, E: int, K: int) -> None:
    """The bounds moe_router.cuh relies on: top-k keeps cdiv(E, 32) <= 32 scores per lane (its
    taken-mask is 32 bits) and 2 * TOPK_WARPS * E floats of static shared memory (32 KiB at
    E = 1024); align keeps 2 * E ints; one lane per chosen expert."""
    if not 1 <= E <= MAX_EXPERTS:
        raise LoweringError(f"{E} experts; the MoE kernels handle 1..{MAX_EXPERTS}")
    if not 1 <= K <= min(MAX_TOP_K, E):
        raise LoweringError(f"top_k={K}; the MoE kernels handle 1..{min(MAX_TOP_K, E)}")


# -- scoring + top-k (moe_topk, and stage 2 of moe_route) -----------------------------------

def topk_params(nid: str, attrs: dict, E: int, has_bias: bool) -> dict:
    """S: the shared experts each token also selects (moe_route's shared_experts; moe_router.cuh
    topk_scored writes them after the K routed ones), one lane each as well."""
    K, G, TG = attrs["top_k"], attrs["groups"], attrs["topk_groups"]
    S = int(attrs.get("shared_experts", 0))
    check_experts(nid, E, K)
    if S and (K + S > MAX_TOP_K or E + S > MAX_EXPERTS):
        raise LoweringError(f"top_k={K} and {S} shared experts; the route handles K + S <= {MAX_TOP_K} pairs a "
                            f"token and E + S <= {MAX_EXPERTS} experts")
    if G > 32 or E % G:
        raise LoweringError(f"{G} groups of {E} experts; the kernel needs E % G == 0, G <= 32")
    return {
        "E": E, "K": K, "S": S, "groups": G, "topk_groups": TG,
        "scoring": attrs["scoring"], "method": attrs["method"],
        "norm_topk_prob": bool(attrs["norm_topk_prob"]),
        "scaling": c_float(attrs["routed_scaling_factor"]),
        "has_bias": has_bias, "warps": TOPK_WARPS,
    }


def topk_name_parts(p: dict) -> list[str]:
    parts = [f"e{p['E']}_k{p['K']}"]
    if p["method"] != "greedy" or p["groups"] != 1:
        parts.append(f"g{p['groups']}_tg{p['topk_groups']}")
    parts.append(f"{p['scoring']}_{p['method']}")
    if p["norm_topk_prob"]:
        parts.append("norm")
    if p["scaling"] != "1.0f":
        parts.append("rsf" + _tag(float(p["scaling"][:-1])))
    if p["has_bias"]:
        parts.append("bias")
    if p["S"]:
        parts.append(f"shared{p['S']}")
    return parts


def when(grid, factor: str | None):
    """A grid extent that runs only while `factor` (a 0 / 1 expression: codegen.sizes.token_range)
    is 1; None: always."""
    if factor is None:
        return grid
    return factor if grid == 1 else f"{grid} * {factor}"


def topk_launch(family: str, template: str, name: str, params: dict, nid: str, logits_ref,
                bias: str | None, ids: str, weights: str, workspace=(), stage: str = "",
                only: str | None = None) -> KernelLaunch:
    """`logits_ref`: where the fp32 router logits are (a ValueRef, or the route's WorkspaceRef);
    `only`: a grid factor (see `when`)."""
    args = [Arg("logits", "const float*", logits_ref)]
    if params["has_bias"]:
        args.append(weight("bias", "float", bias))
    args += [out("ids", "i64", ids), out("weights", "float", weights), size("num_tokens", "T")]
    return KernelLaunch(family=family, template=template, name=name, params=params, nodes=(nid,),
                        grid=(when(f"cdiv(T, {params['warps']})", only), 1, 1), block=(params["warps"] * 32, 1, 1),
                        args=tuple(args), workspace=tuple(workspace), stage=stage)


# -- alignment (moe_align, and stage 3 of moe_route) ----------------------------------------

def align_params(E: int) -> dict:
    return {"E": E, "threads": ALIGN_THREADS, "part": "one_cta"}


def align_launches(family: str, template: str, name: str, params: dict, nid: str, ids: str,
                   routing: str, opts, stage: str = "", only: str | None = None) -> list[KernelLaunch]:
    """The one-CTA align up to the pairs dispatch.align gives it; above, the count / scan / scatter
    launches (moe_router.cuh 3b; each grid is 0 otherwise).  `only`: a grid factor on all of them
    (see `when`)."""
    io = (inp("ids", "i64", ids), out("order", "i32", f"{routing}.order"),
          out("offsets", "i32", f"{routing}.offsets"), size("num_pairs", "NP"))
    big = dispatch.rows("align", {}, opts.tuning)[0].hi   # the one CTA's last pair count (None: every)
    # One CTA: the counts, the scan and the scatter need a block-wide barrier between them.
    one = 1 if big is None else f"(1 - min(1, NP // {big + 1}))"
    launches = [KernelLaunch(family=family, template=template, name=name, params=params, nodes=(nid,),
                             grid=(when(one, only), 1, 1),
                             block=(params["threads"], 1, 1), args=io, stage=stage)]
    if big is None:
        return launches
    E = params["E"]
    n_chunks, on = f"cdiv(NP, {ALIGN_CHUNK})", when(f"min(1, NP // {big + 1})", only)
    chunks = f"{n_chunks} * {on}"
    hist = Workspace("align_hist", (n_chunks, E), "i32")
    for part, grid, threads, args in (
            ("count", chunks, ALIGN_CHUNK_THREADS,
             (io[0], work("hist", "i32", "align_hist"), io[3])),
            ("scan", on, ALIGN_THREADS,
             (work("hist", "i32", "align_hist"), size("chunks", n_chunks), io[2])),
            ("scatter", chunks, ALIGN_CHUNK_THREADS,
             (io[0], io[3], work("hist", "i32", "align_hist", writes=False),
              inp("offsets", "i32", f"{routing}.offsets"), io[1]))):
        p = {**params, "part": part, "threads": threads, "chunk": ALIGN_CHUNK}
        launches.append(KernelLaunch(
            family=family, template=template, name=f"{name}_{part}", params=p, nodes=(nid,),
            grid=(grid, 1, 1), block=(threads, 1, 1), args=args, workspace=(hist,),
            stage=f"{stage}_{part}" if stage else part))
    return launches


# -- grouped experts (moe_gate_up_silu, moe_gate_up, moe_down): the GEMV and the mma launch ----------
# Which launch serves which T is codegen/dispatch.py's table (grouped_experts); _moe_grouped.py
# lowers the rows.  These two are the forms every target has:
#   * "gemv": CUDA cores for every expert, one CTA row of slots per expert with pairs
#     (moe_grouped.cuh 4); fp32's only form, and decode's smallest batches elsewhere;
#   * "mma": one grid for every expert, the ones with more than gemm_threshold pairs on tensor
#     cores (row tiles; few pairs: swapped tiles, moe_grouped.cuh 4c), the light ones on CUDA cores
#     in slots ahead of the tiles (moe_grouped.cuh 4b), so neither kind waits for the other's tail.
#     Which expert goes where is decided on the device from the routing offsets.
# Odd widths keep both: the GEMM copies K slices with 16-byte cp.async only when KD % 8 == 0
# (else element loads with zero fill into the same 16-byte-aligned smem rows) and stores column
# pairs as one 4-byte word only when N is even (else two element stores); its column tiles mask
# n >= N.  At run time a launch whose operands' bases are not aligned for those wide accesses runs
# every expert as a light one (moe_grouped.cuh gemm_operands_ok).

GROUPED_WARPS = 4
GROUPED_PAIRS = 8         # pairs per pass over the weights: decode reads each weight row once
GEMM_BM = 128             # pairs per row tile        (templates/include/moe_grouped.cuh GEMM_*)
GEMM_BNW = 128            # weight rows per CTA: 64 gate + 64 up, or 128 down
GEMM_THREADS = 256        # two CTAs per SM


def slots(E: int) -> str:
    """CUDA-core expert slots: no more than min(E, NP) experts can have pairs."""
    return f"min({E}, NP)"


def gemm_row_tiles(E: int, thr: int) -> str:
    """A host-side bound on the GEMM's row tiles: every 128 pairs make at most one more tile, and
    each expert with more than thr pairs at most one partial tile.  Top-k picks K distinct experts
    per token, so no expert has more pairs than there are tokens: with T <= thr there is none."""
    return f"(NP // {GEMM_BM} + min({E}, NP // {thr + 1})) * min(1, T // {thr + 1})"


def gemm_smem(bk: int, stages: int) -> int:
    return stages * (GEMM_BM + GEMM_BNW) * (bk + 8) * 2


def gemm_launch_smem(bk: int, stages: int, skinny: int, sbk: int, sst: int) -> int:
    """Dynamic shared memory of the GEMM launch: the larger of the row-tile ring and the swapped
    tiles' ring (moe_grouped.cuh gemm_launch_smem); two CTAs per SM need it at most ~113 KB."""
    return max(gemm_smem(bk, stages), sst * (GEMM_BNW + skinny) * (sbk + 8) * 2 if skinny else 0)


def grouped_params(nid: str, opts, *, E: int, N: int, KD: int, K: int, rows_per_warp: int) -> dict:
    dt, ct = act(nid, opts)
    check_experts(nid, E, min(K, E))
    return {"act": ct, "E": E, "N": N, "KD": KD, "K": K, "warps": GROUPED_WARPS, "rpw": rows_per_warp,
            "pt": GROUPED_PAIRS, "vec": vec_width(KD, ELEM_BYTES[dt])}


def gemv_launch(family: str, template: str, name: str, p: dict, nid: str, args: tuple, run: str | None) -> KernelLaunch:
    """The GEMV over the family's args: slot x row group; `run`: its token-range factor."""
    return KernelLaunch(
        family=family, template=template, name=name, params={**p, "variant": "gemv"}, nodes=(nid,),
        grid=(when(slots(p["E"]), run), -(-p["N"] // (p["warps"] * p["rpw"])), 1),
        block=(p["warps"] * 32, 1, 1), args=args, stage="gemv")


def mma_launch(family: str, template: str, name: str, p: dict, nid: str, args: tuple, run: str | None, opts, *,
               down: bool) -> KernelLaunch:
    """The one-grid tensor-core launch over the family's args (plus the pair count); `run`: its
    token-range factor."""
    m = opts.tuning.moe
    bn = GEMM_BNW if down else GEMM_BNW // 2
    thr = m.gemm_threshold
    smem = gemm_launch_smem(m.gemm_bk, m.gemm_stages, m.gemm_skinny, m.skinny_bk, m.skinny_stages)
    gp = {"act": p["act"], "E": p["E"], "N": p["N"], "KD": p["KD"], "K": p["K"], "thr": thr,
          "variant": "mma", "threads": GEMM_THREADS, "bk": m.gemm_bk, "stages": m.gemm_stages, "smem": smem,
          "skinny": m.gemm_skinny, "sbk": m.skinny_bk, "sst": m.skinny_stages, "rpw": p["rpw"], "vec": p["vec"]}
    y = f"({slots(p['E'])} + {gemm_row_tiles(p['E'], thr)})"
    return KernelLaunch(
        family=family, template=template, name=name, params=gp, nodes=(nid,),
        grid=(-(-p["N"] // bn), when(y, run), 1),
        block=(GEMM_THREADS, 1, 1), args=(*args, size("num_pairs", "NP")), smem=smem, stage="mma")


# -- combine ---------------------------------------------------------------------------------

COMBINE_THREADS = 128


def combine_params(nid: str, opts, *, D: int, K: int) -> dict:
    dt, ct = act(nid, opts)
    return {"act": ct, "D": D, "K": K, "threads": COMBINE_THREADS, "vec": vec_width(D, ELEM_BYTES[dt])}


def combine_inputs(attrs: dict, ins: list) -> tuple:
    """(eo, w, shared, residual) of a residual combine; shared is None when the op's shared_experts
    S > 0 (the shared experts are each token's last S pairs: ir/passes/fuse_shared_experts.py)."""
    if combine_shared(attrs):
        eo, w, residual = ins
        return eo, w, None, residual
    eo, w, shared, residual = ins
    return eo, w, shared, residual


def combine_shared(attrs: dict) -> int:
    return int(attrs.get("shared_experts", 0))


def shared_tag(p: dict) -> list[str]:
    """A kernel-name part for a combine that takes the shared experts from its pairs."""
    return [f"shared{p['S']}"] if p["S"] else []


def combine_grid(p: dict) -> tuple:
    return ("T", -(-p["D"] // (p["threads"] * p["vec"])), 1)


