"""moe_gate_up: [x [T, D], routing] -> g, u [NP, M] per pair (x Wg[e]^T, x Wu[e]^T), one grouped
launch; the unfused form of moe_gate_up_silu (same kernel body, two rounded outputs)."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, Options

from ir.formats import FP8, UNSCALED

from . import _moe, _moe_fp8, _moe_grouped

FAMILY = "moe_gate_up"
TEMPLATE = "moe_gate_up.cu.j2"
OPS = ("moe_gate_up",)
WEIGHT_FORMATS = (*UNSCALED, FP8.name)   # FP8: _moe_fp8's launch (codegen/dispatch.py grouped_experts)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)
ROWS_PER_WARP = 2


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, (x, routing), (out_g, out_u), bound = _moe.node_io(G, nid)
    E, M, D = attrs["num_experts"], attrs["out_dim"], _moe.inner(G, nid, x)
    K = _moe.pairs_top_k(G, nid, routing)
    _moe.require_dense(G, nid, x)
    p = _moe.grouped_params(nid, opts, E=E, N=M, KD=D, K=K, rows_per_warp=ROWS_PER_WARP)
    act = p["act"]
    fp8 = _moe_fp8.is_fp8(G, nid, ("gate", "up"), opts)
    if fp8:
        p["fp8"] = True
    w = _moe_fp8.args({"w_gate": bound["gate"], "w_up": bound["up"]}, act, fp8)
    args = (inp("x", act, x), *w,
            inp("order", "i32", f"{routing}.order"), inp("offsets", "i32", f"{routing}.offsets"),
            out("out_gate", act, out_g), out("out_up", act, out_u))
    return _moe_grouped.launches(FAMILY, TEMPLATE, [opts.dtype, f"e{E}_k{K}", f"m{M}_d{D}"], p, nid, args, opts,
                                 down=False, shared=_moe.routing_shared(G, routing))
