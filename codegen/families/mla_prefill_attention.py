"""mla_prefill_attention: flash-style causal attention over each packed prompt's own
decompressed keys ([kv_nope | k_rot], N + R wide) and values (V wide); fp32 online softmax.
Grid: (query tiles of the longest prompt, heads, sequences)."""
from __future__ import annotations

from codegen.kernel import Arg, KernelLaunch
from codegen.render import kernel_name

from ._dense_util import act_ctype, const_ref, dims, inner_dims, node_io

FAMILY = "mla_prefill_attention"
TEMPLATE = "mla_prefill_attention.cu.j2"
OPS = ("mla_prefill_attention",)

BM = BN = 32
THREADS = 256


def smem_bytes(N: int, R: int, V: int) -> int:
    dk = (N + R) | 1
    return (BM * dk + BN * dk + BN * (V | 1) + BM * (BN + 1)) * 4


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    H, N = inner_dims(G, ins[0])
    _, R = inner_dims(G, ins[1])
    V = dims(G)["v_head_dim"]
    smem = smem_bytes(N, R, V)
    params = {"act": act_ctype(opts), "H": H, "N": N, "R": R, "V": V, "smem": smem}
    scale = G.graph["model"].softmax_scale
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"h{H}_n{N}_r{R}_v{V}"]),
        params=params, nodes=(nid,), grid=(f"cdiv(MAXQ, {BM})", H, "B"), block=(THREADS, 1, 1), smem=smem,
        args=(Arg("ptr", f"value:{ins[0]}"), Arg("i64", f"stride:{ins[0]}:0"), Arg("i64", f"stride:{ins[0]}:1"),
              Arg("ptr", f"value:{ins[1]}"), Arg("i64", f"stride:{ins[1]}:0"), Arg("i64", f"stride:{ins[1]}:1"),
              Arg("ptr", f"value:{ins[2]}"), Arg("i64", f"stride:{ins[2]}:0"),
              Arg("ptr", f"value:{ins[3]}"), Arg("i64", f"stride:{ins[3]}:0"),
              Arg("ptr", "ctx:query_start"), Arg("ptr", "ctx:positions"), Arg("ptr", f"value:{outs[0]}"),
              Arg("f32", const_ref(scale))))]
