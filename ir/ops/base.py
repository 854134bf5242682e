"""The op vocabulary's machinery: attribute schemas, tensor types, the registry.

Every op is one class with
  - ``inputs`` / ``outputs``: how many values it takes and makes,
  - ``attrs``: its attributes with types and defaults (checked when the spec loads),
  - ``weights``: the checkpoint tensors it binds, by role,
  - ``infer``: shape/dtype inference (also the shapes of its weights),
  - ``run``: reference semantics in plain torch: the ground truth for passes and kernels.

Shapes are tuples whose first entry may be symbolic: "T" (tokens in the step) or
"T*K" (token-expert pairs).  Dtypes are "act" (the activation dtype chosen at run
time), "f32", "i64", and two opaque kinds: "state" (the layer's KV cache after a
write; it orders reads after writes) and "routing" (an expert-sorted token plan).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from ..expr import ExprError, evaluate

OPS: dict[str, type["OpDef"]] = {}
FLOAT32_MAX = 3.4028234663852886e38
MULTI_LINEAR_MAX = 4   # weights of one multi_linear (roles weight0 .. weight3)
# The generated kernels address tensors with 64-bit offsets ((i64)row * width), but a width is a
# 32-bit `constexpr int` in the source, indexed with 32-bit ints and rounded up to whole tiles
# (a few thousand elements at most; 2**16 leaves room), and a multi_linear stacks its weights'
# rows in one such index (templates/include/skinny.cuh weight_row).  So a dim's limit is a
# quarter of int32's range less that room: 536854528, far past any DeepSeek dim (V3's widest:
# vocab, 129280).
MAX_WIDTH = (2**31 - 2**16) // MULTI_LINEAR_MAX


def width_problem(n: int) -> str | None:
    """Why the kernels cannot index a tensor dim of n elements, or None."""
    if n > MAX_WIDTH:
        return (f"{n} is past the {MAX_WIDTH} elements a tensor dim can have (the kernels index a row, and up to "
                f"{MULTI_LINEAR_MAX} stacked rows, with 32-bit ints)")
    return None


def register(cls):
    OPS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class TType:
    shape: tuple
    dtype: str

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"


@dataclass(frozen=True)
class WeightSlice:
    """One part of a stacked weight cut from a larger checkpoint tensor: [start, stop) along `dim`
    of `name`, whose whole shape is `stored`.  ir/passes/fuse_shared_experts.py stacks the shared
    experts' MLP ahead of the routed experts this way: shared expert s of S is rows s*M..(s+1)*M of
    gate_proj / up_proj and those columns of down_proj.  The runtime reads the same type back from
    a manifest (codegen.manifest.part_to_json, runtime.model_loader.parse_part) and loads it with
    the tensor-parallel slice reader (`part`)."""

    name: str
    dim: int
    start: int
    stop: int
    stored: tuple

    def __post_init__(self):
        for f in ("dim", "start", "stop"):
            object.__setattr__(self, f, int(getattr(self, f)))
        object.__setattr__(self, "stored", tuple(int(d) for d in self.stored))

    @property
    def part(self) -> tuple[int, int, int]:
        """(dim, start, stop): the form a rank's split weight carries (WeightSpec.part)."""
        return self.dim, self.start, self.stop

    def shape(self) -> tuple:
        """The shape of the slice."""
        out = list(self.stored)
        out[self.dim] = self.stop - self.start
        return tuple(out)

    def problem(self) -> str | None:
        """Why this slice cannot be read from a tensor of shape `stored`, or None."""
        if self.dim not in (0, 1) or self.dim >= len(self.stored):
            return f"slices dim {self.dim} of a {len(self.stored)}-D tensor (dim 0 or 1 only)"
        if not 0 <= self.start < self.stop <= self.stored[self.dim]:
            return f"slice {self.start}:{self.stop} of dim {self.dim} is outside its stored shape {self.stored}"
        return None


@dataclass(frozen=True)
class WeightInfo:
    """A bound checkpoint tensor: expected shape, fp32 pinning, per-expert parts."""

    shape: tuple
    keep_fp32: bool = False
    # stacked along a new dim 0 (one per expert): a checkpoint tensor's name, or a WeightSlice of one
    parts: tuple[str | WeightSlice, ...] | None = None
    format: str | None = None   # storage format (ir/formats.py FORMATS); None: the activation dtype


class AttrError(ValueError):
    pass


@dataclass(frozen=True)
class Attr:
    """One attribute: kind is dim | int | float | bool | str | dims (list of dim exprs) | choice.

    The range of a number is stated here, once, with the attribute: `minimum` for an int
    (a dim is always >= 1 and at most MAX_WIDTH), `positive` for a float that must be > 0 (an
    eps or a scale: zero or a negative value runs, and gives NaN or silently wrong numbers)."""

    kind: str
    default: Any = ...
    choices: tuple = ()
    minimum: int | None = None
    positive: bool = False

    @property
    def required(self) -> bool:
        return self.default is ...

    def parse(self, value, dims: dict[str, int | None]):
        try:
            if self.kind == "dim":
                return _positive(evaluate(value, dims), value)
            if self.kind == "dims":
                if not isinstance(value, list) or not value:
                    raise AttrError(f"expected a non-empty list of dims, got {value!r}")
                return [_positive(evaluate(v, dims), v) for v in value]
        except ExprError as exc:
            raise AttrError(str(exc)) from None
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise AttrError(f"expected an integer, got {value!r}")
            if self.minimum is not None and value < self.minimum:
                raise AttrError(f"expected an integer >= {self.minimum}, got {value!r}")
            return value
        if self.kind == "float":
            if isinstance(value, bool):
                raise AttrError(f"expected a number, got {value!r}")
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise AttrError(f"expected a number, got {value!r}") from None
            # Kernels and the reference compute these in float32: a value beyond its range
            # would silently become inf there.
            if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
                raise AttrError(f"expected a finite number within float32 range (|x| <= 3.4e38), got {value!r}")
            if self.positive and number <= 0:
                raise AttrError(f"expected a number > 0, got {value!r}")
            return number
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise AttrError(f"expected true or false, got {value!r}")
            return value
        if self.kind == "choice":
            if value not in self.choices:
                raise AttrError(f"expected one of {', '.join(map(str, self.choices))}; got {value!r}")
            return value
        if self.kind == "str":
            if not isinstance(value, str):
                raise AttrError(f"expected a string, got {value!r}")
            return value
        raise AssertionError(f"unknown attr kind {self.kind}")


def _positive(n: int, expr) -> int:
    # A size, head count or expert count of zero or less would bind a weight of impossible shape.
    shown = str(n) if isinstance(expr, int) else f"{expr!r} = {n}"
    if n < 1:
        raise AttrError(f"a dim must be a positive integer, got {shown}")
    if width_problem(n):
        raise AttrError(f"dim {shown}: {width_problem(n)}")
    return n


class ShapeError(ValueError):
    """Raised by ``infer``; the graph builder turns it into a SpecError with the op's path."""


@dataclass
class Node:
    """What ``infer`` and ``run`` see of a graph node."""

    op: str
    attrs: dict
    weights: dict = field(default_factory=dict)  # role -> bound checkpoint name
    layer: int | None = None
    model: Any = None                            # the ModelConfig (dims, eps, rope, softmax scale)


class OpDef:
    name: ClassVar[str]
    inputs: ClassVar[int | tuple[int, int]] = 1   # exact count, or (min, max)
    outputs: ClassVar[int] = 1
    attrs: ClassVar[dict[str, Attr]] = {}
    weights: ClassVar[dict[str, bool]] = {}       # role -> required
    expert_weights: ClassVar[tuple[str, ...]] = ()  # roles whose name has {expert}
    fp32_weights: ClassVar[tuple[str, ...]] = ()   # roles kept in float32
    doc: ClassVar[str] = ""

    @classmethod
    def fp32_roles(cls, node: Node) -> tuple[str, ...]:
        return cls.fp32_weights

    @classmethod
    def infer(cls, node: Node, ins: list[TType], model) -> tuple[list[TType], dict[str, tuple]]:
        """Return output types and the expected shape of each bound weight role."""
        raise NotImplementedError

    @classmethod
    def run(cls, node: Node, ins: list, w: dict, ctx) -> list:
        raise NotImplementedError


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise ShapeError(message)


def same_rows(a: TType, b: TType, what: str) -> None:
    expect(a.shape[0] == b.shape[0], f"{what}: row counts differ ({a.shape[0]} vs {b.shape[0]})")


def is_float(t: TType) -> bool:
    return t.dtype in ("act", "f32")


Runner = Callable[..., list]
