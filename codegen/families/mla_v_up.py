"""mla_v_up: o_lat [T, H, C] -> o [T, H*V] = o_lat @ W_UV^T per head (W_UV: the V half of kv_b).

Two kernels:
- tensor cores (bf16 / fp16, C % 32 == 0: every shipped spec): templates/include/mla_absorb.cuh
  AbsorbVUp, mma.sync swap-AB: the V weight rows are the MMA's M side, tokens its N side in
  TC_TOKENS tiles; CTA = (token chunk, head, TC_MTILES * 16 rows), warps = m16 tiles x k slices of
  at most TC_SLICE_CHUNKS * 32 columns, each warp's weight fragment in registers (16-byte loads,
  2 * CPS of them a thread) for every token tile of its chunk; the k slices' partial sums meet in
  shared memory.
- CUDA cores (fp32, odd dims): CTA = (token chunk, head, block of NWARPS * RPW weight rows); the
  rows are loaded once into registers and reused for every TT-token tile of the chunk.
Both take at most TCH / TC_CHUNKS token chunks (grid x), so W_UV is read from memory at most
that many times (L2 after the first) whatever T is. Both keep the PDL contract (pdl.cuh):
weights are loaded before pdl_wait, o_lat after.

Alignment (checked once per CTA, scalar fall-backs otherwise): the weight rows are loaded as
16-byte vectors only when C is a whole number of vectors and kv_b is 16-byte aligned; o_lat (a
view at any offset) is read element by element by the CUDA-core kernel, staged with 16-byte
cp.async by the tensor-core one when the view and its strides allow; the output is written
element by element.

kv_b in FP8 (fp8_e4m3_block128): the tensor-core kernel with 8-byte weight loads, each weight widened
and multiplied by its 128-block scale in registers (templates/include/mla_absorb_fp8.cuh UvWeightsFp8);
codegen/dispatch.py's v_up row mma_fp8.  Where the tensor-core kernel does not serve (fp32, odd dims),
FP8 kv_b is a LoweringError.

o's e4m3 rows (Tuning.linear.v_up_fp8; ir/passes/fuse_v_up_fp8_quant.py gave the node attrs["quant"] =
"fp8" and the values o.qf8 / o.sf8): from the first T at which o_proj multiplies o FP8 x FP8 (its family's
fp8x_from: gemm_fp8's row) the node's launch is the "qf8" variant: the tensor-core kernel with a CTA a
whole head (MT = V / 16, 16-token tiles: the KS partial tiles of 128 rows fit the static 48 KB), which,
after storing o, reads back its head's 128 columns of each of its tokens and quantises them as the norms
do (templates/include/v_up_rows.cuh: norm_quant.cuh's norm_rows_fp8, quant_fp8.cuh's arithmetic); o_proj
then reads those rows and has no quantiser launch.  The same k slices and partial-sum order as the plain
kernel, so o is the same bits.  Below that T the plain launch (o alone)."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, size, stride
from codegen.render import kernel_name
from ir.formats import FP8, UNSCALED

from . import _norm_quant
from ._absorb import dtype_part, kv_b_args, kv_b_format, token_chunks
from ._dense_util import ELEM_BYTES, LoweringError, act_ctype, dims, inner_dims, node_io, vec16

FAMILY = "mla_v_up"
TEMPLATE = "mla_v_up.cu.j2"
OPS = ("mla_v_up",)
WEIGHT_FORMATS = (*UNSCALED, FP8.name)   # FP8 kv_b: the tensor-core kernel (codegen/lower.py checks)
PDL = True

TT = 8
RPW = 2
THREADS = 256
TCH = 16                # token chunks (grid x) at most
STATIC_SMEM = 48 * 1024  # o_s [TT][CP] is a static __shared__ array: the 48 KB every device allows

TC_TOKENS = 32           # tokens per tile: 4 n8 tiles, 16 accumulators per thread
TC_MTILES = 2            # m16 weight-row tiles per CTA: 2 -> 64 CTAs a token chunk at V2-Lite
TC_SLICE_CHUNKS = 4      # 32-column chunks per warp at most (k slice): 2 * 4 16-byte registers
TC_CHUNKS = 8            # token chunks (grid x) at most
ROWS_TOKENS = 16         # the qf8 variant's token tile
MAX_THREADS = 1024


def tensor_core_params(V: int, C: int, dtype: str, tokens: int = TC_TOKENS, mtiles: int = TC_MTILES) -> dict | None:
    """AbsorbVUp's template params (token tiles of `tokens`, at most `mtiles` m16 row tiles a CTA), or None
    where the CUDA-core kernel serves (fp32, C % 32 != 0, or a staged tile over the static shared memory)."""
    if dtype not in ("bf16", "fp16") or C % 32:
        return None
    nch = C // 32
    ks = -(-nch // TC_SLICE_CHUNKS)
    cps = -(-nch // ks)
    mt = min(mtiles, -(-V // 16))
    pitch = C + ((32 - C % 64) + 64) % 64              # AbsorbVUp::CP
    smem = max(tokens * pitch * 2, ks * tokens * (16 * mt + 4) * 4)
    if smem > STATIC_SMEM or 32 * mt * ks > MAX_THREADS:
        return None
    return {"TN": tokens, "mt": mt, "ks": ks, "cps": cps, "threads": 32 * mt * ks, "smem_bytes": smem}


def rows_params(V: int, C: int, dtype: str) -> dict | None:
    """The qf8 variant's params: a CTA a whole head (V % 16 == 0, one grid z), the plain kernel's k slices
    (so the same sums), 16-token tiles; None where that does not fit a CTA."""
    if V % 16:
        return None
    p = tensor_core_params(V, C, dtype, ROWS_TOKENS, V // 16)
    plain = tensor_core_params(V, C, dtype)
    return p if p and plain and (p["ks"], p["cps"]) == (plain["ks"], plain["cps"]) else None


def writes_fp8_rows(G, nid: str, opts) -> bool:
    """Whether the node's launches write o's e4m3 rows where o_proj reads them (_norm_quant.fp8_rows): the pass
    gave it the rows, Tuning.linear.v_up_fp8 is on and the qf8 variant's tiling fits."""
    V, (_, C) = dims(G)["v_head_dim"], inner_dims(G, G.nodes[nid]["inputs"][0])
    return (G.nodes[nid]["attrs"].get("quant") == "fp8" and opts.tuning.linear.v_up_fp8
            and rows_params(V, C, opts.dtype) is not None)


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    H, C = inner_dims(G, ins[0])
    d = dims(G)
    N, V = d["qk_nope_head_dim"], d["v_head_dim"]
    act = act_ctype(opts)
    tc = tensor_core_params(V, C, opts.dtype)
    fp8, _ = kv_b_format(G, nid, w["kv_b"], opts, "mla_v_up", tc is not None)
    parts = [dtype_part(opts.dtype, fp8), f"h{H}_n{N}_v{V}_c{C}"]
    args = (inp("ol", act, ins[0]), stride("ol_s0", ins[0], 0), stride("ol_s1", ins[0], 1),
            *kv_b_args(w["kv_b"], act, fp8), out("out", act, outs[0]), size("T", "T"))
    if tc is None:
        eb = ELEM_BYTES[opts.dtype]
        vec = vec16(C, eb)
        rows_per_cta = (THREADS // 32) * RPW
        cp = -(-C // vec) * vec
        if TT * cp * 4 > STATIC_SMEM:
            raise LoweringError(f"mla_v_up: kv_lora_rank {C} needs {TT * cp * 4} bytes of static shared memory "
                                f"for {TT} latent rows; a CTA has {STATIC_SMEM}")
        params = {"act": act, "H": H, "N": N, "V": V, "C": C, "TT": TT, "rpw": RPW,
                  "threads": THREADS, "vec": vec, "mma": False, "fp8": False}
        grid = (f"min(cdiv(T, {TT}), {TCH})", H, -(-V // rows_per_cta))
        return [KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, parts),
            params=params, nodes=(nid,), grid=grid, block=(THREADS, 1, 1), args=args)]

    def mma(q_params: dict, q_parts: list, q_args: tuple, factor: str | None) -> KernelLaunch:
        """The tensor-core launch; with o's e4m3 rows (q_params: _norm_quant's "quant_f8") the qf8 variant."""
        p = rows_params(V, C, opts.dtype) if q_params else tc
        chunks = token_chunks(p["TN"], TC_CHUNKS)
        return KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [*parts, f"mma_t{p['TN']}_m{p['mt']}", *q_parts]),
            params={"act": act, "H": H, "N": N, "V": V, "C": C, "mma": True, "fp8": fp8, **p, **q_params},
            nodes=(nid,), grid=(chunks if factor is None else f"{chunks} * {factor}", H, -(-V // (16 * p["mt"]))),
            block=(p["threads"], 1, 1), args=args + q_args)
    return _norm_quant.launches(G, nid, opts, H * V, mma)


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per head, reading its latent rows
    o_lat[:, h] and writing its V columns of the output."""
    H, V = launch.params["H"], launch.params["V"]
    ol, out_ = tiling.value_of(launch, "ol"), tiling.value_of(launch, "out")

    def rows(h: int) -> list:   # the qf8 launch's: head h's e4m3 bytes (V / 4 words) and its scale
        if "quant_f8" not in launch.params:
            return []
        hq, hs = tiling.value_of(launch, "hq"), tiling.value_of(launch, "hs")
        return [tiling.cols(hq, h * V // 4, (h + 1) * V // 4), tiling.cols(hs, h, h + 1)]
    return [tiling.tile(h, [tiling.box(ol, None, (h, h + 1))], [tiling.cols(out_, h * V, (h + 1) * V), *rows(h)])
            for h in range(H)]


def segment_body(launch):
    """Its task body in a persistent segment (templates/include/task_bodies.cuh): a CTA (token chunk, head,
    row block) a task, the 3-D grid as one index (grid_yz: its y and z extents); the tensor-core kernel
    with kv_b in the activation dtype.  None else."""
    p = launch.params
    if not p["mma"] or p["fp8"] or "quant_f8" in p:
        return None
    return {"kind": "v_up", **{k: p[k] for k in ("H", "N", "V", "C", "TN", "mt", "ks", "cps", "smem_bytes")},
            "grid_yz": list(launch.grid[1:])}
