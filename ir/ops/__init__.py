"""The op vocabulary, in one place: importing this package registers every op in OPS."""
from . import attention, collective, core, moe  # noqa: F401  (registration side effect)
from .base import OPS, Attr, Node, ShapeError, TType, WeightInfo, WeightSlice

__all__ = ["OPS", "Attr", "Node", "ShapeError", "TType", "WeightInfo", "WeightSlice"]
