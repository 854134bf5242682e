"""moe_combine_residual: [eo [NP, D], w [T, K], shared [T, D], residual [T, D]] ->
residual + round(round(sum_k w * eo) + shared), with the unfused chain's rounding points."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, Options
from codegen.render import kernel_name

from . import _moe

FAMILY = "moe_combine_residual"
TEMPLATE = "moe_combine_residual.cu.j2"
OPS = ("moe_combine_residual",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    _, (eo, w, shared, residual), (y,), _ = _moe.node_io(G, nid)
    D, K = _moe.inner(G, nid, eo), _moe.inner(G, nid, w)
    _moe.require_dense(G, nid, eo, w, shared, residual)
    p = _moe.combine_params(nid, opts, D=D, K=K)
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"k{K}_d{D}"]),
        params=p, nodes=(nid,), grid=_moe.combine_grid(p), block=(p["threads"], 1, 1),
        args=(inp("eo", p["act"], eo), inp("w", "float", w), inp("shared", p["act"], shared),
              inp("residual", p["act"], residual), out("out", p["act"], y)))]
