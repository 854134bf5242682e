"""moe_align: expert ids [T, K] -> routing: pairs grouped by expert (order [NP] i32) and each
expert's start (offsets [E + 1] i32), in one CTA, or above moe.align_parallel_above pairs in
three launches (count, scan, scatter).  The same kernels are stage 3 of moe_route."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, Options
from codegen.render import kernel_name

from . import _moe

FAMILY = "moe_align"
TEMPLATE = "moe_align.cu.j2"
OPS = ("moe_align",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, (ids,), (routing,), _ = _moe.node_io(G, nid)
    E = attrs["num_experts"]
    _moe.require_dense(G, nid, ids)
    _moe.check_experts(nid, E, 1)
    p = _moe.align_params(E)
    return _moe.align_launches(FAMILY, TEMPLATE, kernel_name(FAMILY, [f"e{E}"]), p, nid, ids, routing, opts)
