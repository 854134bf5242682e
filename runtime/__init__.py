"""dsgraph's runtime: load a bundle or a spec, keep the paged latent KV cache, run steps."""
__version__ = "0.1.0"  # the distribution's version (pyproject.toml reads it from here)

from .errors import CacheFullError, DsgraphError, InputError, NonFiniteError, WeightError

__all__ = ["AsyncEngine", "Engine", "GenerationOutput", "RequestOutput", "SamplingParams", "CacheFullError",
           "DsgraphError", "InputError", "NonFiniteError", "WeightError"]

# Engine and SamplingParams import torch; load them on first use so light entry points
# (the `dsgraph` CLI answering from the bundle cache) start in milliseconds.
_LAZY = {"AsyncEngine": ".async_engine", "Engine": ".engine", "GenerationOutput": ".engine", "RequestOutput": ".engine",
         "SamplingParams": ".sampling"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
