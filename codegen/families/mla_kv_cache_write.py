"""mla_kv_cache_write: kv_a_layernorm + rope on k + the paged-cache write, one CTA per token."""
from __future__ import annotations

from codegen.kernel import Arg, KernelLaunch
from codegen.render import kernel_name

from ._dense_util import (ELEM_BYTES, act_ctype, block_threads_for_row, const_ref, inner_dims, node_io,
                          rope_params, rope_tag)

FAMILY = "mla_kv_cache_write"
TEMPLATE = "mla_kv_cache_write.cu.j2"
OPS = ("mla_kv_cache_write",)


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    (C,) = inner_dims(G, ins[0])
    (R,) = inner_dims(G, ins[1])
    rp = rope_params(G, data["attrs"]["pairs"], data["attrs"]["output"])
    threads = block_threads_for_row(C, ELEM_BYTES[opts.dtype], lo=64)
    params = {"act": act_ctype(opts), "C": C, "R": R, "threads": threads, **rp}
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE,
        name=kernel_name(FAMILY, [opts.dtype, f"c{C}_r{R}", rope_tag(rp)]),
        params=params, nodes=(nid,), grid=("T", 1, 1), block=(threads, 1, 1),
        args=(Arg("ptr", f"value:{ins[0]}"), Arg("i64", f"stride:{ins[0]}:0"),
              Arg("ptr", f"value:{ins[1]}"), Arg("i64", f"stride:{ins[1]}:0"),
              Arg("ptr", f"weight:{w['norm']}"), Arg("ptr", "ctx:positions"), Arg("ptr", "ctx:slot_mapping"),
              Arg("ptr", f"value:{outs[0]}"), Arg("ptr", f"value:{outs[1]}"), Arg("ptr", "ctx:kv_cache"),
              Arg("f32", const_ref(data["attrs"]["eps"])), Arg("i32", "size:T")))]
