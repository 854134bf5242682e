"""mla_decode_query / mla_q_absorb: the K up-projection absorbed into the query.

mla_decode_query: [q_nope [T,H,N], q_pe [T,H,R]] -> q [T, H, C+R] = [q_nope @ W_UK | rope(q_pe)]
mla_q_absorb:     q_nope [T,H,N] -> q_lat [T, H, C] = q_nope @ W_UK
mla_decode_prologue: mla_decode_query + mla_kv_cache_write's [c, k_pe] -> [c_n, k_rot, cache rows]
                  (Tuning.attention.prologue_upto: the cache write as an extra head row of the
                  tensor-core grid; codegen/dispatch.py's decode_query table)
W_UK[h] = kv_b rows h*(N+V) .. h*(N+V)+N-1 ([N, C]). A batched skinny GEMM, two kernels:

- tensor cores (bf16 / fp16, N % 16 == 0, N <= 128, C % 32 == 0: every shipped spec):
  templates/include/mla_absorb.cuh AbsorbQuery, mma.sync swap-AB: the C columns are the MMA's M
  side, tokens its N side in TC_TOKENS tiles; CTA = (token chunk, head, TC_WARPS * 32 columns),
  each warp's [N, 32] weight slice in registers (N / 2 of them) for every token tile of its chunk.
- CUDA cores (fp32, odd dims): CTA = (token chunk, head, column block of CGB 16-byte column
  groups); the CTA's weight slice is loaded once into registers (KS row splits, RPT rows per
  thread, all loads in flight at once) and reused for every TT-token tile of its chunk.
Both take at most TCH / TC_CHUNKS token chunks (grid x), so the weight is read from memory at
most that many times (L2 after the first) whatever T is. Both keep the PDL contract (pdl.cuh):
weights are loaded before pdl_wait, activations after.

kv_b in FP8 (fp8_e4m3_block128): the tensor-core kernel with 4-byte weight loads, each weight widened
and multiplied by its 128-block scale in registers (templates/include/mla_absorb_fp8.cuh UkWeightsFp8);
codegen/dispatch.py's decode_query rows mma_kv_fp8 / mma_fp8.  Where the tensor-core kernel does not
serve (fp32, odd dims), FP8 kv_b is a LoweringError.

Alignment (checked once per CTA, scalar fall-backs otherwise): CUDA cores load the weight's
16-byte rows when C is a whole number of vectors (vec16) and kv_b is 16-byte aligned; q_nope,
q_pe (views at any offset) and the output element by element. Tensor cores load 8-byte weight
runs when kv_b is 8-byte aligned, stage q_nope rows with 16-byte cp.async when the view and its
strides are 16-byte aligned, and store 8-byte output runs when out is 8-byte aligned.
"""
from __future__ import annotations

from codegen import dispatch
from codegen.kernel import KernelLaunch, ctx, inp, out, size, stride
from codegen.render import kernel_name
from codegen.sizes import only_above, only_below
from ir.formats import FP8, UNSCALED

from ._absorb import dtype_part, kv_b_args, kv_b_format, token_chunks
from ._dense_util import (ELEM_BYTES, LoweringError, act_ctype, c_float, dims, inner_dims, node_io, rope_params,
                          rope_tag, vec16)
from .mla_kv_cache_write import kv_write_args, kv_write_launch

FAMILY = "mla_decode_query"
TEMPLATE = "mla_decode_query.cu.j2"
OPS = ("mla_decode_query", "mla_q_absorb", "mla_decode_prologue")
WEIGHT_FORMATS = (*UNSCALED, FP8.name)   # FP8 kv_b: the tensor-core kernel (codegen/lower.py checks)

TT = 4
MAX_CGB = 16            # 16-byte column groups per CTA (128 columns at bf16)
TARGET_THREADS = 256
MAX_RPT = 8             # weight rows per thread (registers: RPT * VEC floats)
TCH = 16                # token chunks (grid x) at most
STATIC_SMEM = 48 * 1024  # q_s + red are static __shared__ arrays: the 48 KB every device allows
PDL = True

# mla_decode_prologue (the query and its cache write in one op): up to attention.prologue_upto
# tokens the cache rows are written by an extra head row of the tensor-core query's grid (one
# launch); above it, and wherever the CUDA-core query serves, by mla_kv_cache_write's own kernel
# (one CTA a token: the extra row's few CTAs would walk many tokens one after another).

TC_TOKENS = 32           # tokens per tile: 4 n8 tiles, 32 accumulators per thread
TC_WARPS = 4             # warps per CTA (32 columns each) at most: 4 -> 64 CTAs a token chunk at V2-Lite
TC_CHUNKS = 8            # token chunks (grid x) at most
TC_MAX_N = 128           # qk_nope_head_dim at most: a warp holds N / 2 weight registers


def _static_smem(N: int, ks: int, cgb: int, vec: int) -> int:
    """Bytes of q_s [TT][N] + red [KS][TT][COLS] (floats) in the template."""
    return ks * TT * cgb * vec * 4 + TT * N * 4


def _tc_pitch(N: int) -> int:
    """Staged q_nope row pitch (elements) of AbsorbQuery::NP: N padded to an odd multiple of 16."""
    return N + ((16 - N % 32) + 32) % 32


def tensor_core_params(N: int, C: int, dtype: str) -> dict | None:
    """AbsorbQuery's template params, or None where the CUDA-core kernel serves (fp32, or dims
    the mma tiling does not cover)."""
    if dtype not in ("bf16", "fp16") or N % 16 or N > TC_MAX_N or C % 32:
        return None
    wpc = max(w for w in range(1, TC_WARPS + 1) if (C // 32) % w == 0)   # no warp past column C
    return {"TN": TC_TOKENS, "wpc": wpc, "threads": 32 * wpc, "smem_bytes": TC_TOKENS * _tc_pitch(N) * 2}


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    op = data["op"]
    H, N = inner_dims(G, ins[0])
    d = dims(G)
    C, V, R = d["kv_lora_rank"], d["v_head_dim"], d["qk_rope_head_dim"]
    has_rope = op != "mla_q_absorb"
    prologue = op == "mla_decode_prologue"
    tc = tensor_core_params(N, C, opts.dtype)
    fp8, rows = kv_b_format(G, nid, w["kv_b"], opts, "mla_decode_query", tc is not None)
    if tc is not None:
        params = {"act": act_ctype(opts), "H": H, "N": N, "V": V, "C": C, "R": R,
                  "out_w": C + R if has_rope else C, "has_rope": has_rope, "mma": True, "kv_write": prologue,
                  "fp8": fp8, **tc}
        grid = (token_chunks(TC_TOKENS, TC_CHUNKS), H, C // (32 * tc["wpc"]))
        tag = f"mma_t{tc['TN']}_w{tc['wpc']}"
        if not prologue:
            return [_launch(nid, G, opts, params, grid, tc["threads"], tag)]
        upto = max((hi for _, hi in dispatch.row_range(rows, "mma_kv_fp8" if fp8 else "mma_kv")), default=0)
        params.update(kv_tokens=upto, eps=c_float(data["attrs"]["eps"]))
        grid = (grid[0], f"{H} + {only_below(upto)}", grid[2])
        kv_args = kv_write_args(opts, ins[2:], outs[1:], w["norm"], params["act"], "norm_w", positions=False)
        return [_launch(nid, G, opts, params, grid, tc["threads"], tag + "_kv", kv_args),
                kv_write_launch(nid, G, opts, ins[2:], outs[1:], w["norm"], data["attrs"],
                                grid=(f"T * {only_above(upto)}", 1, 1))]
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
    params = {"act": act_ctype(opts), "H": H, "N": N, "V": V, "C": C, "R": R,
              "out_w": C + R if has_rope else C, "TT": TT, "vec": vec, "cgb": cgb, "ks": ks,
              "has_rope": has_rope, "mma": False, "fp8": False}
    grid = (f"min(cdiv(T, {TT}), {TCH})", H, -(-cg // cgb))
    launches = [_launch(nid, G, opts, params, grid, cgb * ks, None)]
    if prologue:   # the CUDA-core query has no cache-write row: the cache write's own kernel
        launches.append(kv_write_launch(nid, G, opts, ins[2:], outs[1:], w["norm"], data["attrs"]))
    return launches


def _launch(nid, G, opts, params: dict, grid, threads: int, variant: str | None, extra: tuple = ()) -> KernelLaunch:
    """The launch of either kernel: the same arguments (and extra: the prologue's cache write);
    the name tells the tensor-core variant apart."""
    data, ins, outs, w = node_io(G, nid)
    has_rope = params["has_rope"]
    H, N, C, R = params["H"], params["N"], params["C"], params["R"]
    parts = [dtype_part(opts.dtype, params["fp8"]), f"h{H}_n{N}_c{C}"]
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
    if variant:
        parts += [variant]
    args += [*kv_b_args(w["kv_b"], act, params["fp8"]), out("out", act, outs[0]), *extra, size("T", "T")]
    return KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, parts), params=params, nodes=(nid,),
        grid=grid, block=(threads, 1, 1), args=tuple(args))


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per head (its q_nope and q_pe rows in,
    its absorbed query out), and where the launch also writes the cache (the mma_kv row of CTAs) one
    more task for that: c and k_pe in, c_n, k_rot and every sequence's new cache row out."""
    p = launch.params
    H = p["H"]
    heads = ["qn", "qp"] if p["has_rope"] else ["qn"]
    ins = [tiling.value_of(launch, a) for a in heads]
    q = tiling.value_of(launch, "out")
    tiles = [tiling.tile(h, [tiling.box(v, None, (h, h + 1)) for v in ins], [tiling.box(q, None, (h, h + 1))])
             for h in range(H)]
    if p.get("kv_write") and tiling.eval(launch.grid[1]) > H:
        c, k_pe, c_n, k_rot = (tiling.value_of(launch, a) for a in ("c", "k_pe", "c_n", "k_rot"))
        rows = [tiling.cache_rows(launch, b, tiling.context - 1, tiling.context) for b in range(tiling.B)]
        tiles.append(tiling.tile("kv", [tiling.whole(c), tiling.whole(k_pe)],
                                 [tiling.whole(c_n), tiling.whole(k_rot), *rows]))
    return tiles
