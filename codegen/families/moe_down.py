"""moe_down: [a [NP, M], routing] -> eo [NP, D] = a[p] W[e]^T per pair, one grouped launch a
step, which one by codegen/dispatch.py's grouped_experts table (_moe_grouped.py lowers it)."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, Options

from ir.formats import FP8, UNSCALED

from . import _moe, _moe_fp8, _moe_grouped, _moe_int

FAMILY = "moe_down"
TEMPLATE = "moe_down.cu.j2"
OPS = ("moe_down",)
# FP8: _moe_fp8's launch; msModelSlim's integer layouts: _moe_int's (codegen/dispatch.py grouped_experts)
WEIGHT_FORMATS = (*UNSCALED, FP8.name, *_moe_int.SERVED)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)
ROWS_PER_WARP = 4


def params(nid: str, G, opts: Options) -> dict:
    """The node's grouped params (_moe.grouped_params; its weight's format as p["fp8"] / p["int"])."""
    attrs, (a, _), _, _ = _moe.node_io(G, nid)
    E, D, M = attrs["num_experts"], attrs["out_dim"], _moe.inner(G, nid, a)
    _moe.require_dense(G, nid, a)
    # Rows are per pair here, so the kernel never needs K.
    p = _moe.grouped_params(nid, opts, E=E, N=D, KD=M, K=1, rows_per_warp=ROWS_PER_WARP)
    if _moe_fp8.is_fp8(G, nid, ("weight",), opts):
        p["fp8"] = True
    ifmt = _moe_int.int_format(G, nid, ("weight",), opts)
    if ifmt:
        p["int"] = ifmt
    return p


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    _, (a, routing), (y,), bound = _moe.node_io(G, nid)
    p = params(nid, G, opts)
    act, ifmt = p["act"], p.get("int")
    experts = {"w": bound["weight"]}
    w = _moe_int.args(experts, ifmt) if ifmt else _moe_fp8.args(experts, act, p.get("fp8", False))
    args = (inp("a", act, a), *w,
            inp("order", "i32", f"{routing}.order"), inp("offsets", "i32", f"{routing}.offsets"),
            out("out", act, y))
    return launches(nid, p, args, opts)


def launches(nid: str, p: dict, args: tuple, opts: Options, *, within=None) -> list[KernelLaunch]:
    """The grouped launches over `args` (a, w, order, offsets, out); moe_expert_ffn's two-launch
    path passes its workspace as a and its token ranges as `within`."""
    return _moe_grouped.launches(FAMILY, TEMPLATE, [opts.dtype, f"e{p['E']}", f"d{p['N']}_m{p['KD']}"], p, nid,
                                 args, opts, down=True, within=within)


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py) of the skinny wgmma launches: one per column
    tile of the output (each reads every pair's activations: which rows an expert owns is data); the
    other launches are one task each."""
    from ._moe_wgmma_skinny import cols
    if not launch.stage.startswith("wgmma_skinny"):
        return None
    return tiling.column_tiles(launch, cols(down=True))
