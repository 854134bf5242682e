"""moe_combine_residual: [eo [NP, D], w [T, K], shared [T, D], residual [T, D]] ->
residual + round(round(sum_k w * eo) + shared), with the unfused chain's rounding points."""
from __future__ import annotations

from codegen.kernel import Arg, KernelLaunch, Options
from codegen.render import kernel_name

from . import _moe

FAMILY = "moe_combine_residual"
TEMPLATE = "moe_combine_residual.cu.j2"
OPS = ("moe_combine_residual",)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    _, (eo, w, shared, residual), (out,), _ = _moe.node_io(G, nid)
    D, K = _moe.inner(G, nid, eo), _moe.inner(G, nid, w)
    p = _moe.combine_params(nid, opts, D=D, K=K)
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"k{K}_d{D}"]),
        params=p, nodes=(nid,), grid=_moe.combine_grid(p), block=(p["threads"], 1, 1),
        args=(Arg("ptr", f"value:{eo}"), Arg("ptr", f"value:{w}"), Arg("ptr", f"value:{shared}"),
              Arg("ptr", f"value:{residual}"), Arg("ptr", f"value:{out}")))]
