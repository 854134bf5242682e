"""moe_topk: router logits [T, E] fp32 -> ids [T, K] i64, weights [T, K] fp32 (one warp per token).

Softmax or sigmoid scoring; greedy, V2 group_limited_greedy or V3 noaux_tc selection; ids in
torch.topk(sorted=True) order.  The same kernel is stage 2 of moe_route.
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, Options, ValueRef
from codegen.render import kernel_name

from . import _moe

FAMILY = "moe_topk"
TEMPLATE = "moe_topk.cu.j2"
OPS = ("moe_topk",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, (logits,), (ids, weights), bound = _moe.node_io(G, nid)
    E = _moe.inner(G, nid, logits)
    _moe.require_dense(G, nid, logits)
    bias = bound.get("bias")
    p = _moe.topk_params(nid, attrs, E, bias is not None)
    return [_moe.topk_launch(FAMILY, TEMPLATE, kernel_name(FAMILY, _moe.topk_name_parts(p)), p, nid,
                             ValueRef(logits), bias, ids, weights)]
