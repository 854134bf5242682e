"""Checkpoints quantised by Huawei's msModelSlim (W8A8 / W4A8), read as stored and checked.

Such a folder has `quant_model_description.json` beside `config.json`: a map from every tensor's name to
its type (FLOAT, W8A8_DYNAMIC, W8A8, W4A8_DYNAMIC) plus a few metadata keys without dots (version,
model_quant_type, group_size, ...); the tensors are in safetensors shards, with
`quant_model_weights.safetensors.index.json` (or a plain index) naming the shard of each.  `config.json`
says `quantize` (the ordinary linears, e.g. "w8a8_dynamic") and `moe_quantize` (the routed experts, e.g.
"w4a8_dynamic").  Each quantised linear `<module>.weight` has companions `<module>.weight_scale` /
`.weight_offset` (and `.weight_scale_second` / `.weight_offset_second` per group); packed int4 has a
`<module>.scale_bias`, static W8A8 `<module>.input_scale` / `.input_offset` / `.deq_scale` / `.quant_bias`.
ir/formats.py names the storage formats, ir/formats_int.py defines their arithmetic.

`MsModelSlim.open(dir)` maps each described weight to its format (W4A8_DYNAMIC's packing from the shapes,
checked against the description's version: "1.0.0" packs two int4 per byte along the output dim), and
`check()` reads the quantised tensors once: dtypes, shapes, zero offsets, int4 ranges, the scale_bias
checksum (8 * s * sum q; never added), static W8A8's deq_scale = input_scale * weight_scale and
quant_bias = -input_offset * sum q.  Every problem is one line of one WeightError naming the tensor and
its type.  `open_checked(dir)` is what the loader reads: the checkpoint as stored (the weights and their
companions, bound by the spec `--from-config` writes from `quantize` / `moe_quantize`), or dequantised to
float32 (weight_format="dtype": weight-only, activations stay float).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ir.formats import FORMATS, WeightFormat, dequantize
from ir.formats_int import check_companions, companion_shape, int_values, logical_shape, scale_bias_problem

from .errors import WeightError
from .weights import Checkpoint, read_json_object

DESCRIPTION_FILE = "quant_model_description.json"
INDEX_FILE = "quant_model_weights.safetensors.index.json"
PACKED_VERSION = "1.0.0"   # msModelSlim's W4A8_DYNAMIC from this version on: two int4 per byte along O
# The description's types; W4A8_DYNAMIC's format depends on the packing and the scales found.
TYPES = ("FLOAT", "W8A8_DYNAMIC", "W8A8", "W4A8_DYNAMIC")
_INT8_TYPES = {"W8A8_DYNAMIC": "int8_channel", "W8A8": "int8_static"}
_FLOAT = {"F64", "F32", "F16", "BF16"}
_MAX_LISTED = 10


def is_msmodelslim(model_dir) -> bool:
    return (Path(model_dir) / DESCRIPTION_FILE).is_file()


@dataclass(frozen=True)
class QuantWeight:
    """One quantised linear: its checkpoint `name` (`<module>.weight`), description type and format."""
    name: str
    type: str
    fmt: WeightFormat

    @property
    def module(self) -> str:
        return self.name[: -len(".weight")]

    @property
    def companions(self) -> tuple[str, ...]:
        return tuple(self.name + s for s in self.fmt.companions)

    @property
    def siblings(self) -> tuple[str, ...]:
        return tuple(f"{self.module}.{leaf}" for leaf in self.fmt.siblings)


class MsModelSlim:
    """An msModelSlim checkpoint: the Checkpoint `ckpt`, its description, its quantised weights by name."""

    def __init__(self, ckpt: Checkpoint, description: dict, where: str):
        self.ckpt = ckpt
        self.where = where
        self.meta = {k: v for k, v in description.items() if "." not in k}
        self.types = {k: v for k, v in description.items() if "." in k}
        self.version = str(self.meta.get("version", "0"))
        problems = []
        for name, t in sorted(self.types.items()):
            if t not in TYPES:
                problems.append(f"{name}: type {t!r} is not one dsgraph reads ({', '.join(TYPES)})")
            elif name not in ckpt:
                problems.append(f"{name} ({t}): described but not in the checkpoint")
        for name in sorted(ckpt.names() - set(self.types)):
            problems.append(f"{name}: in the checkpoint but not in {DESCRIPTION_FILE}")
        self.weights: dict[str, QuantWeight] = {}
        if not problems:
            for name, t in sorted(self.types.items()):
                if t != "FLOAT" and name.endswith(".weight"):
                    fmt, problem = self._format(name, t)
                    if problem:
                        problems.append(f"{name} ({t}): {problem}")
                    else:
                        self.weights[name] = QuantWeight(name, t, fmt)
            problems += self._check_names()
        _raise(problems, where)

    @classmethod
    def open(cls, model_dir) -> "MsModelSlim":
        root = Path(model_dir)
        description = read_json_object(root / DESCRIPTION_FILE, "msModelSlim quantisation description")
        ckpt = Checkpoint._from_index(root, INDEX_FILE) if (root / INDEX_FILE).is_file() else Checkpoint.open(root)
        return cls(ckpt, description, str(root))

    def _format(self, name: str, t: str) -> tuple[WeightFormat | None, str | None]:
        """The format of quantised weight `name` of description type `t`, or why there is none."""
        if t in _INT8_TYPES:
            return FORMATS[_INT8_TYPES[t]], None
        scale = self.ckpt.shape(name + "_scale") if name + "_scale" in self.ckpt else None
        if scale is None or len(scale) < 2:
            return None, f"needs a {name}_scale [.., O, 1] to know its output channels"
        rows, out = self.ckpt.shape(name)[-2], scale[-2]
        if out not in (rows, 2 * rows):
            return None, f"stores {rows} rows for {out} output channels: neither one nor two int4 per byte"
        packed = out == 2 * rows
        if self.version == PACKED_VERSION and not packed:
            return None, (f"version {PACKED_VERSION} packs two int4 per byte along the output dim, but it stores "
                          f"{rows} rows for {out} channels")
        grouped = name + "_scale_second" in self.ckpt
        fmt = {(True, False): "int4_channel", (False, False): "int4_channel_byte",
               (False, True): "int4_group256", (True, True): "int4_group256_packed"}[(packed, grouped)]
        return FORMATS[fmt], None

    def _check_names(self) -> list[str]:
        """Each weight's companions and siblings present and described with its type; no stray
        companion of an unquantised weight."""
        problems, owned = [], set()
        for w in self.weights.values():
            for c in w.companions + w.siblings:
                owned.add(c)
                if c not in self.ckpt:
                    problems.append(f"{c}: missing ({w.type} weight {w.name} needs it as {w.fmt.name})")
                elif self.types.get(c) != w.type:
                    problems.append(f"{c}: described as {self.types.get(c)!r}, its weight {w.name} as {w.type!r}")
        for name, t in sorted(self.types.items()):
            if t != "FLOAT" and name not in self.weights and name not in owned:
                problems.append(f"{name} ({t}): a quantised tensor that belongs to no quantised weight")
        return problems

    def float_names(self) -> set[str]:
        return {n for n, t in self.types.items() if t == "FLOAT"}

    def check(self) -> None:
        """Read every quantised weight and its companions once and check their values (module docstring)."""
        problems = []
        for w in self.weights.values():
            problem = self._check_weight(w)
            if problem:
                problems.append(f"{problem[0]} ({w.type}, {w.fmt.name}): {problem[1]}")
        _raise(problems, self.where)

    def _check_weight(self, w: QuantWeight) -> tuple[str, str] | None:
        ck = self.ckpt
        if ck.dtype_str(w.name) != "I8":
            return w.name, f"is {ck.dtype_str(w.name)}, {w.fmt.name} stores int8"
        shape = logical_shape(w.fmt, ck.shape(w.name))
        for suffix, c in zip(w.fmt.companions, w.companions):
            grouped = suffix.endswith("_second")
            want = None if grouped and shape[-1] % w.fmt.group else companion_shape(w.fmt, suffix, shape)
            if want is None or ck.shape(c) != want or ck.dtype_str(c) not in _FLOAT:
                return c, (f"is {ck.dtype_str(c)} {list(ck.shape(c))}, expected a float "
                           f"{list(want) if want else 'tensor'} for {w.name} {list(ck.shape(w.name))}")
        stored = ck.get(w.name)
        comps = [ck.get(c) for c in w.companions]
        try:
            check_companions(stored, comps, w.fmt)
            q = int_values(stored, w.fmt)
        except ValueError as exc:
            return w.name, str(exc)
        sib = {leaf: ck.get(n) for leaf, n in zip(w.fmt.siblings, w.siblings)}
        if "scale_bias" in sib:
            problem = scale_bias_problem(sib["scale_bias"], stored, comps, w.fmt)
            if problem:
                return f"{w.module}.scale_bias", problem
        if w.fmt.activation == "tensor":
            return _static_problem(w, q, comps[0], sib)
        return None

    def dequantised(self) -> "Dequantised":
        return Dequantised(self)


def _static_problem(w: QuantWeight, q, scale, sib) -> tuple[str, str] | None:
    """Static W8A8's activation tensors against each other: per-tensor input scale and offset,
    deq_scale [O] = input_scale * weight_scale (float32), quant_bias [O] = -input_offset * sum_i q (int32)."""
    o = q.shape[0]
    in_s, in_off, deq, qb = (sib[k] for k in ("input_scale", "input_offset", "deq_scale", "quant_bias"))
    if in_s.numel() != 1 or in_off.numel() != 1:
        return (f"{w.module}.input_scale",
                f"input_scale / input_offset must hold one value each, hold {in_s.numel()} / {in_off.numel()}")
    if deq.dtype != torch.float32 or deq.numel() != o:
        return f"{w.module}.deq_scale", f"is {deq.dtype} {list(deq.shape)}, expected float32 [{o}] (a bf16 model's)"
    want = (in_s.to(torch.float32).reshape(()) * scale.to(torch.float32).reshape(-1))
    if not torch.allclose(deq.reshape(-1), want, rtol=1e-5, atol=0):
        return f"{w.module}.deq_scale", "is not input_scale * weight_scale"
    if qb.dtype != torch.int32 or qb.numel() != o:
        return f"{w.module}.quant_bias", f"is {qb.dtype} {list(qb.shape)}, expected int32 [{o}]"
    if not torch.equal(qb.reshape(-1).to(torch.int64), -int(in_off.reshape(())) * q.to(torch.int64).sum(-1)):
        return f"{w.module}.quant_bias", "is not -input_offset * sum(weight) (a linear without a bias)"
    return None


def _raise(problems: list[str], where: str) -> None:
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise WeightError(f"msModelSlim checkpoint {where}: {len(problems)} problem(s):\n  "
                          + "\n  ".join(problems[:_MAX_LISTED]) + more)


class AsStored:
    """An MsModelSlim checkpoint through the Checkpoint interface (names, shape, dtype_str, get), as stored:
    the weights and their companions, which a spec with the matching weight_formats binds; the siblings
    (scale_bias, checked at load) hidden."""

    def __init__(self, ms: MsModelSlim, hidden: set[str] | None = None):
        self.ms = ms
        self.inner = ms.ckpt
        self.model_dir = ms.ckpt.model_dir
        self.reads = ms.ckpt.reads
        if hidden is None:
            hidden = {c for w in ms.weights.values() for c in w.siblings}
        self._names = ms.ckpt.names() - hidden

    def names(self) -> set[str]:
        return set(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def dtype_str(self, name: str) -> str:
        return self.inner.dtype_str(name)

    def get(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        return self.inner.get(name, part)


def open_checked(model_dir, weight_format: str | None = None):
    """The msModelSlim checkpoint at `model_dir`, its values checked, for the loader: as stored, or with
    weight_format="dtype" dequantised."""
    from .errors import InputError
    if weight_format not in (None, "dtype"):
        raise InputError(f"{model_dir} is an msModelSlim checkpoint (int8 / int4): weight_format must be None (as "
                         f"stored) or 'dtype' (dequantised), got {weight_format!r}")
    ms = MsModelSlim.open(model_dir)
    biases = sorted(n for n in ms.float_names() if n.endswith("norm.bias"))
    if biases:
        raise WeightError(f"{biases[0]} (FLOAT): an RMSNorm bias (msModelSlim's anti-outlier smoothing, "
                          f"{len(biases)} in all); dsgraph's rms_norm has no bias yet, and dropping it would "
                          f"compute another model")
    ms.check()
    return ms.dequantised() if weight_format == "dtype" else AsStored(ms)


class Dequantised(AsStored):
    """An MsModelSlim checkpoint presented as float32 weights through the Checkpoint interface: each
    quantised weight dequantised (ir.formats.dequantize), its companions and siblings hidden.  Weight-only:
    whoever runs it computes with float activations."""

    def __init__(self, ms: MsModelSlim):
        super().__init__(ms, {c for w in ms.weights.values() for c in w.companions + w.siblings})

    def shape(self, name: str) -> tuple[int, ...]:
        w = self.ms.weights.get(name)
        return logical_shape(w.fmt, self.inner.shape(name)) if w else self.inner.shape(name)

    def dtype_str(self, name: str) -> str:
        return "F32" if name in self.ms.weights else self.inner.dtype_str(name)

    def get(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        w = self.ms.weights.get(name)
        if w is None:
            return self.inner.get(name, part)
        full = dequantize(self.inner.get(name), [self.inner.get(c) for c in w.companions], w.fmt)
        if part is None:
            return full
        dim, start, stop = part
        return full.narrow(dim, start, stop - start).contiguous()


__all__ = ["DESCRIPTION_FILE", "INDEX_FILE", "PACKED_VERSION", "TYPES", "AsStored", "Dequantised", "MsModelSlim",
           "QuantWeight", "is_msmodelslim", "open_checked"]
