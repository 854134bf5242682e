"""A checkpoint seen in another weight format: quantised to DeepSeek-V3's FP8 layout, or dequantised.

`Engine.from_pretrained(dir, weight_format="fp8")` loads a bf16 / fp32 checkpoint through
``Converted(ckpt, "fp8")``: every tensor ir.formats.FP8_CHECKPOINT_GLOBS names is presented as
float8_e4m3fn with its float32 ``_scale_inv`` beside it, quantised by ir.formats.quantize (the one
rule); `dsgraph quantize --to fp8` writes that same view to disk (runtime/quantize.py).
``weight_format="dtype"`` goes the other way: an FP8 checkpoint's weights are presented dequantised
(float32, ir.formats.dequantize) and their scales hidden, for a backend with no FP8 kernel.

The view has the Checkpoint interface the loader reads (names, shape, dtype_str, get), so loading,
slicing for ranks and the format checks run on it unchanged.
"""
from __future__ import annotations

import fnmatch

import torch

from ir.formats import FP8, FP8_CHECKPOINT_GLOBS, cdiv, dequantize, quantize, scale_shape, weight_formats_yaml

from .errors import InputError
from .weights import FP8_DTYPE, Checkpoint

# Engine.from_pretrained(weight_format=...) / the CLI's --weights: "fp8" stores V3's FP8 tensors in FP8,
# "dtype" every weight in the model dtype.  None: as the spec (or the checkpoint's config) says.
WEIGHT_FORMATS = ("fp8", "dtype")
(SCALE,) = FP8.companions
_FLOAT = {"BF16", "F16", "F32", "F64"}


def check_weight_format(weight_format) -> None:
    if weight_format is not None and weight_format not in WEIGHT_FORMATS:
        raise InputError(f"weight_format must be None, {' or '.join(map(repr, WEIGHT_FORMATS))}, got {weight_format!r}")


def is_fp8_tensor(name: str) -> bool:
    """Whether DeepSeek-V3's FP8 layout stores checkpoint tensor `name` in FP8."""
    return any(fnmatch.fnmatchcase(name, g) for g in FP8_CHECKPOINT_GLOBS)


def spec_in_format(spec, config: dict | None, weight_format: str):
    """The spec (a Spec, a path, or None: from `config`) with its weights stored as `weight_format` says:
    "fp8" adds V3's FP8 weight_formats, "dtype" none.  A spec that declares weight_formats itself is
    an InputError (it already says how its weights are stored)."""
    from ir.config_to_spec import spec_from_config
    from ir.spec import Spec, load_spec

    check_weight_format(weight_format)
    if spec is None:
        if config is None:
            raise InputError("no spec given and no config.json to write one from")
        spec = load_spec(spec_from_config(config, weight_formats=False), file="config.json (generated spec)")
    elif not isinstance(spec, Spec):
        spec = load_spec(str(spec))
    if spec.weight_formats:
        raise InputError(f"spec {spec.file} declares weight_formats itself; weight_format={weight_format!r} "
                         f"applies to a spec without them")
    if weight_format == "fp8":
        spec = load_spec(spec.text + weight_formats_yaml(FP8_CHECKPOINT_GLOBS, FP8), file=spec.file)
    return spec


class Converted:
    """`ckpt` presented in `weight_format` ("fp8" or "dtype"); see the module docstring."""

    def __init__(self, ckpt: Checkpoint, weight_format: str):
        check_weight_format(weight_format)
        self.inner = ckpt
        self.model_dir = ckpt.model_dir
        self.reads = ckpt.reads
        self.to_fp8 = weight_format == "fp8"
        names = ckpt.names()
        if self.to_fp8:   # float tensors V3 stores in FP8 (an FP8 checkpoint's own stay as they are)
            self.quantised = {n for n in names if is_fp8_tensor(n) and ckpt.dtype_str(n) in _FLOAT
                              and len(ckpt.shape(n)) == 2}
            self._names = names | {n + SCALE for n in self.quantised}
        else:
            self.quantised = {n for n in names if ckpt.dtype_str(n) == FP8_DTYPE and n + SCALE in names}
            self._names = names - {n + SCALE for n in self.quantised}
        self._scales: dict[str, torch.Tensor] = {}   # a quantised weight's scale, until it is read

    def names(self) -> set[str]:
        return set(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def _base(self, name: str) -> str | None:
        """The quantised weight whose made-up scale `name` is (fp8 view only), else None."""
        if self.to_fp8 and name.endswith(SCALE) and name[: -len(SCALE)] in self.quantised:
            return name[: -len(SCALE)]
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        base = self._base(name)
        return scale_shape(self.inner.shape(base), FP8) if base else self.inner.shape(name)

    def dtype_str(self, name: str) -> str:
        if self._base(name):
            return "F32"
        if name in self.quantised:
            return FP8_DTYPE if self.to_fp8 else "F32"
        return self.inner.dtype_str(name)

    def get(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        base = self._base(name)
        if base is not None:
            scale = self._scales.pop(base, None)
            if scale is None:
                scale = quantize(self.inner.get(base), FP8)[1][0]
            return _narrow(scale, part)
        if name not in self.quantised:
            return self.inner.get(name, part)
        if self.to_fp8:
            q, (scale,) = quantize(self.inner.get(name), FP8)
            self._scales[name] = scale
            return _narrow(q, part)
        return self._dequantised(name, part)

    def _dequantised(self, name: str, part) -> torch.Tensor:
        if part is None:
            return dequantize(self.inner.get(name), (self.inner.get(name + SCALE),), FP8)
        # A slice reads the whole blocks it overlaps (and their scales), then trims.
        dim, start, stop = part
        b = FP8.block[dim]
        lo, hi = start // b, cdiv(stop, b)
        whole = self.inner.shape(name)[dim]
        weight = self.inner.get(name, (dim, lo * b, min(hi * b, whole)))
        scale = self.inner.get(name + SCALE, (dim, lo, hi))
        full = dequantize(weight, (scale,), FP8)
        return full.narrow(dim, start - lo * b, stop - start)


def _narrow(t: torch.Tensor, part) -> torch.Tensor:
    if part is None:
        return t
    dim, start, stop = part
    return t.narrow(dim, start, stop - start).contiguous()
