"""The runtime's user-facing exceptions.

Everything dsgraph raises on purpose derives from DsgraphError, so a caller
can catch the whole family in one clause while bugs (asserts, TypeErrors from
our own code) still surface as themselves.
"""
from ir.errors import DsgraphError  # the one base class, shared with the compiler

__all__ = ["CacheFullError", "DsgraphError", "InputError", "NonFiniteError", "PromptTooLongError",
           "WeightError"]


class WeightError(DsgraphError):
    """A checkpoint or model directory does not fit the model: a tensor is
    missing, unexpected, mis-shaped or of an unusable dtype, or the directory
    or its config is absent or unreadable."""


class CacheFullError(DsgraphError):
    """Not enough free KV-cache blocks. `needed` and `free` (block counts) say
    by how much, so a scheduler can decide whom to preempt without parsing the
    message."""

    def __init__(self, message: str, *, needed: int | None = None, free: int | None = None):
        super().__init__(message)
        self.needed = needed
        self.free = free


class InputError(DsgraphError, ValueError):
    """A bad prompt or parameter. Also a ValueError, so code that already
    guards against ValueError keeps working."""


class PromptTooLongError(InputError):
    """A prompt longer than the engine holds per sequence (max_seq_len): a server answers 413."""


class NonFiniteError(DsgraphError):
    """A step's logits hold NaN or inf: the weights (a damaged checkpoint) or the computation
    (an overflow in a narrow dtype, a kernel bug) produced them, and no token sampled from
    them means anything."""


class MissingDependencyError(DsgraphError):
    """A command needs packages that are not installed (the runtime's torch, safetensors, ...)."""


def require_runtime(command: str) -> None:
    """Raise MissingDependencyError, naming what to install, unless the runtime's packages import."""
    try:
        import torch  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"dsgraph {command} needs the runtime ({e.name or 'a package'} is not installed): install the torch "
            f"build for your machine (https://pytorch.org), then pip install 'dsgraph[runtime]'") from None
