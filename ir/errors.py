"""Errors the compiler front end raises for a user's mistake.

A SpecError always names the file, the YAML path and the line, so the user can
jump straight to the offending entry; it never surfaces as a Python traceback
from deep inside the compiler (the CLI prints ``str(err)`` and exits).
"""
from __future__ import annotations


class DsgraphError(Exception):
    """Base class of every error dsgraph raises for something a user can cause (a spec, a
    config, a checkpoint, an input, a bundle).  It lives here, at the bottom of the data
    flow, so that ir, codegen and runtime all derive from the one class; the CLI prints
    such an error as one line and never as a traceback."""


def closest(name, known) -> str | None:
    """The one of `known` a mistyped `name` was most likely meant to be, if any is close."""
    import difflib
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1)
    return close[0] if close else None


def did_you_mean(name, known) -> str:
    """"; did you mean 'x'?" for the nearest of `known` to a mistyped `name`, else ""."""
    near = closest(name, known)
    return f"; did you mean {near!r}?" if near else ""


class SpecError(DsgraphError, ValueError):
    """A mistake in a model spec: unknown op, undefined value, bad shape, missing dim..."""

    def __init__(self, message: str, *, file: str = "<spec>", path: str = "", line: int | None = None):
        self.file = file
        self.path = path
        self.line = line
        self.message = message
        where = file if line is None else f"{file}:{line}"
        loc = f" at {path}" if path else ""
        super().__init__(f"{where}{loc}: {message}")


class GraphError(DsgraphError, RuntimeError):
    """The graph broke an invariant (a compiler bug, or a pass that went wrong)."""


class SpecNotFoundError(SpecError, FileNotFoundError):
    """A spec argument that is neither a file nor the name of a spec shipped with dsgraph."""

    def __init__(self, message: str, *, file: str):
        DsgraphError.__init__(self, message)
        self.file, self.path, self.line, self.message = file, "", None, message
