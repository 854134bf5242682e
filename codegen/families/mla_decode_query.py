"""mla_decode_query / mla_q_absorb: the K up-projection absorbed into the query.

mla_decode_query: [q_nope [T,H,N], q_pe [T,H,R]] -> q [T, H, C+R] = [q_nope @ W_UK | rope(q_pe)]
mla_q_absorb:     q_nope [T,H,N] -> q_lat [T, H, C] = q_nope @ W_UK
W_UK[h] = kv_b rows h*(N+V) .. h*(N+V)+N-1 ([N, C]). A batched skinny GEMM: CTA = (token
chunk, head, column block of CGB 16-byte column groups); the CTA's weight slice is loaded
once into registers (KS row splits, RPT rows per thread, all loads in flight at once) and
reused for every TT-token tile of its chunk. At most TCH token chunks, so the weight is
read from memory at most TCH times (L2 after the first) whatever T is.

Alignment: the only vector loads are the weight's 16-byte rows, taken when C is a whole number
of vectors (vec16: every row h*(N+V)+n of W_UK then starts at a multiple of VEC elements, and
so does every column group) and the kernel finds kv_b 16-byte aligned (once per CTA); q_nope,
q_pe (views at any offset) and the output are read / written element by element.
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, ctx, inp, out, size, stride, weight
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, act_ctype, dims, inner_dims, node_io, rope_params, rope_tag, vec16

FAMILY = "mla_decode_query"
TEMPLATE = "mla_decode_query.cu.j2"
OPS = ("mla_decode_query", "mla_q_absorb")

TT = 4
MAX_CGB = 16            # 16-byte column groups per CTA (128 columns at bf16)
TARGET_THREADS = 256
MAX_RPT = 8             # weight rows per thread (registers: RPT * VEC floats)
TCH = 16                # token chunks (grid x) at most
STATIC_SMEM = 48 * 1024  # q_s + red are static __shared__ arrays: the 48 KB every device allows


def _static_smem(N: int, ks: int, cgb: int, vec: int) -> int:
    """Bytes of q_s [TT][N] + red [KS][TT][COLS] (floats) in the template."""
    return ks * TT * cgb * vec * 4 + TT * N * 4


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    op = data["op"]
    H, N = inner_dims(G, ins[0])
    d = dims(G)
    C, V, R = d["kv_lora_rank"], d["v_head_dim"], d["qk_rope_head_dim"]
    eb = ELEM_BYTES[opts.dtype]
    vec = vec16(C, eb)
    cg = -(-C // vec)
    cgb = min(cg, MAX_CGB)
    ks = max(1, TARGET_THREADS // cgb)
    ks = max(ks, -(-N // MAX_RPT))
    while (cgb * ks > 1024 or _static_smem(N, ks, cgb, vec) > STATIC_SMEM) and cgb > 1:
        cgb //= 2
    if cgb * ks > 1024 or _static_smem(N, ks, cgb, vec) > STATIC_SMEM:
        raise LoweringError(f"{op}: qk_nope_head_dim {N} needs {ks} row splits of at most {MAX_RPT} rows "
                            f"({cgb * ks} threads, {_static_smem(N, ks, cgb, vec)} bytes of static shared memory); "
                            f"a CTA has at most 1024 threads and {STATIC_SMEM} bytes")
    has_rope = op == "mla_decode_query"
    params = {"act": act_ctype(opts), "H": H, "N": N, "V": V, "C": C, "R": R,
              "out_w": C + R if has_rope else C, "TT": TT, "vec": vec, "cgb": cgb, "ks": ks,
              "has_rope": has_rope}
    parts = [opts.dtype, f"h{H}_n{N}_c{C}"]
    act = params["act"]
    args = [inp("qn", act, ins[0]), stride("qn_s0", ins[0], 0), stride("qn_s1", ins[0], 1)]
    if has_rope:
        rp = rope_params(G, data["attrs"]["pairs"], data["attrs"]["output"])
        params.update(rp)
        parts += [f"r{R}", rope_tag(rp)]
        args += [inp("qp", act, ins[1]), stride("qp_s0", ins[1], 0), stride("qp_s1", ins[1], 1),
                 ctx("positions", "positions")]
    else:
        parts += ["absorb"]
    args += [weight("kv_b", act, w["kv_b"]), out("out", act, outs[0]), size("T", "T")]
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, parts), params=params, nodes=(nid,),
        grid=(f"min(cdiv(T, {TT}), {TCH})", H, -(-cg // cgb)), block=(cgb * ks, 1, 1), args=tuple(args))]
