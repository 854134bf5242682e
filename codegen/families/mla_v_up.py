"""mla_v_up: o_lat [T, H, C] -> o [T, H*V] = o_lat @ W_UV^T per head (W_UV: the V half of kv_b).

CTA = (token chunk, head, block of NWARPS * RPW weight rows); the rows are loaded once into
registers and reused for every TT-token tile of the chunk; at most TCH chunks, so W_UV is
read at most TCH times (L2 after the first) whatever T is.

Alignment: the weight rows are loaded as 16-byte vectors only when C is a whole number of
vectors (vec16) and kv_b is 16-byte aligned (checked once per CTA); o_lat (a view at any
offset) is read element by element, the output written element by element."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, size, stride, weight
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, act_ctype, dims, inner_dims, node_io, vec16

FAMILY = "mla_v_up"
TEMPLATE = "mla_v_up.cu.j2"
OPS = ("mla_v_up",)

TT = 8
RPW = 2
THREADS = 256
TCH = 16                # token chunks (grid x) at most
STATIC_SMEM = 48 * 1024  # o_s [TT][CP] is a static __shared__ array: the 48 KB every device allows


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    H, C = inner_dims(G, ins[0])
    d = dims(G)
    N, V = d["qk_nope_head_dim"], d["v_head_dim"]
    eb = ELEM_BYTES[opts.dtype]
    vec = vec16(C, eb)
    rows_per_cta = (THREADS // 32) * RPW
    cp = -(-C // vec) * vec
    if TT * cp * 4 > STATIC_SMEM:
        raise LoweringError(f"mla_v_up: kv_lora_rank {C} needs {TT * cp * 4} bytes of static shared memory "
                            f"for {TT} latent rows; a CTA has {STATIC_SMEM}")
    params = {"act": act_ctype(opts), "H": H, "N": N, "V": V, "C": C, "TT": TT, "rpw": RPW,
              "threads": THREADS, "vec": vec}
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"h{H}_n{N}_v{V}_c{C}"]),
        params=params, nodes=(nid,), grid=(f"min(cdiv(T, {TT}), {TCH})", H, -(-V // rows_per_cta)), block=(THREADS, 1, 1),
        args=(inp("ol", params["act"], ins[0]), stride("ol_s0", ins[0], 0), stride("ol_s1", ins[0], 1),
              weight("kv_b", params["act"], w["kv_b"]), out("out", params["act"], outs[0]), size("T", "T")))]
