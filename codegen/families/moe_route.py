"""moe_route: x [T, D] -> ids [T, K], weights [T, K] fp32, routing; three launches.

  1. router GEMV   logits [T, E] = x.float() @ gate.T in fp32 (workspace), EPB experts x TT
                   tokens per CTA, so decode (T = 1) spreads the fp32 gate over E / EPB CTAs
                   instead of one CTA reading it all;
  2. top-k         scoring (softmax | sigmoid), group selection, top-k, normalisation and
                   scaling, one warp per token (the moe_topk kernel, templates/moe_topk.cu.j2);
  3. align         counts, scan and scatter of the pairs by expert in one CTA (the moe_align
                   kernel).
No device-to-host copy: the grouped expert kernels read the routing from device memory.
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, Options, Workspace, WorkspaceRef, inp, size, weight, work
from codegen.render import kernel_name

from . import _moe

FAMILY = "moe_route"
TEMPLATE = "moe_route.cu.j2"
OPS = ("moe_route",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)

GEMV_THREADS = 256
EXPERTS_PER_CTA = 2
TOKENS_PER_CTA = 8


def lower(nid: str, G, opts: Options) -> list[KernelLaunch]:
    attrs, (x,), (ids, weights, routing), bound = _moe.node_io(G, nid)
    dt, ct = _moe.act(nid, opts)
    E, D = attrs["num_experts"], _moe.inner(G, nid, x)
    _moe.require_dense(G, nid, x)
    bias = bound.get("bias")

    gemv = {"stage": "router_gemv", "act": ct, "E": E, "D": D, "epb": EXPERTS_PER_CTA,
            "tt": TOKENS_PER_CTA, "threads": GEMV_THREADS, "vec": _moe.vec_width(D, 4)}
    logits = Workspace("router_logits", ("T", E), "f32")
    launches = [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [dt, f"e{E}_d{D}", "gemv"]),
        params=gemv, nodes=(nid,), grid=(-(-E // EXPERTS_PER_CTA), f"cdiv(T, {TOKENS_PER_CTA})", 1),
        block=(GEMV_THREADS, 1, 1),
        args=(inp("x", ct, x), weight("gate", "float", bound["gate"]),
              work("logits", "float", "router_logits"), size("num_tokens", "T")),
        workspace=(logits,), stage="router_gemv")]

    topk = {"stage": "topk", **_moe.topk_params(nid, attrs, E, bias is not None)}
    launches.append(_moe.topk_launch(
        FAMILY, TEMPLATE, kernel_name(FAMILY, [*_moe.topk_name_parts(topk), "topk"]), topk, nid,
        WorkspaceRef("router_logits"), bias, ids, weights, workspace=(logits,), stage="topk"))

    align = {"stage": "align", **_moe.align_params(E)}
    launches += _moe.align_launches(FAMILY, TEMPLATE, kernel_name(FAMILY, [f"e{E}", "align"]), align,
                                    nid, ids, routing, stage="align")
    return launches
