"""moe_combine_residual: [eo [NP, D], w [T, K], shared [T, D], residual [T, D]] ->
residual + round(round(sum_k w * eo) + shared), with the unfused chain's rounding points.

With shared_experts S > 0 (ir/passes/fuse_shared_experts.py) the inputs are [eo, w, residual]: a
token's last S of its K pairs are the shared experts, whose rows' rounded sum is `shared`."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, Options
from codegen.render import kernel_name

from . import _moe

FAMILY = "moe_combine_residual"
TEMPLATE = "moe_combine_residual.cu.j2"
OPS = ("moe_combine_residual",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, ins, (y,), _ = _moe.node_io(G, nid)
    eo, w, shared, residual = _moe.combine_inputs(attrs, ins)
    D, K = _moe.inner(G, nid, eo), _moe.inner(G, nid, w)
    _moe.require_dense(G, nid, *ins)
    p = {**_moe.combine_params(nid, opts, D=D, K=K), "S": _moe.combine_shared(attrs)}
    shared_arg = () if shared is None else (inp("shared", p["act"], shared),)
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"k{K}_d{D}", *_moe.shared_tag(p)]),
        params=p, nodes=(nid,), grid=_moe.combine_grid(p), block=(p["threads"], 1, 1),
        args=(inp("eo", p["act"], eo), inp("w", "float", w), *shared_arg,
              inp("residual", p["act"], residual), out("out", p["act"], y)))]


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)
