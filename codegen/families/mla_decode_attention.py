"""mla_decode_attention: paged attention over the compressed [c_n | k_rot] cache rows, in one launch.

Work item = (token, group of up to 16 heads); its visible rows are cut into S * G contiguous KV
splits, one CTA each, and the splits are merged inside the same launch (templates/include/
mla_decode.cuh): each S consecutive splits form one thread-block cluster and merge their partials
through distributed shared memory; with G > 1 clusters an item's clusters then merge through a
workspace in L2, the last CTA to arrive (self-resetting tickets) writing the output. S is a
compile-time constant of each kernel (the cluster size, so clusters pack onto the GPCs as tightly as
S allows) and G a runtime one (the grid's size over items * S); the lowering emits one launch per
S, of which exactly one has a non-empty grid at run time: a grid factor of size expressions, no host
sync, so a captured decode graph holds one attention kernel per layer.

Tensor cores (split_choice): aim for one CTA per SM (CTAS_PER_SM) and never more than one split per
64-row tile of the longest context; of the cluster sizes Variant.cluster, 2 and 1, take the one that
reaches the most splits with at most GMAX clusters an item (the level-2 merge reads G records) and
no more clusters than the GPU holds at once (cluster_capacity: clusters of 4 or 8 one-SM CTAs are
counted on half the SMs, as the H200 holds 15 clusters of 8 / 30 of 4 on its 132 SMs; clusters of 2
on all of them, 66); ties go to the larger cluster (the cheaper merge). One token at ctx 4096: 8 x 8
splits of one tile on 64 SMs; 32 tokens: clusters of 2, 2 of them an item (32 clusters of 4 took
two waves). CUDA cores keep one cluster an item (G = 1) with S about WAVES * SMS CTAs.
Clusters need sm_90; for older archs S == 1 and G alone splits.

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
- level-2 records (f32 workspace rows of rec_floats): float4 columns when C % 32 == 0 (SPAN % 4 == 0,
  REC % 4 == 0; the runtime's workspaces are 16-byte aligned allocations).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from codegen.kernel import KernelLaunch, Workspace, ctx, inp, out, size, stride, work
from codegen.render import kernel_name
from codegen.tuning import DEFAULT_TUNING

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
GMAX = 8                # most clusters an item (mla_decode.cuh SplitMerge::GMAX: the level-2 merge reads G records)
TICKETS = 1024          # level-2 ticket counters, one per (item, split of a cluster) (SplitMerge::TICKETS)

# Shared memory per SM on sm_90 (228 KB) and what the hardware keeps per resident CTA (1 KB).
_SM_SMEM = 228 * 1024
_CTA_RESERVED = 1024


@dataclass(frozen=True)
class Variant:
    """The tensor-core split's shape and the split policy's bound (Tuning.attention.decode_*). warps = 8: 64-row tiles, 256 threads, ~220 registers (the queries
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


DEFAULT = Variant(DEFAULT_TUNING.attention.decode_warps, DEFAULT_TUNING.attention.decode_stages,
                  DEFAULT_TUNING.attention.decode_cluster)
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


def split_target(NG: int, cs: int) -> str:
    """The CUDA-core split policy: X, the splits per (token, head group) the step could use, about
    WAVES * SMS CTAs and at most one split per 64 rows of the longest context, clamped to [1, cs];
    the split count S is the power of two at or below X (one cluster an item). Tensor cores:
    split_choice."""
    if cs == 1:
        return "1"
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


def rec_floats(C: int, HG: int, S: int) -> int:
    """SplitMerge::REC: a level-2 record, the cluster's (max, sum) per head and its columns, each
    padded to 16 bytes."""
    return -(-2 * HG // 4) * 4 + -(-HG * -(-C // S) // 4) * 4


def cluster_capacity(c: int, ctas_per_sm: int) -> str:
    """Clusters of c CTAs assumed resident at once: clusters of 2 fill every SM (a TPC is two SMs);
    clusters of 4 or 8 are counted on half the SMs, since a cluster's CTAs share one GPC and the GPCs'
    sizes leave SMs over (H200, measured with bench/probe_clusters.py: 66 clusters of 2, 30 of 4,
    15 of 8 on 132 SMs; 32 clusters of 4 ran as two waves, twice the time)."""
    sms = f"{ctas_per_sm} * SMS"
    if c <= 2:
        return f"({sms}) // {c}"
    return f"({sms}) // {2 * c}"


def split_choice(NG: int, cs: int, ctas_per_sm: int = 1, kt: int = 64) -> dict[int, str]:
    """The tensor-core split policy: {S: G_S} for the cluster sizes it serves (cs, 2, 1), G_S the
    clusters an item gets with clusters of S CTAs, 0 for every S but the chosen one.

    X, the splits the step could use: one CTA per SM (ctas_per_sm), at most one per kt-row tile of
    the longest context. G_S = min(GMAX, clusters of S that fit per item (cluster_capacity), X // S),
    and 1 where the tickets (TICKETS, one per item and rank) would not cover the items. Clusters of
    cs (> 2) run where they reach as many splits as clusters of 2 (cs * G_cs >= 2 * G_2 > 0: the
    cheaper merge), clusters of 2 any other X >= 2, else one CTA an item. Without clusters (cs == 1)
    G alone splits."""
    items = f"max(1, T * {NG})"
    sms = f"{ctas_per_sm} * SMS"
    X = f"min(cdiv(MAXCTX, {kt}), max(1, ({sms}) // {items}))"

    def clusters(c: int) -> str:
        g = f"min({GMAX}, min(({cluster_capacity(c, ctas_per_sm)}) // {items}, ({X}) // {c}))"
        return f"min({g}, max(1, {TICKETS} // ({items} * {c})))"

    if cs == 1:
        return {1: f"max(1, {clusters(1)})"}
    two = f"min(1, ({X}) // 2)"
    if cs == 2:
        return {2: f"{clusters(2)} * {two}", 1: f"(1 - {two})"}
    g_cs, g_2 = clusters(cs), clusters(2)
    big = f"min(1, {g_cs}) * min(1, max(0, {cs} * {g_cs} - 2 * {g_2} + 1))"
    return {cs: f"{g_cs} * {big}", 2: f"{g_2} * (1 - {big}) * {two}", 1: f"(1 - {big}) * (1 - {two})"}


def cluster_sizes(cs: int) -> list[int]:
    """The split counts a lowering serves, largest first: cs, cs / 2, ..., 1."""
    out = [cs]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def tuned(opts) -> Variant:
    a = opts.tuning.attention
    return Variant(warps=a.decode_warps, stages=a.decode_stages, cluster=a.decode_cluster)


def lower(nid, G, opts, variant: Variant | None = None):
    v = variant or tuned(opts)
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
        NG = -(-H // HG)
        clusters = split_choice(NG, cs, per_sm, 8 * v.warps)          # {S: G_S}, one non-zero
    else:
        HG, threads, per_sm = min(H, MAX_HG), THREADS, 1
        smem_of = lambda n: smem_bytes(C, R, HG, ELEM_BYTES[opts.dtype], n)   # noqa: E731
        NG = -(-H // HG)
        X = split_target(NG, cs)
        clusters = {c: only_splits(X, c, cs) for c in cluster_sizes(cs)}   # G = 1 for the chosen S
    check_smem(f"mla_decode_attention (C {C}, R {R}, {HG} heads per CTA, {opts.dtype})", smem_of(cs), opts,
               "kv_lora_rank + qk_rope_head_dim is too wide for one cache tile in shared memory")
    parts = [opts.dtype, f"c{C}_r{R}", f"h{H}", f"page{opts.block_size}"]
    if requested != DEFAULT:
        parts.append(requested.tag)
    name = kernel_name(FAMILY, parts)
    act = act_ctype(opts)
    base = {"act": act, "C": C, "R": R, "H": H, "HG": HG, "KT": KT, "block_size": opts.block_size,
            "threads": threads, "mma": mma, "nstage": v.stages, "min_blocks": per_sm,
            "scale": c_float(G.graph["model"].softmax_scale), "gmax": GMAX, "tickets": TICKETS}
    args = (inp("q_lat", act, ins[0]), stride("ql_s0", ins[0], 0), stride("ql_s1", ins[0], 1),
            inp("q_rot", act, ins[1]), stride("qr_s0", ins[1], 0), stride("qr_s1", ins[1], 1),
            ctx("cache", "kv_cache", act), ctx("block_tables", "block_tables"), size("bt_width", "W"),
            ctx("context_lens", "context_lens"), ctx("query_start", "query_start"), ctx("positions", "positions"),
            out("out", act, outs[0]), size("T", "T"), size("B", "B"))
    launches = []
    for c, g in clusters.items():
        # S = c: G clusters of c CTAs per item, grid T * NG * c * G, empty unless S is c; with G > 1
        # a level-2 record per CTA (none at G == 1)
        ws = f"attention_partials_s{c}"
        rows = f"T * {NG * c} * ({g}) * min(1, ({g}) - 1)"
        launches.append(KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=name if c == 1 else f"{name}__s{c}",
            params={**base, "cs": c, "smem": smem_of(c), "rec": rec_floats(C, HG, c)}, nodes=(nid,),
            grid=(f"T * {NG * c} * ({g})", 1, 1), block=(threads, 1, 1), smem=smem_of(c),
            stage="single" if c == 1 else f"splits{c}", args=(*args, work("part", "float", ws)),
            workspace=(Workspace(ws, (rows, rec_floats(C, HG, c)), "f32"),)))
    return launches


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)
