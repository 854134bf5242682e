"""mla_decode_attention: paged attention over the compressed [c_n | k_rot] cache rows.

Two launches: `split` (CTA = token x head group x KV split; each cache row is read once
per head group into shared memory with 16-byte loads) and `combine` (merge the non-empty
splits' partial max / sum / accumulators from the workspace).

bf16 / fp16 with (C + R) % 16 == 0 and C % 64 == 0 (V2-Lite: 512 + 64) take the tensor-core
split (MlaDecodeMma: 16 heads as the mma M dimension, 32-row tiles through a 2-deep cp.async
ring, 4 warps, two CTAs per SM); fp32 and odd shapes the CUDA-core one (MlaDecode). The number
of splits S is a size expression over the step and the device's SM count ``SMS`` (a runtime size
the runner reads from the device: codegen/sizes.py DEVICE_SIZES): about WAVES CTAs per SM in all,
never more than one split per tile of the longest context, and never more than MAX_S (the
combine's compacted split list; the combine traps on a larger S instead of dropping splits).

The block-table width comes from the runtime size ``W`` (block_tables.shape[1]).

Alignment (every vector access, checked here or in the kernel):
- cache rows: 16-byte loads (CUDA-core, only when W * elem % 16 == 0) / cp.async (tensor-core,
  which requires (C + R) % 16 == 0) at cache + slot * W. The cache is the runtime's per-layer
  contiguous allocation; runtime/launcher.py refuses a kv_cache that is not contiguous and
  16-byte aligned, so every row start is 16-byte aligned whenever a row is whole vectors.
- queries (strided views at any offset): scalar loads on both paths.
- shared memory: every piece of the CUDA-core carve-up is rounded to 16 bytes (smem_bytes below
  mirrors MlaDecode::SMEM, static_asserted equal); the tensor-core pitch is C + R + 8 halves.
- workspace: float2 stores on the tensor-core path at even columns of C % 64 == 0 rows.
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, Workspace, ctx, inp, out, size, stride, work
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, act_ctype, c_float, inner_dims, node_io

FAMILY = "mla_decode_attention"
TEMPLATE = "mla_decode_attention.cu.j2"
OPS = ("mla_decode_attention",)

THREADS = 256
KT = 32                 # cache rows per tile (one per lane in the score phase)
MAX_HG = 16             # heads per CTA: all of them share each tile read
WAVES = 2               # CUDA-core split: aim for WAVES * SMS CTAs (two waves)
COMBINE_THREADS = 128
MMA_WARPS = 4
MMA_THREADS = 32 * MMA_WARPS
MMA_HG = 16             # heads per CTA on the tensor-core path (the mma M dimension)
NSTAGE = 2              # cp.async ring depth (tiles in flight per CTA)
MMA_CTAS_PER_SM = 2     # resident CTAs of the tensor-core split per SM (__launch_bounds__(128, 2), ~81 KB smem each)
# Measured on the H200 at 64 x 4096: this (4 warps, 2 stages, 2 CTAs / SM) 134 us; 8 warps,
# 4 stages, 1 CTA / SM 173 us -- more independent CTAs per SM beat a deeper ring.
MAX_S = 512             # upper bound of S on either path (the combine's shared arrays: 4 KB); the
                        # unclamped S is at most WAVES * SMS (2 per SM: 256 SMs before the clamp binds)

# Shared memory a CTA may have (bytes; the opt-in maximum per block) by compute capability.
_SMEM_LIMIT = {(7, 0): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024,
               (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024, (12, 0): 99 * 1024}


def smem_limit(arch: str) -> int:
    """The per-block shared-memory limit of `arch` ("sm_90", "sm_90a", ...); the arch is an
    option (part of the cache key), so this is a device fact the bundle may depend on."""
    digits = "".join(ch for ch in arch.removeprefix("sm_").removeprefix("compute_") if ch.isdigit())
    if len(digits) < 2:
        raise LoweringError(f"cannot read a compute capability from arch {arch!r} (expected sm_XY)")
    major, minor = int(digits[:-1]), int(digits[-1])
    if (major, minor) in _SMEM_LIMIT:
        return _SMEM_LIMIT[(major, minor)]
    if major >= 9:
        return 227 * 1024     # sm_90, sm_100: the data-centre parts
    return 48 * 1024          # unknown: the default every device has


def check_smem(what: str, smem: int, opts, hint: str) -> None:
    limit = smem_limit(opts.arch)
    if smem > limit:
        raise LoweringError(f"{what} needs {smem} bytes of shared memory per CTA, more than {opts.arch}'s "
                            f"{limit}: {hint}")


def use_mma(C: int, R: int, dtype: str) -> bool:
    return dtype in ("bf16", "fp16") and (C + R) % 16 == 0 and C % (16 * MMA_WARPS) == 0


def mma_smem_bytes(C: int, R: int) -> int:
    kp = C + R + 8
    return NSTAGE * KT * kp * 2 + MMA_WARPS * (KT // 8) * 32 * 16


def _round16(b: int) -> int:
    return -(-b // 16) * 16


def smem_bytes(C: int, R: int, HG: int, elem: int) -> int:
    """MlaDecode::SMEM: queries, K tile, probabilities, alphas, slots; each piece 16-byte aligned."""
    W = C + R
    wp = (W + 1) // 2
    kph = wp if wp % 2 else wp + 1
    pp = (HG + 3) // 4 * 4
    q = _round16(HG * 2 * wp * 4)
    k = _round16(KT * 2 * kph * elem)
    return q + k + KT * pp * 4 + pp * 4 + KT * 8


def split_count(mma: bool, NG: int) -> str:
    """S, the KV splits per (token, head group): a size expression, at most MAX_S by construction."""
    if mma:
        s = f"min(cdiv(MAXCTX, {KT}), max(1, ({MMA_CTAS_PER_SM} * SMS) // (T * {NG})))"
    else:
        s = f"min(cdiv(MAXCTX, {2 * KT}), max(1, cdiv({WAVES} * SMS, T * {NG})))"
    return f"min({MAX_S}, {s})"


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    H, C = inner_dims(G, ins[0])
    _, R = inner_dims(G, ins[1])
    if opts.block_size < 1:
        raise LoweringError(f"block_size must be >= 1, got {opts.block_size}")
    mma = use_mma(C, R, opts.dtype)
    if mma:
        HG, threads = MMA_HG, MMA_THREADS
        smem = mma_smem_bytes(C, R)
    else:
        HG, threads = min(H, MAX_HG), THREADS
        smem = smem_bytes(C, R, HG, ELEM_BYTES[opts.dtype])
    NG = -(-H // HG)
    check_smem(f"mla_decode_attention (C {C}, R {R}, {HG} heads per CTA, {opts.dtype})", smem, opts,
               "kv_lora_rank + qk_rope_head_dim is too wide for one cache tile in shared memory")
    if NG > 65535:
        raise LoweringError(f"mla_decode_attention: {H} heads make {NG} head groups, more than grid y allows (65535)")
    S = split_count(mma, NG)
    base = {"act": act_ctype(opts), "C": C, "R": R, "H": H, "HG": HG, "KT": KT,
            "block_size": opts.block_size, "threads": threads, "mma": mma, "nstage": NSTAGE, "max_s": MAX_S}
    name = kernel_name(FAMILY, [opts.dtype, f"c{C}_r{R}", f"h{H}", f"page{opts.block_size}"])
    ws = (Workspace("acc", ("T", f"{H} * ({S})", C), "f32"), Workspace("ml", ("T", f"{H} * ({S})", 2), "f32"))
    act = base["act"]
    split = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=name,
        params={**base, "stage": "split", "smem": smem, "scale": c_float(G.graph["model"].softmax_scale)},
        nodes=(nid,), grid=("T", NG, S), block=(threads, 1, 1), smem=smem, workspace=ws, stage="split",
        args=(inp("q_lat", act, ins[0]), stride("ql_s0", ins[0], 0), stride("ql_s1", ins[0], 1),
              inp("q_rot", act, ins[1]), stride("qr_s0", ins[1], 0), stride("qr_s1", ins[1], 1),
              ctx("cache", "kv_cache", act), ctx("block_tables", "block_tables"), size("bt_width", "W"),
              ctx("context_lens", "context_lens"), ctx("query_start", "query_start"), ctx("positions", "positions"),
              work("ws_acc", "float", "acc"), work("ws_ml", "float", "ml"),
              size("T", "T"), size("B", "B"), size("S", S)))
    combine = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=name + "__combine",
        params={**base, "stage": "combine", "threads": COMBINE_THREADS},
        nodes=(nid,), grid=("T", H, 1), block=(COMBINE_THREADS, 1, 1), workspace=ws, stage="combine",
        args=(work("ws_acc", "float", "acc", writes=False), work("ws_ml", "float", "ml", writes=False),
              out("out", act, outs[0]), size("T", "T"), size("S", S)))
    return [split, combine]
