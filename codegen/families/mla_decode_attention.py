"""mla_decode_attention: paged attention over the compressed [c_n | k_rot] cache rows, in one launch.

Work item = (token, group of up to 16 heads); its visible rows are cut into S contiguous KV
splits, one CTA each, and the splits are merged inside the same launch (templates/include/
mla_decode.cuh): with S >= 2 an item's S CTAs form one thread-block cluster and merge their
partials through distributed shared memory; S == 1 needs no merge. S is a compile-time constant
of each kernel (the cluster size, so clusters pack onto the GPCs as tightly as S allows), and the
lowering emits one launch per S in 8, 4, 2 (up to Variant.cluster) and 1, of which exactly one
has a non-empty grid at run time: a grid factor of the S expression, no host sync, so a captured
decode graph holds one attention kernel per layer. No workspace, no device counter: nothing to
reset between CUDA-graph replays. Clusters need sm_90; for older archs only S == 1 exists.

S follows a size expression over the step and the device's SM count ``SMS`` (a runtime size the
runner reads from the device: codegen/sizes.py DEVICE_SIZES): as many CTAs as the SMs hold at
once (tensor cores; about WAVES * SMS on CUDA cores), never more than one split per 64 rows of the
longest context, clamped to Variant.cluster (MAX_S) and rounded down to a power of two.

bf16 / fp16 with (C + R) % 32 == 0 and C % (16 * warps) == 0 (V2-Lite / V2 / V3: 512 + 64) take
the tensor-core split (MlaDecodeMma: 16 heads as the mma M dimension, 8 * warps-row tiles through
a `stages`-deep cp.async ring, the queries in registers, each warp scoring its own 8 rows, one CTA
per SM at 8 warps); fp32 and odd shapes the CUDA-core one (MlaDecode). The block-table width
comes from the runtime size ``W`` (block_tables.shape[1]).

Alignment (every vector access, checked here or in the kernel):
- cache rows: 16-byte loads (CUDA-core, only when W * elem % 16 == 0) / cp.async (tensor-core,
  (C + R) % 32 == 0) at cache + slot * W. The cache is the runtime's per-layer contiguous
  allocation; runtime/launcher.py refuses a kv_cache that is not contiguous and 16-byte aligned,
  so every row start is 16-byte aligned whenever a row is whole vectors.
- queries (strided views at any offset): 16-byte cp.async on the tensor-core path where both views
  and their head strides allow it (tested per CTA), else element loads.
- shared memory: every piece of the CUDA-core carve-up is rounded to 16 bytes (smem_bytes below
  mirrors MlaDecode::SMEM, mma_smem_bytes MlaDecodeMma::SMEM; static_asserted equal); the
  tensor-core rows are whole 16-byte chunks.
- output: 4-element stores only where C % 32 == 0 and the output pointer allows it (tested at run
  time), else element stores.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from codegen.kernel import KernelLaunch, ctx, inp, out, size, stride
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, act_ctype, c_float, inner_dims, node_io

FAMILY = "mla_decode_attention"
TEMPLATE = "mla_decode_attention.cu.j2"
OPS = ("mla_decode_attention",)
PDL = True              # every CTA waits (griddepcontrol.wait) at entry: the kernel keeps pdl.cuh's contract

THREADS = 256           # CUDA-core split
KT = 32                 # CUDA-core tile rows (one per lane in the score phase)
MAX_HG = 16             # heads per CTA: all of them share each tile read
WAVES = 2               # CUDA-core split: aim for WAVES * SMS CTAs
MMA_HG = 16             # heads per CTA on the tensor-core path (the mma M dimension)

# Shared memory per SM on sm_90 (228 KB) and what the hardware keeps per resident CTA (1 KB).
_SM_SMEM = 228 * 1024
_CTA_RESERVED = 1024


@dataclass(frozen=True)
class Variant:
    """The tensor-core split's switchable shape and the split policy's bound (tests/gpu/perf_decode.py
    lowers several in one GPU run). warps = 8: 64-row tiles, 256 threads, ~220 registers (the queries
    live in registers), one CTA per SM; warps = 4: 32-row tiles, two CTAs per SM where shared memory
    allows. stages: cp.async ring depth (stages - 1 tiles in flight while one is computed).
    cluster: CTAs per cluster = the most KV splits of one (token, head group)."""
    warps: int = 8
    stages: int = 3
    cluster: int = 8

    def __post_init__(self):
        if self.warps not in (4, 8) or self.stages < 2 or self.cluster not in (1, 2, 4, 8):
            raise ValueError(f"unsupported mla_decode_attention variant {self}")

    @property
    def tag(self) -> str:
        return f"w{self.warps}s{self.stages}c{self.cluster}"


DEFAULT = Variant()
MAX_S = DEFAULT.cluster  # upper bound of S (the cluster: every split of an item merges on chip)

# Shared memory a CTA may have (bytes; the opt-in maximum per block) by compute capability.
_SMEM_LIMIT = {(7, 0): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024,
               (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024, (12, 0): 99 * 1024}


def compute_capability(arch: str) -> tuple[int, int]:
    digits = "".join(ch for ch in arch.removeprefix("sm_").removeprefix("compute_") if ch.isdigit())
    if len(digits) < 2:
        raise LoweringError(f"cannot read a compute capability from arch {arch!r} (expected sm_XY)")
    return int(digits[:-1]), int(digits[-1])


def smem_limit(arch: str) -> int:
    """The per-block shared-memory limit of `arch` ("sm_90", "sm_90a", ...); the arch is an
    option (part of the cache key), so this is a device fact the bundle may depend on."""
    major, minor = compute_capability(arch)
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


def cluster_size(arch: str, v: Variant = DEFAULT) -> int:
    """CTAs per cluster: thread-block clusters (and distributed shared memory) need sm_90."""
    return v.cluster if compute_capability(arch)[0] >= 9 else 1


def use_mma(C: int, R: int, dtype: str, v: Variant = DEFAULT) -> bool:
    return dtype in ("bf16", "fp16") and (C + R) % 32 == 0 and C % (16 * v.warps) == 0


def _round16(b: int) -> int:
    return -(-b // 16) * 16


def merge_bytes(C: int, HG: int, S: int) -> int:
    """SplitMerge::BYTES: (max, sum) per head, the [HG][CP] accumulators, the merge weights."""
    cp = C + 8 if C % 32 == 0 else C
    return _round16(HG * 8) + _round16(HG * cp * 4) + S * HG * 4


def mma_smem_bytes(C: int, R: int, S: int, v: Variant = DEFAULT) -> int:
    """MlaDecodeMma::SMEM: the ring of 16-byte-chunk rows, per-warp maxima, the P tile."""
    vpr = (C + R) // 8
    pitch = vpr if vpr % 8 == 0 else vpr | 1
    kt = 8 * v.warps
    ring = v.stages * kt * pitch * 16
    carve = ring + v.warps * MMA_HG * 4 + MMA_HG * (kt + 8) * 2
    return max(carve, merge_bytes(C, MMA_HG, S))


def smem_bytes(C: int, R: int, HG: int, elem: int, S: int) -> int:
    """MlaDecode::SMEM: queries, K tile, probabilities, alphas, slots (each piece 16-byte aligned),
    or the split's partial where that is larger."""
    W = C + R
    wp = (W + 1) // 2
    kph = wp if wp % 2 else wp + 1
    pp = (HG + 3) // 4 * 4
    q = _round16(HG * 2 * wp * 4)
    k = _round16(KT * 2 * kph * elem)
    return max(q + k + KT * pp * 4 + pp * 4 + KT * 8, merge_bytes(C, HG, S))


def mma_ctas_per_sm(smem: int, v: Variant = DEFAULT) -> int:
    """Resident CTAs per SM of the tensor-core split: 8 warps hold ~220 registers a thread (one
    CTA); 4 warps fit twice where shared memory allows."""
    return 2 if v.warps == 4 and 2 * (smem + _CTA_RESERVED) <= _SM_SMEM else 1


def split_target(mma: bool, NG: int, cs: int, ctas_per_sm: int = 1, kt: int = 64) -> str:
    """X, the splits per (token, head group) the step could use, clamped to [1, cs]; the split count
    S is the power of two at or below X. Tensor cores: no more CTAs than the SMs hold at once (never
    a second, tiny wave); CUDA cores: about WAVES * SMS CTAs; both at most one split per 64 rows of
    the longest context."""
    if cs == 1:
        return "1"
    if mma:
        return f"min({cs}, min(cdiv(MAXCTX, {kt}), max(1, ({ctas_per_sm} * SMS) // (T * {NG}))))"
    return f"min({cs}, min(cdiv(MAXCTX, {2 * KT}), max(1, cdiv({WAVES} * SMS, T * {NG}))))"


def only_splits(X: str, c: int, cs: int) -> str:
    """The grid factor of the launch with S = c: 1 when c <= X < 2c (S = c is the power of two at or
    below X; the largest, cs, takes X == cs), else 0."""
    if cs == 1:
        return "1"
    if c == 1:
        return f"(1 - min(1, ({X}) // 2))"
    if c == cs:
        return f"min(1, ({X}) // {c})"
    return f"(min(1, ({X}) // {c}) - min(1, ({X}) // {2 * c}))"


def cluster_sizes(cs: int) -> list[int]:
    """The split counts a lowering serves, largest first: cs, cs / 2, ..., 1."""
    out = [cs]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def lower(nid, G, opts, variant: Variant | None = None):
    v = variant or DEFAULT
    data, ins, outs, w = node_io(G, nid)
    H, C = inner_dims(G, ins[0])
    _, R = inner_dims(G, ins[1])
    if opts.block_size < 1:
        raise LoweringError(f"block_size must be >= 1, got {opts.block_size}")
    cs = cluster_size(opts.arch, v)
    mma = use_mma(C, R, opts.dtype, v)
    requested = v
    if mma:   # a shallower ring where the arch has less shared memory (sm_80: 2 stages); none: CUDA cores
        while v.stages > 2 and mma_smem_bytes(C, R, cs, v) > smem_limit(opts.arch):
            v = replace(v, stages=v.stages - 1)
        mma = mma_smem_bytes(C, R, cs, v) <= smem_limit(opts.arch)
    if mma:
        HG, threads = MMA_HG, 32 * v.warps
        smem_of = lambda n: mma_smem_bytes(C, R, n, v)   # noqa: E731
        per_sm = mma_ctas_per_sm(smem_of(cs), v)
        X = split_target(True, -(-H // HG), cs, per_sm, 8 * v.warps)
    else:
        HG, threads, per_sm = min(H, MAX_HG), THREADS, 1
        smem_of = lambda n: smem_bytes(C, R, HG, ELEM_BYTES[opts.dtype], n)   # noqa: E731
        X = split_target(False, -(-H // HG), cs)
    NG = -(-H // HG)
    check_smem(f"mla_decode_attention (C {C}, R {R}, {HG} heads per CTA, {opts.dtype})", smem_of(cs), opts,
               "kv_lora_rank + qk_rope_head_dim is too wide for one cache tile in shared memory")
    parts = [opts.dtype, f"c{C}_r{R}", f"h{H}", f"page{opts.block_size}"]
    if requested != DEFAULT:
        parts.append(requested.tag)
    name = kernel_name(FAMILY, parts)
    act = act_ctype(opts)
    base = {"act": act, "C": C, "R": R, "H": H, "HG": HG, "KT": KT, "block_size": opts.block_size,
            "threads": threads, "mma": mma, "nstage": v.stages, "min_blocks": per_sm,
            "scale": c_float(G.graph["model"].softmax_scale)}
    args = (inp("q_lat", act, ins[0]), stride("ql_s0", ins[0], 0), stride("ql_s1", ins[0], 1),
            inp("q_rot", act, ins[1]), stride("qr_s0", ins[1], 0), stride("qr_s1", ins[1], 1),
            ctx("cache", "kv_cache", act), ctx("block_tables", "block_tables"), size("bt_width", "W"),
            ctx("context_lens", "context_lens"), ctx("query_start", "query_start"), ctx("positions", "positions"),
            out("out", act, outs[0]), size("T", "T"), size("B", "B"))
    launches = []
    for c in cluster_sizes(cs):
        # S = c: c CTAs per item (one cluster), grid T * NG * c, empty unless S is c
        launches.append(KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=name if c == 1 else f"{name}__s{c}",
            params={**base, "cs": c, "smem": smem_of(c)}, nodes=(nid,),
            grid=(f"T * {NG * c} * {only_splits(X, c, cs)}", 1, 1), block=(threads, 1, 1), smem=smem_of(c),
            stage="single" if c == 1 else f"splits{c}", args=args))
    return launches
