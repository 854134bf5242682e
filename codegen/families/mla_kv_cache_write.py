"""mla_kv_cache_write: kv_a_layernorm + rope on k + the paged-cache write, one CTA per token
(templates/include/mla_kv_write.cuh).

Alignment: c, c_n, the norm weight and the cache row go through dsg::RowLayout, whose 16-byte
path needs C to be a whole number of vectors (compile time) and checks each row pointer at run
time (once per CTA; c is a view at any offset, the cache row starts at slot * (C + R)), falling
back to scalars; k_pe / k_rot and the cache row's rope part are element by element."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, ctx, inp, out, size, stride, weight
from codegen.render import kernel_name

from ._dense_util import (ELEM_BYTES, act_ctype, block_threads_for_row, c_float, inner_dims, node_io,
                          rope_params, rope_tag)

FAMILY = "mla_kv_cache_write"
TEMPLATE = "mla_kv_cache_write.cu.j2"
OPS = ("mla_kv_cache_write",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    return [kv_write_launch(nid, G, opts, ins, outs, w["norm"], data["attrs"])]


def kv_write_launch(nid, G, opts, ins, outs, norm_weight: str, attrs: dict, grid=("T", 1, 1)) -> KernelLaunch:
    """The launch for node nid's cache write: ins = (c, k_pe), outs = (c_n, k_rot, state).  Also
    mla_decode_prologue's (codegen/families/mla_decode_query.py), there above its fused token range."""
    (C,) = inner_dims(G, ins[0])
    (R,) = inner_dims(G, ins[1])
    params = kv_write_params(G, opts, C, R, attrs)
    act = params["act"]
    return KernelLaunch(
        family=FAMILY, template=TEMPLATE,
        name=kernel_name(FAMILY, [opts.dtype, f"c{C}_r{R}", rope_tag(params)]),
        params=params, nodes=(nid,), grid=grid, block=(params["threads"], 1, 1),
        args=(*kv_write_args(opts, ins, outs, norm_weight, act, "w"), size("T", "T")))


def kv_write_params(G, opts, C: int, R: int, attrs: dict) -> dict:
    return {"act": act_ctype(opts), "C": C, "R": R, "threads": block_threads_for_row(C, ELEM_BYTES[opts.dtype], lo=64),
            "eps": c_float(attrs["eps"]), **rope_params(G, attrs["pairs"], attrs["output"])}


def kv_write_args(opts, ins, outs, norm_weight: str, act: str, w_name: str, positions: bool = True) -> tuple:
    """The cache write's arguments (kv_cache_write_token in templates/include/mla_kv_write.cuh);
    positions=False where the kernel already takes them (the query's rope)."""
    return (inp("c", act, ins[0]), stride("c_stride", ins[0], 0),
            inp("k_pe", act, ins[1]), stride("k_stride", ins[1], 0),
            weight(w_name, act, norm_weight), *((ctx("positions", "positions"),) if positions else ()),
            ctx("slots", "slot_mapping"),
            out("c_n", act, outs[0]), out("k_rot", act, outs[1]), ctx("cache", "kv_cache", act, writes=True))


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)
