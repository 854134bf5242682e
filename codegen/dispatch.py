"""Which kernel serves an op, by token count: one table per op with several kernels.

A table is a list of cases, tried in order; a case holds when all of its conditions hold for the
node being lowered (the activation dtype, the weight format, an arch feature such as sm_90a, and
shape facts the family computes: "16-byte rows", "fits shared memory"), and its rows then split
the token range [1, inf) among the op's variants, each with the reason it is there:

    (phase, token range, arch / feature, dtype, weight format) -> variant

The lowering asks the table (`rows`) and emits one launch per row, its grid multiplied by the
row's range factor (`codegen.sizes.token_range`): the runtime picks the launch with work from T on
the host, so one captured decode graph holds the kernel of its batch size.  `dsgraph explain`
prints `select` for a spec's nodes.  The numbers come from the compile options' Tuning
(codegen/tuning.py); the measurements behind the defaults are in docs/PERF_NOTES.md.

Weight formats: a weight stored in the activation dtype is "same"; a quantised format is one more
value of the `weight_format` condition and its rows (the grouped experts' FP8 case: its kernel, or
a "none" row that the lowering turns into a LoweringError saying what the format needs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ir.formats import FORMATS, FP8

from .errors import DsgraphError
from .tuning import DEFAULT_TUNING, Tuning

INF = None                     # a range without an upper end
PHASES = ("prefill", "decode")
DTYPES = ("bf16", "fp16", "fp32")
INT8_CHANNEL = FORMATS["int8_channel"].name   # msModelSlim's W8A8_DYNAMIC (per-channel int8, per-token int8 x)
INT_FORMATS = tuple(f.name for f in FORMATS.values() if f.storage in ("int8", "int4"))   # msModelSlim's
# the weight stored in the activation dtype; DeepSeek-V3's FP8 blocks; msModelSlim's int8 / int4 layouts
WEIGHT_FORMATS = ("same", FP8.name, *INT_FORMATS)
NONE = "none"                  # a row that no kernel serves: the lowering refuses the node


class DispatchError(DsgraphError, ValueError):
    """No row of an op's table serves the asked size (a table bug, or an op without a table)."""


@dataclass(frozen=True)
class Row:
    variant: str               # the launch (stage) that serves the range
    lo: int                    # first token count it serves
    hi: int | None             # last (INF: no end)
    reason: str

    def covers(self, t: int) -> bool:
        return t >= self.lo and (self.hi is None or t <= self.hi)

    @property
    def span(self) -> str:
        return f"{self.lo}.." + ("inf" if self.hi is None else str(self.hi))


@dataclass(frozen=True)
class Case:
    when: dict                 # condition -> required value (a tuple: any of them); {} always holds
    rows: tuple[Row, ...]
    note: str = ""             # what the case is (printed by explain)

    def holds(self, facts: dict) -> bool:
        for k, want in self.when.items():
            have = facts.get(k)
            if isinstance(want, tuple) and have not in want:
                return False
            if not isinstance(want, tuple) and have != want:
                return False
        return True

    def admits(self, known: dict) -> bool:
        """It holds for the known facts whatever the open ones are: a fact `known` lacks is open, and a condition
        on it (one value, or any of a tuple of them) can be met."""
        return self.holds({k: known.get(k, want[0] if isinstance(want, tuple) else want)
                           for k, want in self.when.items()})


@dataclass(frozen=True)
class Table:
    op: str                    # the table's name (an op, or a family serving several)
    unit: str                  # what the ranges count: "tokens" (T) or "pairs" (T * (K + S))
    cases: tuple[Case, ...]
    facts: tuple[str, ...] = field(default=())   # the conditions its cases read

    def case(self, facts: dict) -> Case:
        for c in self.cases:
            if c.holds(facts):
                return c
        raise DispatchError(f"dispatch table {self.op}: no case for {facts}")


def _rows(*spec) -> tuple[Row, ...]:
    """Rows from (variant, lo, hi, reason), dropping empty ranges (lo > hi)."""
    return tuple(Row(v, lo, hi, why) for v, lo, hi, why in spec if hi is None or lo <= hi)


# -- the grouped expert GEMMs (moe_gate_up_silu, moe_gate_up, moe_down) -------------------------

def grouped_experts(t: Tuning = DEFAULT_TUNING, *, down: bool = False) -> Table:
    """Facts: dtype; weight_format; sm_90a (the target offers it); tma_rows (KD % 8 == 0: 16-byte
    rows for TMA and cp.async); decode_wgmma_fits / prefill_wgmma_fits (the kernels' shared memory
    for E experts); one_token (down's one-token launch fits one CTA an SM; the FP8 one's ring is as large,
    its tables smaller: _moe_fp8.one_token_stages); fp8_rows (KD % 16 == 0:
    16-byte FP8 rows), fp8_fits (the FP8 decode kernel's shared memory for E experts) and fp8x_fits (the
    FP8 x FP8 prefill kernel's, read where Tuning.moe.fp8_activations is on); int_rows (N even: packed
    int4's two channels a byte; per group, whole groups of KD); int_wgmma_rows / int_wgmma_fits (the int8 wgmma
    GEMM's shapes and shared memory, read where Tuning.moe.int_wgmma_above is set: _moe_gemm_int.facts)."""
    m = t.moe
    thr = None if m.prefill_wgmma_above is None else max(m.prefill_wgmma_above, m.gemv_upto)
    # decode's wgmma runs up to the prefill wgmma's threshold (256 where that is off)
    upper = max(m.decode_wgmma_from, 256 if thr is None else thr)
    gemv = "CUDA-core GEMV: each touched weight row read once at the fewest tokens"
    mma = "mma.sync: light experts on CUDA cores, the rest on tensor cores (swapped tiles for few pairs)"
    wgmma = "persistent wgmma + TMA grid: prefill's many pairs per expert"
    skinny = "decode's wgmma + TMA tiles: the pairs as wgmma's N, two CTAs an SM"
    one = f"down at one token: a ring of {m.one_token_down_stages} stages, one CTA an SM"
    sixteen = ("bf16", "fp16")
    fp8 = ("decode's wgmma + TMA tiles with FP8 weights widened to 16 bits in registers, scaled per "
           "128-block; above decode correct but re-reading weights per 32 pairs (activations kept 16-bit)")
    wint = ("integer weights x int8 activations: x's rows quantised per row by their own launch, then mma.sync "
            "s8 with the weights as M (packed int4 unpacked in registers), int32 sums (exact, bit-equal to the "
            "reference; per group: each 64-k step's exact sums times its group's scale in float32); one pass "
            "reads an expert's weights for 32 pairs: tuned for decode, above it NOT a tuned GEMM (int8 wgmma is "
            "to replace it)")
    dynamic = tuple(f for f in INT_FORMATS if FORMATS[f].activation == "token")
    int_when = {"weight_format": dynamic, "dtype": sixteen, "int_rows": True}
    iw = m.int_wgmma_above
    iwg = ("persistent int8 wgmma + TMA grid: the rows quantised per row by mma_int's quantiser launch, gathered by "
           "the routing's order, s8 x s8 -> s32 over all of K (exact, bit-equal to mma_int; packed int4 unpacked in "
           "shared memory). "
           "Per-channel int4 / int8 only: per-group int4 promotes each 256-k group with its scale, int4_channel_byte "
           "has no benchmark checkpoint (both keep mma_int)")
    cases = ([Case({**int_when, "weight_format": ("int4_channel", "int8_channel"), "sm_90a": True,
                    "int_wgmma_rows": True, "int_wgmma_fits": True},
                   _rows(("mma_int", 1, iw, wint), ("wgmma_int", iw + 1, INF, iwg)),
                   "per-channel int4 / int8 weights, 16-bit, sm_90a, int_wgmma_above")] if iw is not None else []) + [
             Case(int_when, _rows(("mma_int", 1, INF, wint)), "integer weights, 16-bit"),
             Case({"weight_format": INT_FORMATS},
                  _rows((NONE, 1, INF, "integer expert weights: per-token activations (not int8_static), bf16 or "
                                       "fp16, packed int4 with an even width, per group whole 256-groups")),
                  "other integer weights")]
    fp8_when = {"weight_format": FP8.name, "dtype": sixteen, "sm_90a": True, "fp8_rows": True, "fp8_fits": True}
    fp8x = ("FP8 x FP8 persistent wgmma + TMA grid: the input quantised to e4m3 per row per 128 columns "
            "(x once a token, down's a once a pair), fp32 promotion per 128-K block")

    def fp8_cases(when: dict, lead: tuple, note: str) -> list:
        """The FP8 weights' cases under `when`, the rows `lead` (from T = 1) before the FP8 rows."""
        lo = 1 + len(lead)
        out = []
        if m.fp8_activations and thr is not None:
            above = upper if m.fp8_activations_above is None else max(m.fp8_activations_above, lo - 1)
            # fp8_multicast: prefill's GEMM (above decode's range) on clusters of two; decode's sizes keep a
            # CTA a tile (a cluster's second row tile would mostly be empty there)
            mc = upper if m.fp8_multicast else None
            fp8x_rows = (("wgmma_fp8", above + 1, INF, fp8x),) if mc is None else \
                (("wgmma_fp8", above + 1, mc, fp8x + " (decode's sizes: a CTA a tile, no multicast)"),
                 ("wgmma_fp8_mc", max(above, mc) + 1, INF, fp8x + "; clusters of two CTAs on two row tiles of one "
                                                                  "expert, each multicasting half of a stage's weight "
                                                                  "boxes to both"))
            out.append(Case({**when, "fp8x_fits": True},
                            _rows(*lead, ("wgmma_skinny_fp8", lo, above, fp8.split(";")[0]), *fp8x_rows),
                            "FP8 weights, 16-bit, sm_90a, FP8 activations above decode" + note))
        out.append(Case(when, _rows(*lead, ("wgmma_skinny_fp8", lo, INF, fp8)), "FP8 weights, 16-bit, sm_90a" + note))
        return out

    if down and m.fp8_one_token_down and m.one_token_down_stages > 4:
        fp8_one = (f"FP8 down at one token: a ring of {2 * m.one_token_down_stages} FP8 stages (the bf16 one-token "
                   "ring's weight bytes), one CTA an SM")
        cases += fp8_cases({**fp8_when, "one_token": True}, (("wgmma_skinny_fp8_t1", 1, 1, fp8_one),),
                           ", down's one-token launch")
    cases += fp8_cases(fp8_when, (), "")
    cases += [Case({"weight_format": FP8.name}, _rows((NONE, 1, INF, "FP8 weights need sm_90a, 16-bit activations "
                                                                     "and an inner width a multiple of 16")),
                   "FP8 weights elsewhere"),
              Case({"dtype": "fp32"}, _rows(("gemv", 1, INF, "fp32 has no tensor-core path: the GEMV at every T")),
                   "fp32")]
    if m.decode_wgmma:
        t1 = down and m.one_token_down_stages > 4 and m.decode_wgmma_from == 0
        for fits in (True, False):
            above = ("wgmma", upper + 1, INF, wgmma) if fits and thr is not None else \
                ("mma", upper + 1, INF, mma + " (no prefill wgmma here)")
            when = {"dtype": sixteen, "sm_90a": True, "tma_rows": True, "decode_wgmma_fits": True,
                    "prefill_wgmma_fits": fits}
            if t1:
                cases.append(Case({**when, "one_token": True},
                                  _rows(("wgmma_skinny_t1", 1, 1, one), ("wgmma_skinny", 2, upper, skinny), above),
                                  "16-bit, sm_90a, decode's wgmma on"))
            cases.append(Case(when, _rows(("gemv", 1, m.decode_wgmma_from, gemv),
                                          ("wgmma_skinny", m.decode_wgmma_from + 1, upper, skinny), above),
                              "16-bit, sm_90a, decode's wgmma on"))
    if thr is not None:
        cases.append(Case({"dtype": sixteen, "sm_90a": True, "tma_rows": True, "prefill_wgmma_fits": True},
                          _rows(("gemv", 1, m.gemv_upto, gemv), ("mma", m.gemv_upto + 1, thr, mma),
                                ("wgmma", thr + 1, INF, wgmma)),
                          "16-bit, sm_90a, without decode's wgmma"))
    cases.append(Case({"dtype": sixteen}, _rows(("gemv", 1, m.gemv_upto, gemv), ("mma", m.gemv_upto + 1, INF, mma)),
                      "16-bit without sm_90a or 16-byte rows"))
    return Table("moe_down" if down else "moe_gate_up_silu", "tokens", tuple(cases),
                 ("dtype", "weight_format", "sm_90a", "tma_rows", "decode_wgmma_fits", "prefill_wgmma_fits",
                  "one_token", "fp8_rows", "fp8_fits", "fp8x_fits", "int_rows", "int_wgmma_rows", "int_wgmma_fits"))


def expert_ffn(t: Tuning = DEFAULT_TUNING) -> Table:
    """Decode's fused expert FFN (moe_expert_ffn).  Facts: dtype, sm_90a, and decode_wgmma (both
    halves' decode wgmma applies: the fused kernel is made of its tiles; not with FP8 weights, whose
    grouped rows are wgmma_skinny_fp8, so those run as the two launches)."""
    m = t.moe
    g = grouped_experts(t)
    upper = max(r.hi for c in g.cases for r in c.rows if r.variant == "wgmma_skinny" and r.hi is not None) \
        if m.decode_wgmma else 0
    upto = min(m.expert_ffn_upto, upper)
    two = "two_launch"
    two_why = "moe_gate_up_silu's launch, then moe_down's (their own tables)"
    return Table("moe_expert_ffn", "tokens", (
        Case({"dtype": ("bf16", "fp16"), "sm_90a": True, "decode_wgmma": True},
             _rows((two, 1, m.expert_ffn_from - 1, two_why + ": at 1-3 tokens the tiles are about one round"),
                   ("fused", m.expert_ffn_from, upto, "one persistent launch of gate_up_silu's tiles then "
                                                      "down's, taken in order from a counter: fewer part-empty rounds"),
                   (two, max(upto, m.expert_ffn_from - 1) + 1, INF, two_why)),
             "16-bit, sm_90a, decode's wgmma on"),
        Case({}, _rows((two, 1, INF, two_why)), "elsewhere")), ("dtype", "sm_90a", "decode_wgmma"))


# -- the route ------------------------------------------------------------------------------------

def route(t: Tuning = DEFAULT_TUNING) -> Table:
    r = t.route
    ft, gt = r.fused_upto, r.gemm_above
    lo = ft + 1
    if gt is None:
        rows = _rows(("fused", 1, ft, "the whole route in one launch (tickets hand each stage on)"),
                     ("router_gemv", lo, INF, "router GEMV, then top-k and align launches"))
    else:
        rows = _rows(("fused", 1, ft, "the whole route in one launch (tickets hand each stage on)"),
                     ("router_gemv", lo, gt, "router GEMV, then top-k and align launches"),
                     ("router_gemm", max(gt, ft) + 1, INF, "router logits on the tiled GEMM (x read once an "
                                                            "expert block), then top-k and align launches"))
    return Table("moe_route", "tokens", (Case({}, rows, "every target"),))


def align(t: Tuning = DEFAULT_TUNING) -> Table:
    """The route's alignment of its pairs (and moe_align's), by pair count."""
    big = t.moe.align_parallel_above
    rows = _rows(("one_cta", 1, big if big is not None else INF, "counts, scan and scatter in one CTA"),
                 *((("count_scan_scatter", big + 1, INF, "count / scan / scatter launches over 2048-pair "
                                                         "chunks"),) if big is not None else ()))
    return Table("align", "pairs", (Case({}, rows, "every target"),))


# -- dense linears and attention ----------------------------------------------------------------

def linear(t: Tuning = DEFAULT_TUNING) -> Table:
    """linear / multi_linear / gate_up_silu.  Facts: precision (the node's: fp32 for the router);
    weight_format (the node's weights': "same" or an ir/formats.py name: FP8's, msModelSlim's int8_channel);
    dtype; sm_90a (the target offers it); fp8_rows (K % 16 == 0: whole 16-byte chunks of the quantised rows);
    fp8_fits (the FP8 GEMM's shared memory); i8_rows (K % 16 == 0: 16-byte strides of the int8 weight's
    tensor map, and K < 2^17: exact int32 sums); i8_fits (the int8 GEMM's shared memory); i8_xq_fits (the
    quantised rows of Tuning.linear.i8_prologue_upto tokens fit the skinny kernel's shared memory; read only
    where that knob is on)."""
    up = t.linear.skinny_upto
    xq = min(t.linear.i8_prologue_upto, up)
    i8 = INT8_CHANNEL
    skinny = ("skinny", 1, up, "skinny kernel: each weight byte read once, tokens as the mma's N")
    chunks_upto = t.linear.fp8_chunks_upto if up else 0   # the chunks are the skinny kernel's: none without it
    fp8_chunks = ("skinny_fp8_chunks", up + 1, chunks_upto,
                  "FP8 skinny kernel in chunks of 16 tokens (grid.y; no quantiser launch): a chunk's CTAs read the "
                  "same weights as the others' at about the same time, so L2 serves the repeats")
    fp8_from = max(up, chunks_upto) + 1
    i8_skinny = ("skinny_wi8", 1, up, "int8 weights: x quantised per token by its own launch, then the skinny "
                                      "kernel's mma.sync s8 x s8 -> s32 with the weights as M (exact, bit-equal "
                                      "to the reference)")
    i8_xq = ("skinny_wi8_xq", 1, xq, "int8 weights: each CTA quantises x per token into shared memory in its "
                                     "prologue (the quantiser's arithmetic, no launch of its own), its weights "
                                     "sent towards L2 before its wait, then the skinny_wi8 product")
    i8_chunks_upto = t.linear.i8_chunks_upto if up else 0   # as the FP8 chunks: none without the skinny kernel
    i8_chunks = ("skinny_wi8_chunks", up + 1, i8_chunks_upto,
                 "int8 skinny kernel in chunks of 16 tokens (grid.y) on x's int8 rows (the quantiser's launch or the "
                 "norm's rows): a chunk's CTAs read the same weights as the others' at about the same time, so L2 "
                 "serves the repeats")
    i8_wgmma = ("i8_wgmma", max(up, i8_chunks_upto) + 1, INF,
                "int8 x int8 wgmma + TMA: x quantised per token by its own launch, exact int32 sums (wgmma "
                "s32.s8.s8), then (float(acc) * s_w) * s_x, bit-equal to the reference")
    int_mm = ("int_mm", up + 1, INF, "int8 weights where the int8 GEMM cannot run (no sm_90a, K % 16 != 0 or K >= "
                                     "2^17): NOT a tuned GEMM -- x quantised per token by torch, the exact integer "
                                     "product by torch._int_mm (float64 where its shape rules fail), then the scales")
    gemm_when = {"weight_format": i8, "dtype": ("bf16", "fp16"), "sm_90a": True, "i8_rows": True, "i8_fits": True}
    gemm_note = "int8 weights, 16-bit activations, sm_90a, K % 16 == 0 and K < 2^17"
    other_when, other_note = {"weight_format": i8, "dtype": ("bf16", "fp16")}, "int8 weights, 16-bit activations elsewhere"
    after_xq = (i8_skinny[0], xq + 1, *i8_skinny[2:])
    prologue = (Case({**gemm_when, "i8_xq_fits": True}, _rows(i8_xq, after_xq, i8_chunks, i8_wgmma),
                     gemm_note + ", x quantised in the prologue"),
                Case({**other_when, "i8_xq_fits": True}, _rows(i8_xq, after_xq, int_mm),
                     other_note + ", x quantised in the prologue")) if xq else ()
    return Table("linear", "tokens", (
        Case({"precision": "fp32"}, _rows(("library", 1, INF, "fp32 precision: cuBLAS, weights and output "
                                                              "stay float32")), "fp32 precision (the router)"),
        *((Case({"weight_format": "fp8_e4m3_block128", "sm_90a": True, "fp8_rows": True, "fp8_fits": True},
                _rows(skinny, fp8_chunks,
                      ("fp8_wgmma", fp8_from, INF, "FP8 x FP8 wgmma + TMA: x quantised per token per 128 "
                                                   "columns, fp32 promotion per 128-K block")),
                "FP8 weights, sm_90a"),) if t.linear.fp8_activations else ()),
        *prologue,
        Case(gemm_when, _rows(i8_skinny, i8_chunks, i8_wgmma), gemm_note),
        Case(other_when, _rows(i8_skinny, int_mm), other_note),
        Case({"weight_format": i8}, _rows((NONE, 1, INF, "int8 weights need bf16 or fp16 activations")),
             "int8 weights, fp32 activations"),
        Case({}, _rows(skinny, ("library", up + 1, INF, "cuBLAS GEMM (FP8 weights where the FP8 GEMM cannot run: "
                                                        "dequantised to the activation dtype every call)")),
             "activation precision")),
        ("precision", "weight_format", "dtype", "sm_90a", "fp8_rows", "fp8_fits", "i8_rows", "i8_fits",
         *(("i8_xq_fits",) if xq else ())))


def prefill_attention(t: Tuning = DEFAULT_TUNING) -> Table:
    return Table("mla_prefill_attention", "tokens", (
        Case({"dtype": ("bf16", "fp16")}, _rows((f"mma {t.attention.prefill_tile}", 1, INF,
                                                  "flash-style tensor-core tile (mma.sync), Q in registers")),
             "16-bit"),
        Case({}, _rows(("simt", 1, INF, "CUDA cores (fp32)")), "fp32")), ("dtype",))


def decode_attention(t: Tuning = DEFAULT_TUNING) -> Table:
    """Facts: mma (16-bit and the tensor-core tiling fits the row width and shared memory)."""
    a = t.attention
    return Table("mla_decode_attention", "tokens", (
        Case({"mma": True}, _rows(("mma", 1, INF, f"tensor-core split, {a.decode_warps} warps, {a.decode_stages}-stage "
                                                  f"ring; S (1, 2 or {a.decode_cluster} CTAs a cluster) and the "
                                                  f"clusters an item chosen from T and the context at run time")),
             "16-bit, tensor-core tiling fits"),
        Case({}, _rows(("simt", 1, INF, "CUDA-core split (fp32 or odd widths)")), "elsewhere")), ("mma",))


ABSORB_FP8 = "kv_b's FP8 bytes widened in registers, each weight times its 128-block scale in fp32"
ABSORB_FP8_NONE = ("FP8 kv_b needs bf16 or fp16 activations and the tensor-core tiling (N % 16 == 0, N <= 128, "
                   "C % 32 == 0)")


def decode_query(t: Tuning = DEFAULT_TUNING) -> Table:
    """mla_decode_prologue (the absorbed query and its cache write).  Facts: mma (16-bit and the
    dims fit the tensor-core tiling), weight_format (kv_b's)."""
    up = t.attention.prologue_upto
    kv = "; an extra head row of its grid writes the cache rows (one launch)"
    then = ", then mla_kv_cache_write (a CTA a token)"
    return Table("mla_decode_prologue", "tokens", (
        Case({"weight_format": FP8.name, "mma": True},
             _rows(("mma_kv_fp8", 1, up, f"tensor-core query, {ABSORB_FP8}{kv}"),
                   ("mma_fp8", up + 1, INF, f"tensor-core query, {ABSORB_FP8}{then}")),
             "FP8 kv_b, 16-bit, tensor-core tiling fits"),
        Case({"weight_format": FP8.name}, _rows((NONE, 1, INF, ABSORB_FP8_NONE)), "FP8 kv_b elsewhere"),
        Case({"mma": True}, _rows(("mma_kv", 1, up, "tensor-core query" + kv),
                                  ("mma", up + 1, INF, "tensor-core query" + then)),
             "16-bit, tensor-core tiling fits"),
        Case({}, _rows(("simt", 1, INF, "CUDA-core query, then mla_kv_cache_write")), "elsewhere")),
        ("mma", "weight_format"))


def v_up(t: Tuning = DEFAULT_TUNING) -> Table:
    """Facts: mma (16-bit and the tensor-core tiling fits), weight_format (kv_b's)."""
    return Table("mla_v_up", "tokens", (
        Case({"weight_format": FP8.name, "mma": True},
             _rows(("mma_fp8", 1, INF, f"tensor-core V up-projection, {ABSORB_FP8}")),
             "FP8 kv_b, 16-bit, tensor-core tiling fits"),
        Case({"weight_format": FP8.name}, _rows((NONE, 1, INF, ABSORB_FP8_NONE)), "FP8 kv_b elsewhere"),
        Case({"mma": True}, _rows(("mma", 1, INF, "tensor-core V up-projection, weights in registers")),
             "16-bit, tensor-core tiling fits"),
        Case({}, _rows(("simt", 1, INF, "CUDA cores")), "elsewhere")), ("mma", "weight_format"))


# -- persistent decode segments -------------------------------------------------------------------

def segments(t: Tuning = DEFAULT_TUNING) -> Table:
    """Runs of launches as one persistent launch (codegen/segments.py).  Facts: phase; segments
    (Tuning.persistent.segments).  A segment's own token range is its members' (where they all run)."""
    per_op = ("per_op", 1, INF, "a launch per op: the reference and fallback")
    return Table("segments", "tokens", (
        Case({"phase": "decode", "segments": True},
             _rows(("segment", 1, INF, "each run of launches with task bodies (norms, the MoE combine + norm, "
                                       "16-bit skinny linears, the tensor-core V up-projection) as one persistent "
                                       "launch: CTAs take the tiles in order and wait on counters")),
             "decode, persistent.segments on"),
        Case({}, _rows(per_op), "elsewhere")), ("phase", "segments"))


# -- lookups ---------------------------------------------------------------------------------------

TABLES = {
    "moe_gate_up_silu": lambda t: grouped_experts(t),
    "moe_gate_up": lambda t: grouped_experts(t),
    "moe_down": lambda t: grouped_experts(t, down=True),
    "moe_expert_ffn": expert_ffn,
    "moe_route": route,
    "align": align,
    "linear": linear,
    "multi_linear": linear,
    "gate_up_silu": linear,
    "mla_prefill_attention": prefill_attention,
    "mla_decode_attention": decode_attention,
    "mla_decode_prologue": decode_query,
    "mla_decode_query": decode_query,
    "mla_v_up": v_up,
    "segments": segments,
}


def table(op: str, tuning: Tuning = DEFAULT_TUNING) -> Table:
    if op not in TABLES:
        raise DispatchError(f"no dispatch table for op {op!r}")
    return TABLES[op](tuning)


def rows(op: str, facts: dict, tuning: Tuning = DEFAULT_TUNING) -> tuple[Row, ...]:
    """The rows of the case that holds for `facts`: the variants a lowering emits, with their ranges."""
    return table(op, tuning).case(facts).rows


def select(op: str, tokens: int, facts: dict, tuning: Tuning = DEFAULT_TUNING) -> Row:
    """The row that serves `tokens` (in the table's unit)."""
    if tokens < 1:
        raise DispatchError(f"token count must be >= 1, got {tokens}")
    for r in rows(op, facts, tuning):
        if r.covers(tokens):
            return r
    raise DispatchError(f"dispatch table {op}: no row serves {tokens}")   # a gap: the table tests refuse it


def row_range(rows_, variant: str) -> list[tuple[int, int | None]]:
    """The ranges the rows give `variant` (a variant may serve several)."""
    return [(r.lo, r.hi) for r in rows_ if r.variant == variant]
