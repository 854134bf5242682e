"""moe_combine: [eo [NP, D], w [T, K] fp32] -> round(sum_k w[t, k] * eo[t*K + k]) [T, D]."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, Options
from codegen.render import kernel_name

from . import _moe

FAMILY = "moe_combine"
TEMPLATE = "moe_combine.cu.j2"
OPS = ("moe_combine",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    _, (eo, w), (y,), _ = _moe.node_io(G, nid)
    D, K = _moe.inner(G, nid, eo), _moe.inner(G, nid, w)
    _moe.require_dense(G, nid, eo, w)
    p = _moe.combine_params(nid, opts, D=D, K=K)
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"k{K}_d{D}"]),
        params=p, nodes=(nid,), grid=_moe.combine_grid(p), block=(p["threads"], 1, 1),
        args=(inp("eo", p["act"], eo), inp("w", "float", w), out("out", p["act"], y)))]


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)
