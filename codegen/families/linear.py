"""linear at decode batch sizes: a generated GEMV for T <= TMAX tokens, cuBLAS above.

cuBLAS reaches about half the copy bandwidth on the skinny [T <= 8, K] x [K, N] products of a
decode step (and adds split-K reduce kernels); a GEMV that reads each weight row once with
16-byte loads does better there.  The node lowers to both: the GEMV launch, whose grid is empty
when T > TMAX, and the library call, which runs only when T > TMAX (``library_when``).
fp32-precision linears (routers, when not fused) stay on the library.
"""
from __future__ import annotations

from codegen.kernel import Arg, KernelLaunch
from codegen.render import kernel_name

from ._dense_util import act_ctype, inner_dims, node_io

FAMILY = "linear"
TEMPLATE = "linear_gemv.cu.j2"
OPS = ("linear",)
TMAX = 8          # decode batches up to 8 take the GEMV
ROWS = 4          # output rows per warp: 4 weight loads in flight per lane
WARPS = 4


def _gemv(data) -> bool:
    return data["attrs"].get("precision", "act") != "fp32"


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    if not _gemv(data):
        return []
    (K,) = inner_dims(G, ins[0])
    (N,) = inner_dims(G, outs[0])
    params = {"act": act_ctype(opts), "N": N, "K": K, "tmax": TMAX, "rows": ROWS, "warps": WARPS}
    # Grid y is 1 when T <= TMAX, else 0 (an empty grid launches nothing).
    on = f"max(0, {TMAX + 1} - T) // max(1, {TMAX + 1} - T)"
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"n{N}_k{K}", f"t{TMAX}"]),
        params=params, nodes=(nid,), grid=(-(-N // (ROWS * WARPS)), on, 1), block=(WARPS * 32, 1, 1),
        args=(Arg("ptr", f"value:{ins[0]}"), Arg("i64", f"stride:{ins[0]}:0"), Arg("ptr", f"weight:{w['weight']}"),
              Arg("ptr", f"value:{outs[0]}"), Arg("i32", "size:T")))]


def library_when(nid, G, opts) -> str | None:
    """The size expression under which the library call still runs (None: always)."""
    data = G.nodes[nid]
    return f"max(0, T - {TMAX})" if _gemv(data) else None
