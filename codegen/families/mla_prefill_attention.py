"""mla_prefill_attention: flash-style causal attention over each packed prompt's own
decompressed keys ([kv_nope | k_rot], N + R wide) and values (V wide); fp32 online softmax.
Grid: (query tiles of the longest prompt, heads, sequences).

bf16 / fp16: tensor cores (MlaPrefillTC: mma.sync m16n8k16, 64-row query tiles, 4 warps);
fp32: CUDA cores (MlaPrefill: 32-row query tiles, 256 threads).

Alignment: the fp32 kernel reads and writes global memory element by element. The tensor-core
kernel copies 16-byte chunks by cp.async only when N, R and V are multiples of 8 (compile time)
and every base pointer is 16-byte aligned and every row / head stride a multiple of 8 elements
(checked once per CTA); otherwise it gathers elements and stores whole 16-byte chunks to shared
rows whose pitch is a multiple of 8 halves. Its output (a fresh contiguous buffer) takes 4-byte
pair stores at even columns when V is even."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, ctx, inp, out, stride
from codegen.render import kernel_name

from ._dense_util import act_ctype, c_float, dims, inner_dims, node_io
from .mla_decode_attention import check_smem

FAMILY = "mla_prefill_attention"
TEMPLATE = "mla_prefill_attention.cu.j2"
OPS = ("mla_prefill_attention",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)

BM = BN = 32
THREADS = 256
TC_BM = TC_BN = 64
TC_THREADS = 128


def smem_bytes(N: int, R: int, V: int) -> int:
    dk = (N + R) | 1
    return (BM * dk + BN * dk + BN * (V | 1) + BM * (BN + 1)) * 4


def tc_smem_bytes(N: int, R: int, V: int) -> int:
    dkp, vp = -(-(N + R) // 16) * 16, -(-V // 16) * 16
    return (TC_BM * (dkp + 8) + TC_BN * (dkp + 8) + TC_BN * (vp + 8)) * 2


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    H, N = inner_dims(G, ins[0])
    _, R = inner_dims(G, ins[1])
    V = dims(G)["v_head_dim"]
    tc = opts.dtype in ("bf16", "fp16")
    smem = tc_smem_bytes(N, R, V) if tc else smem_bytes(N, R, V)
    check_smem(f"mla_prefill_attention (N {N}, R {R}, V {V}, {opts.dtype})", smem, opts,
               "qk_nope_head_dim + qk_rope_head_dim and v_head_dim are too wide for one query / key / value tile")
    bm, threads = (TC_BM, TC_THREADS) if tc else (BM, THREADS)
    params = {"act": act_ctype(opts), "H": H, "N": N, "R": R, "V": V, "smem": smem, "tc": tc,
              "scale": c_float(G.graph["model"].softmax_scale)}
    act = params["act"]
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"h{H}_n{N}_r{R}_v{V}", *(["mma"] if tc else [])]),
        params=params, nodes=(nid,), grid=(f"cdiv(MAXQ, {bm})", H, "B"), block=(threads, 1, 1), smem=smem,
        args=(inp("q_nope", act, ins[0]), stride("qn_s0", ins[0], 0), stride("qn_s1", ins[0], 1),
              inp("q_rot", act, ins[1]), stride("qr_s0", ins[1], 0), stride("qr_s1", ins[1], 1),
              inp("kv", act, ins[2]), stride("kv_s0", ins[2], 0),
              inp("k_rot", act, ins[3]), stride("kr_s0", ins[3], 0),
              ctx("query_start", "query_start"), ctx("positions", "positions"), out("out", act, outs[0])))]
