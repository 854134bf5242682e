"""moe_combine_residual_rms_norm: [eo [NP, D], w [T, K], shared [T, D], residual [T, D]] ->
[h = rms_norm(s), s = residual + round(round(sum_k w * eo) + shared)]: a MoE layer's combine and the
next layer's input norm (or the final norm) in one sweep over the row, one CTA per token.  The
rounding points are the unfused chain's (moe_combine_residual, then rms_norm of the rounded s).
With shared_experts S > 0 the inputs are [eo, w, residual], as moe_combine_residual's.

Above Tuning.moe.combine_stream_above tokens its "st" launches serve a prefill step instead (_combine_stream.py:
a CTA an SM slot, the tokens streamed through shared memory; the same bits)."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, size, weight
from codegen.render import kernel_name

from . import _combine_stream, _moe, _norm_quant
from ._dense_util import ELEM_BYTES, block_threads_for_row, c_float

FAMILY = "moe_combine_residual_rms_norm"
TEMPLATE = "moe_combine_residual_rms_norm.cu.j2"
OPS = ("moe_combine_residual_rms_norm",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid: str, G, opts) -> list[KernelLaunch]:
    attrs, ins, (h, s, *_), wts = _moe.node_io(G, nid)
    eo, w, shared, residual = _moe.combine_inputs(attrs, ins)
    D, K = _moe.inner(G, nid, eo), _moe.inner(G, nid, w)
    _moe.require_dense(G, nid, *ins)
    dt, ct = _moe.act(nid, opts)
    p = {"act": ct, "D": D, "K": K, "S": _moe.combine_shared(attrs),
         "threads": block_threads_for_row(D, ELEM_BYTES[dt]), "eps": c_float(attrs["eps"])}
    shared_arg = () if shared is None else (inp("shared", ct, shared),)

    def make(q_params, q_parts, q_args, factor, stream=None):
        return KernelLaunch(
            family=FAMILY, template=TEMPLATE if stream is None else _combine_stream.TEMPLATE,
            name=kernel_name(FAMILY, [opts.dtype, f"k{K}_d{D}", *_moe.shared_tag(p), *q_parts,
                                      *([] if stream is None else [_combine_stream.NAME])]),
            params={**p, **q_params, **({} if stream is None else {"stream": stream})}, nodes=(nid,),
            grid=(_norm_quant.grid(factor) if stream is None else _combine_stream.grid(stream, factor), 1, 1),
            block=(p["threads"], 1, 1), smem=0 if stream is None else stream["smem"],
            args=(inp("eo", ct, eo), inp("w", "float", w), *shared_arg, inp("residual", ct, residual),
                  weight("nw", ct, wts["weight"]), out("h", ct, h), out("s", ct, s), *q_args,
                  size("T", "T")))
    return _combine_stream.launches(G, p, ELEM_BYTES[dt], opts, make,
                                    lambda m: _norm_quant.launches(G, nid, opts, D, m))


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)


def segment_body(launch):
    """Its task body in a persistent segment (templates/include/task_bodies.cuh): one token row a task."""
    p = launch.params
    if _norm_quant.writes_rows(launch) or "stream" in p:   # the task body: one token's 16-bit rows
        return None
    return {"kind": "combine_norm", **{k: p[k] for k in ("D", "K", "S", "eps")}}
