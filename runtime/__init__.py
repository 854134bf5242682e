"""dsgraph's runtime: load a bundle or a spec, keep the paged latent KV cache, run steps."""
from .engine import Engine, GenerationOutput
from .errors import CacheFullError, DsgraphError, InputError, WeightError
from .sampling import SamplingParams

__all__ = ["Engine", "GenerationOutput", "SamplingParams", "CacheFullError", "DsgraphError", "InputError", "WeightError"]
