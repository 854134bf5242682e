"""moe_gate_up_silu: [x [T, D], routing] -> a [NP, M] = silu(x Wg[e]^T) * (x Wu[e]^T) per pair.

One grouped launch a step, which one by codegen/dispatch.py's grouped_experts table
(_moe_grouped.py lowers it).  Only experts with pairs get CTAs, so decode reads each touched
expert's gate and up rows exactly once.
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, Options

from ir.formats import FP8, UNSCALED

from . import _moe, _moe_fp8, _moe_gemm_fp8, _moe_grouped, _moe_int

FAMILY = "moe_gate_up_silu"
TEMPLATE = "moe_gate_up_silu.cu.j2"
OPS = ("moe_gate_up_silu",)
# FP8: _moe_fp8's launch; msModelSlim's integer layouts: _moe_int's (codegen/dispatch.py grouped_experts)
WEIGHT_FORMATS = (*UNSCALED, FP8.name, *_moe_int.SERVED)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)
ROWS_PER_WARP = 2


def params(nid: str, G, opts: Options) -> dict:
    """The node's grouped params (_moe.grouped_params; its weights' format as p["fp8"] / p["int"])."""
    attrs, (x, routing), _, _ = _moe.node_io(G, nid)
    E, M, D = attrs["num_experts"], attrs["out_dim"], _moe.inner(G, nid, x)
    K = _moe.pairs_top_k(G, nid, routing)
    _moe.require_dense(G, nid, x)
    p = _moe.grouped_params(nid, opts, E=E, N=M, KD=D, K=K, rows_per_warp=ROWS_PER_WARP)
    if _moe_fp8.is_fp8(G, nid, ("gate", "up"), opts):
        p["fp8"] = True
        _moe_gemm_fp8.take_norm_rows(G, x, opts, p)
    ifmt = _moe_int.int_format(G, nid, ("gate", "up"), opts)
    if ifmt:
        p["int"] = ifmt
        _moe_int.take_norm_rows(G, x, opts, p)
    return p


def fp8x_from(nid: str, G, opts: Options) -> int | None:
    """The first token count at which the node multiplies x FP8 x FP8, None: never (_norm_quant.fp8_from)."""
    return _moe_grouped.fp8x_from(opts, params(nid, G, opts))


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    _, (x, routing), (h,), bound = _moe.node_io(G, nid)
    p = params(nid, G, opts)
    act, ifmt = p["act"], p.get("int")
    experts = {"w_gate": bound["gate"], "w_up": bound["up"]}
    w = _moe_int.args(experts, ifmt) if ifmt else _moe_fp8.args(experts, act, p.get("fp8", False))
    args = (inp("x", act, x), *w,
            inp("order", "i32", f"{routing}.order"), inp("offsets", "i32", f"{routing}.offsets"),
            out("out", act, h))
    return launches(nid, p, args, opts, shared=_moe.routing_shared(G, routing))


def launches(nid: str, p: dict, args: tuple, opts: Options, *, shared: int = 0, within=None) -> list[KernelLaunch]:
    """The grouped launches over `args` (x, w_gate, w_up, order, offsets, out); moe_expert_ffn's
    two-launch path passes its workspace as out and its token ranges as `within`.  `shared`:
    _moe.routing_shared."""
    name = [opts.dtype, f"e{p['E']}_k{p['K']}", f"m{p['N']}_d{p['KD']}"]
    return _moe_grouped.launches(FAMILY, TEMPLATE, name, p, nid, args, opts, down=False, shared=shared,
                                 within=within)


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py) of the skinny wgmma launches: one per column
    tile of the expert activations (which pairs an expert has is data, so every tile covers every
    pair row); the other launches are one task each."""
    from ._moe_wgmma_skinny import cols
    if not launch.stage.startswith("wgmma_skinny"):
        return None
    return tiling.column_tiles(launch, cols(down=False))
