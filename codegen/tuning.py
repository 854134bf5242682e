"""Tuning: the knobs that change which kernel serves a size, or a kernel's tile, without changing
what it computes.  One frozen `Tuning`, a section per family group, inside the compile options
(`Options.tuning`, codegen/kernel.py): the lowering reads it, the values reach the templates as
constants, and it is part of the bundle cache key and the manifest.

    from codegen.tuning import Tuning, parse_tune
    Tuning()                                             # dsgraph's defaults
    parse_tune(["moe.expert_ffn_upto=128"])              # the CLI's --tune SECTION.KNOB=VALUE
    dataclasses.replace(t, moe=dataclasses.replace(t.moe, expert_ffn_upto=128))

Which kernel a setting selects at which token count is codegen/dispatch.py's table (printed by
`dsgraph explain`); the reasons for the defaults are the measurements in docs/PERF_NOTES.md.
A knob is "int | None" where None switches its kernel off; `none` spells it on the command line.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field

from .errors import DsgraphError


class TuningError(DsgraphError, ValueError):
    """A tuning setting dsgraph cannot take: an unknown section or knob, a value of the wrong type
    or out of range.  One line, naming the setting."""


def _knob(default, lo=None, hi=None, *, choices=None, pattern=None, doc=""):
    """A field with its bounds (inclusive) and what it means, read by validation and `explain`."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "choices": choices, "pattern": pattern,
                                            "doc": doc})


class _Section:
    """A section validates its knobs when made (a frozen dataclass: a bad value never exists)."""
    NAME = ""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check(f"{self.NAME}.{f.name}", f, getattr(self, f.name))


@dataclass(frozen=True)
class MoeTuning(_Section):
    """The grouped expert kernels (moe_gate_up_silu, moe_gate_up, moe_down, moe_expert_ffn) and the
    route's alignment.  Token counts are a step's T; pairs are T * (K + S)."""
    NAME = "moe"
    decode_wgmma: bool = _knob(True, doc="decode's expert GEMM on wgmma + TMA (sm_90a) up to prefill_wgmma_above")
    decode_wgmma_from: int = _knob(0, 0, 4096, doc="the GEMV keeps T <= this below decode's wgmma (0: none)")
    prefill_wgmma_above: typing.Optional[int] = _knob(256, 1, 1 << 20,
                                                       doc="tokens above which the persistent wgmma GEMM runs (none: never)")
    gemv_upto: int = _knob(8, 0, 4096, doc="targets without decode's wgmma: the GEMV alone up to this many tokens")
    gemm_threshold: int = _knob(2, 0, 1 << 20, doc="mma launch: experts with more pairs than this on tensor cores")
    gemm_bk: int = _knob(32, 16, 128, choices=(16, 32, 64, 128), doc="mma launch: K slice of a row tile")
    gemm_stages: int = _knob(4, 2, 8, doc="mma launch: K slices in flight")
    gemm_skinny: int = _knob(64, 0, 64, choices=(0, 16, 32, 64),
                             doc="mma launch: row tiles of at most this many pairs run swapped (0: none)")
    skinny_bk: int = _knob(64, 16, 256, choices=(16, 32, 64, 128, 256), doc="mma launch: the swapped tiles' K slice")
    skinny_stages: int = _knob(4, 2, 8, doc="mma launch: the swapped tiles' ring depth")
    decode_staged_from: int = _knob(0, 0, 64, doc="decode's wgmma: tiles of this many pairs or more store "
                                                  "through shared memory (0: none)")
    one_token_down_stages: int = _knob(8, 0, 8, doc="down at T = 1 as its own launch with this ring depth, "
                                                    "one CTA an SM (0 or <= 4: no such launch)")
    expert_ffn_from: int = _knob(4, 1, 4096, doc="decode's fused expert FFN serves T from this ...")
    expert_ffn_upto: int = _knob(256, 0, 4096, doc="... up to this (0: never; capped at decode's wgmma range)")
    expert_ffn_staged_from: int = _knob(32, 0, 64, doc="the fused expert FFN: tiles of this many pairs or more "
                                                       "store through shared memory (0: none)")
    fp8_activations: bool = _knob(True, doc="FP8 expert weights above decode's range (prefill_wgmma_above): the "
                                            "expert inputs quantised to e4m3 per row per 128 columns for the FP8 x "
                                            "FP8 grouped GEMM (DeepSeek-V3's dynamic activation scheme); false: "
                                            "decode's weight-only FP8 kernel at every T, activations kept 16-bit")
    fp8_one_token_down: bool = _knob(True, doc="FP8 expert weights: down at T = 1 as its own launch, one CTA an SM, "
                                                "its ring as deep in weight bytes as one_token_down_stages' bf16 ring "
                                                "(twice the FP8 stages; off while that is <= 4)")
    fp8_shared_before_wait: bool = _knob(True, doc="FP8 expert weights: decode's gate / up runs a shared expert's "
                                                    "tile before its PDL wait (as bf16's: while the route runs), "
                                                    "at T <= 32 (one row tile a shared expert)")
    fp8_widen_ahead: bool = _knob(True, doc="FP8 expert weights, decode: each 64-row box widened while the box "
                                             "before it (this slice's, or the last slice's) is on the tensor core")
    fp8_overlap: bool = _knob(True, doc="the FP8 x FP8 GEMMs, the experts' (fp8_activations) AND the linears' "
                                         "(gemm_fp8, linear.fp8_activations): each 128-K block's promotion (wait, "
                                         "scales, 64 FMAs, freeing its stage) runs while the next block's wgmma does, "
                                         "into a second fp32 tile (the same sums bit for bit; kernel name part ovl). "
                                         "H100: expert GEMMs at T=16384 1.06x (gate_up_silu) / 1.25x (down), prefill "
                                         "32x512 117.8k -> 124.6k tok/s")
    fp8_activations_above: typing.Optional[int] = _knob(
        16, 1, 1 << 20, doc="FP8 expert weights with fp8_activations: the FP8 x FP8 grouped GEMM above this many "
                            "tokens, decode's weight-only FP8 tiles up to it (none: up to prefill_wgmma_above, as "
                            "bf16's decode tiles). 16: H100 FP8 b=32 7.60 -> 7.11 ms, b=128 9.32 -> 8.80")
    align_parallel_above: typing.Optional[int] = _knob(6144, 0, 1 << 24,
                                                        doc="pairs above which the route aligns in count / scan / "
                                                            "scatter launches (none: one CTA always)")
    int_wgmma_above: typing.Optional[int] = _knob(
        None, choices=(16, 64, 256, 1024),
        doc="int4_channel / int8_channel expert weights, sm_90a: above this many tokens the persistent grouped int8 "
            "wgmma GEMM (moe_gemm_int.cuh: exact int32 sums of all of K, bit-equal to mma_int), mma_int up to it "
            "(none: mma_int at every T). Not yet run on a GPU")
    combine_stream_above: typing.Optional[int] = _knob(
        None, 0, 1 << 20, doc="prefill's moe_combine_residual_rms_norm above this many tokens: a CTA an SM slot "
                              "streams tokens, the next token's rows copied into shared memory (cp.async) while this "
                              "one's norm reduces; the same bits (none: a CTA a token at every T, as decode always)")
    fp8_multicast: bool = _knob(False, doc="the experts' FP8 x FP8 GEMM (fp8_activations) above decode's range "
                                           "(prefill_wgmma_above): clusters of two CTAs on two row tiles of one expert "
                                           "and one weight tile, each CTA multicasting half of every stage's weight "
                                           "boxes to both (L2 -> SM bytes a stage 32 -> 24 KB; the same sums bit for "
                                           "bit; kernel name part mc). Not yet run on a GPU")


@dataclass(frozen=True)
class RouteTuning(_Section):
    """The router (moe_route): its logits' kernel by token count."""
    NAME = "route"
    fused_upto: int = _knob(256, 0, 1 << 20, doc="the whole route in one launch up to this many tokens (0: never)")
    gemm_above: typing.Optional[int] = _knob(256, 0, 1 << 20,
                                             doc="the router logits on the tiled GEMM above this many tokens, "
                                                 "the GEMV up to it (none: GEMV always)")


@dataclass(frozen=True)
class AttentionTuning(_Section):
    """The MLA kernels: prefill attention's tile, the decode attention's split, the absorbed
    projections' prologue."""
    NAME = "attention"
    prefill_tile: str = _knob("v2_m64n64w16q", pattern=r"v2_m(\d+)n(\d+)w(16|32)([qs])(?:b(\d+))?",
                              doc="the tensor-core prefill tile: v2_m<BM>n<BN>w<16|32><q|s>[b<CTAs an SM>]")
    decode_warps: int = _knob(8, choices=(4, 8), doc="decode attention (tensor cores): warps a CTA (64- or 32-row tiles)")
    decode_stages: int = _knob(3, 2, 8, doc="decode attention (tensor cores): cp.async ring depth")
    decode_cluster: int = _knob(8, choices=(1, 2, 4, 8), doc="decode attention: the most KV splits of an item "
                                                              "(a thread-block cluster)")
    prologue_upto: int = _knob(16, 0, 4096, doc="decode's query writes the cache rows in its own grid up to "
                                                "this many tokens, mla_kv_cache_write above")


@dataclass(frozen=True)
class LinearTuning(_Section):
    """The dense linears (linear_skinny)."""
    NAME = "linear"
    skinny_upto: int = _knob(16, 0, 16, doc="the skinny kernel up to this many tokens, cuBLAS above "
                                            "(16: the kernel's two n8 tiles)")
    warps: int = _knob(8, choices=(1, 2, 4, 8, 16), doc="skinny kernel: warps a CTA (split K)")
    row_tiles: int = _knob(1, choices=(1, 2, 4), doc="skinny kernel: 16-row weight tiles a CTA")
    unroll: int = _knob(4, choices=(1, 2, 4, 8), doc="skinny kernel: weight loads in flight a thread")
    ksplit: int = _knob(1, choices=(1, 2, 4, 8), doc="skinny kernel: K split over a cluster of this many CTAs")
    i8_prologue_upto: int = _knob(4, 0, 16, doc="skinny kernel, int8 weights: up to this many tokens each CTA "
                                                "quantises x itself in its prologue (no quantiser launch; 0: never)")
    # FP8 weights (templates/include/fp8.cuh), measured on an H100 (bench/perf_linear_fp8.py): rolling x4 for
    # linear / multi_linear (two CTAs an SM), batch x1 for gate_up_silu (thousands of rows; three CTAs an SM).
    fp8_pipeline: str = _knob("rolling", choices=("rolling", "batch"),
                              doc="skinny kernel, FP8 weights, linear / multi_linear: the weight-load pipeline")
    fp8_unroll: int = _knob(4, choices=(1, 2, 4, 8), doc="skinny kernel, FP8 weights, linear / multi_linear: "
                                                          "64-k steps in flight a thread")
    fp8_silu_pipeline: str = _knob("batch", choices=("rolling", "batch"),
                                   doc="skinny kernel, FP8 weights, gate_up_silu: the weight-load pipeline")
    fp8_silu_unroll: int = _knob(1, choices=(1, 2, 4, 8), doc="skinny kernel, FP8 weights, gate_up_silu: "
                                                               "64-k steps in flight a thread")
    fp8_activations: bool = _knob(True, doc="FP8 weights above skinny_upto: x quantised to e4m3 per token per "
                                            "128 columns for the FP8 x FP8 GEMM (DeepSeek-V3's dynamic activation "
                                            "scheme); false: the weights dequantised every call, x kept 16-bit "
                                            "(the stored weights exactly, slower)")
    norm_int8: bool = _knob(True, doc="int8 weights (int8_channel) reading an RMSNorm's output: the norm also "
                                       "writes the int8 rows and per-token scales (ir/passes/fuse_norm_int8_quant"
                                       ".py) and its int8 readers skip their quantiser launch")
    norm_fp8: bool = _knob(True, doc="FP8 weights reading an RMSNorm's output: where its readers run FP8 x FP8 "
                                      "(gemm_fp8 above skinny_upto, the experts' gate_up above decode), the norm "
                                      "also writes the e4m3 rows and scales per 128 columns (ir/passes/"
                                      "fuse_norm_fp8_quant.py) and those readers skip their quantiser launch")
    fp8_chunks_upto: int = _knob(64, choices=(0, 32, 64, 128, 256),
                                 doc="FP8 weights, sm_90a, fp8_activations: from skinny_upto + 1 up to this many "
                                     "tokens the FP8 skinny kernel runs in chunks of 16 tokens (grid.y; no quantiser "
                                     "launch), the FP8 x FP8 GEMM above (0: never; also never while skinny_upto is 0). "
                                     "64: H100 FP8 b=32 8.14 -> 7.59 ms, b=64 8.68 -> 8.49; 128 loses at b=128 "
                                     "(9.30 -> 9.60: 8 chunks re-read x)")
    i8_chunks_upto: int = _knob(32, choices=(0, 32, 64, 128, 256),
                                doc="int8 weights, sm_90a (the int8 GEMM's case): from skinny_upto + 1 up to this "
                                    "many tokens the int8 skinny kernel runs in chunks of 16 tokens (grid.y) on x's "
                                    "int8 rows (the quantiser's or the norm's), the int8 GEMM above (0: never; also "
                                    "never while skinny_upto is 0). 32: H100 W4A8 b=32 5.86 -> 5.01 ms; 64 loses "
                                    "for the dense gate_up at 64 tokens (38 -> 67 us: 4 chunks re-read its 45 MB "
                                    "past L2)")
    gemm_weights_early: bool = _knob(True, doc="the dense one-byte GEMMs (gemm_fp8, gemm_int8): each CTA issues the "
                                               "weight boxes of its first ring stages before the PDL wait, so the "
                                               "weights' DRAM round trip overlaps the kernel before (kernel name part "
                                               "ew); the token rows still after the wait. H100 b=128: FP8 8.58 -> "
                                               "8.51 ms, W4A8 6.93 -> 6.84")
    gemm_split_min_kb: int = _knob(4, choices=(1, 2, 4, 8),
                                   doc="the dense one-byte GEMMs' split K: each split keeps at least this many "
                                       "128-wide K blocks (the tile's last CTA reads the other splits' partials "
                                       "alone, so a short split costs more than it streams: H100 o_proj at 128 "
                                       "tokens 15.4 us split 8 ways, 12.3 split 2-4 ways). 4 against 1: H100 "
                                       "b=128 FP8 8.81 -> 8.58 ms, W4A8 7.34 -> 6.93")
    gemm_multi: bool = _knob(False, doc="a multi_linear whose weights the dense one-byte GEMM serves (all FP8: "
                                        "gemm_fp8, all int8_channel: gemm_int8; MLA's q + kv_a): its GEMMs as the "
                                        "parts of ONE launch, each part's CTAs running its own launch's tile walk "
                                        "(bit-equal outputs; kernel name part o<O0>_o<O1>..), instead of a launch a "
                                        "weight whose second waits for the first under PDL. Not yet run on a "
                                        "GPU")
    v_up_fp8: bool = _knob(False, doc="decode, FP8 weights reading mla_v_up's output (o_proj) where V = 128: where "
                                      "o_proj runs FP8 x FP8 (gemm_fp8), v_up also writes the e4m3 rows and scales "
                                      "per 128 columns (a head's V columns; ir/passes/fuse_v_up_fp8_quant.py) from "
                                      "a CTA a whole head, and o_proj skips its quantiser launch")


@dataclass(frozen=True)
class PersistentTuning(_Section):
    """Decode's persistent launches across ops (codegen/segments.py): off, the segments of norms and skinny
    linears measured slower than their launches (H100: bf16 b=1 2.30 -> 2.41 ms; PERF_NOTES v43)."""
    NAME = "persistent"
    segments: bool = _knob(False, doc="decode: each maximal run of consecutive launches whose families have a task "
                                      "body (norms, the MoE combine + norm, 16-bit skinny linears, the tensor-core V "
                                      "up-projection) as one persistent segment launch, its CTAs taking the tiles "
                                      "in order and waiting on counters instead of kernel boundaries (off: a "
                                      "launch per op)")
    members: int = _knob(2, choices=(1, 2), doc="with segments: which launches have task bodies; 1: the norms and "
                                                "16-bit skinny linears (as measured in PERF_NOTES v43); 2: also the "
                                                "MoE combine + norm and the tensor-core V up-projection")
    ctas_per_sm: int = _knob(1, choices=(1, 2), doc="with segments: the segment kernel's CTAs an SM (its launch "
                                                    "bounds, its grid at most this times SMS); 2 caps registers at "
                                                    "128 a thread, as a skinny linear's own launch runs; a segment "
                                                    "whose shared memory does not fit twice an SM keeps 1")


@dataclass(frozen=True)
class Tuning:
    moe: MoeTuning = field(default_factory=MoeTuning)
    route: RouteTuning = field(default_factory=RouteTuning)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    linear: LinearTuning = field(default_factory=LinearTuning)
    persistent: PersistentTuning = field(default_factory=PersistentTuning)

    def __post_init__(self):
        for sec in dataclasses.fields(self):
            section = getattr(self, sec.name)
            if not isinstance(section, sec.default_factory):
                raise TuningError(f"tuning section {sec.name!r} must be a {sec.default_factory.__name__}, "
                                  f"got {type(section).__name__}")

    def to_json(self) -> dict:
        """{section: {knob: value}}: plain JSON (the cache key's and the manifest's form)."""
        return dataclasses.asdict(self)

    def changed(self) -> dict:
        """{"section.knob": value} of the knobs that differ from the defaults."""
        base = DEFAULT_TUNING.to_json()
        return {f"{s}.{k}": v for s, knobs in self.to_json().items() for k, v in knobs.items() if base[s][k] != v}

    @classmethod
    def from_changed(cls, changed: dict) -> "Tuning":
        """The inverse of `changed` ({"section.knob": value})."""
        nested: dict = {}
        for key, value in (changed or {}).items():
            sec, _, knob = str(key).partition(".")
            nested.setdefault(sec, {})[knob] = value
        return cls.from_json(nested)

    def flags(self) -> list[str]:
        """The CLI's --tune flags that make this Tuning."""
        return [f"--tune {k}={'none' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                for k, v in self.changed().items()]

    @classmethod
    def from_json(cls, data: dict) -> "Tuning":
        if not isinstance(data, dict):
            raise TuningError(f"tuning must be a mapping of sections, got {type(data).__name__}")
        secs = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        out = {}
        for name, knobs in data.items():
            if name not in secs:
                raise TuningError(f"unknown tuning section {name!r}{_did_you_mean(name, secs)}")
            if not isinstance(knobs, dict):
                raise TuningError(f"tuning section {name!r} must be a mapping of knobs")
            known = {f.name for f in dataclasses.fields(secs[name])}
            for k in knobs:
                if k not in known:
                    raise TuningError(f"unknown tuning knob {name}.{k}{_did_you_mean(k, known, prefix=name + '.')}")
            out[name] = secs[name](**knobs)
        return cls(**out)


def _check(name: str, f, value) -> None:
    kind, nullable = _KIND[id(f)]
    m = f.metadata
    if value is None:
        if nullable:
            return
        raise TuningError(f"tuning {name} cannot be none (a {kind.__name__})")
    if kind is bool:
        if not isinstance(value, bool):
            raise TuningError(f"tuning {name} must be true or false, got {value!r}")
        return
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TuningError(f"tuning {name} must be a whole number{' or none' if nullable else ''}, got {value!r}")
        if m.get("choices") and value not in m["choices"]:
            raise TuningError(f"tuning {name} must be one of {', '.join(map(str, m['choices']))}, got {value}")
        lo, hi = m.get("lo"), m.get("hi")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise TuningError(f"tuning {name} must be from {lo} to {hi}, got {value}")
        return
    if kind is str:
        if not isinstance(value, str):
            raise TuningError(f"tuning {name} must be a string, got {value!r}")
        if m.get("choices") and value not in m["choices"]:
            raise TuningError(f"tuning {name} must be one of {', '.join(m['choices'])}, got {value!r}")
        if m.get("pattern") and not re.fullmatch(m["pattern"], value):
            raise TuningError(f"tuning {name} {value!r} does not match {m['pattern']} ({m.get('doc', '')})")
        return
    raise TuningError(f"tuning {name}: unsupported knob type {kind!r}")   # pragma: no cover


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Tuning)}
# knob field -> (base type, nullable), resolved once from the annotations
_KIND: dict[int, tuple[type, bool]] = {}
for _cls in SECTIONS.values():
    _hints = typing.get_type_hints(_cls)
    for _f in dataclasses.fields(_cls):
        _args = typing.get_args(_hints[_f.name])
        _KIND[id(_f)] = ((next(a for a in _args if a is not type(None)), True) if type(None) in _args
                         else (_hints[_f.name], False))
DEFAULT_TUNING = Tuning()


def knobs() -> dict[str, tuple]:
    """"section.knob" -> (default, doc) of every knob, in declaration order."""
    return {f"{s}.{f.name}": (f.default, f.metadata.get("doc", ""))
            for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def _did_you_mean(word: str, candidates, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, sorted(candidates), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else f" (one of: {', '.join(sorted(candidates))})"


def _parse_value(name: str, f, text: str):
    kind, nullable = _KIND[id(f)]
    low = text.strip().lower()
    if nullable and low in ("none", "null", "off"):
        return None
    if kind is bool:
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise TuningError(f"tuning {name} must be true or false, got {text!r}")
    if kind is int:
        try:
            return int(low, 0)
        except ValueError:
            raise TuningError(f"tuning {name} must be a whole number{' or none' if nullable else ''}, "
                              f"got {text!r}") from None
    return text.strip()


def parse_tune(settings) -> Tuning:
    """["section.knob=value", ...] (the CLI's repeatable --tune) -> a validated Tuning; a later
    setting of the same knob wins.  TuningError (one line) on any mistake."""
    if isinstance(settings, str):
        settings = [settings]
    changes: dict[str, dict] = {}
    for s in settings or ():
        if not isinstance(s, str) or "=" not in s:
            raise TuningError(f"--tune {s!r}: expected SECTION.KNOB=VALUE, e.g. moe.expert_ffn_upto=128")
        key, text = s.split("=", 1)
        key = key.strip()
        if "." not in key:
            raise TuningError(f"--tune {s!r}: expected SECTION.KNOB=VALUE, e.g. moe.expert_ffn_upto=128")
        sec, knob = key.split(".", 1)
        if sec not in SECTIONS:
            raise TuningError(f"unknown tuning section {sec!r} in --tune {s!r}{_did_you_mean(sec, SECTIONS)}")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[sec])}
        if knob not in fields:
            raise TuningError(f"unknown tuning knob {key!r}{_did_you_mean(knob, fields, prefix=sec + '.')}")
        changes.setdefault(sec, {})[knob] = _parse_value(key, fields[knob], text)
    return Tuning(**{sec: SECTIONS[sec](**kv) for sec, kv in changes.items()})


def as_tuning(value) -> Tuning:
    """A Tuning from what the API takes: None (the defaults), a Tuning, a {section: {knob: value}}
    mapping, or a list of "section.knob=value" strings."""
    if value is None:
        return DEFAULT_TUNING
    if isinstance(value, Tuning):
        return value
    if isinstance(value, dict):
        return Tuning.from_json(value)
    if isinstance(value, (list, tuple, str)):
        return parse_tune(value)
    raise TuningError(f"tuning must be a Tuning, a mapping or a list of 'section.knob=value', "
                      f"got {type(value).__name__}")
