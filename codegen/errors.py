"""Errors the compiler back end raises for something a user can cause.

A LoweringError says which constraint a spec's shapes break, on which graph node, and
where that node's op is in the spec (file, line, YAML path): lower_graph adds the
location to whatever a family raises, so families state only the constraint.
"""
from __future__ import annotations

from ir.errors import DsgraphError


class LoweringError(DsgraphError, ValueError):
    """A node cannot be lowered: no family or library call claims its op, or its family
    cannot serve its shapes or dtype (the message names the constraint)."""

    def __init__(self, message: str, *, located: bool = False):
        super().__init__(message)
        self.located = located


__all__ = ["DsgraphError", "LoweringError"]
