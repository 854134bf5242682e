"""Helpers the dense and MLA attention families share: node data, dtypes, constants.

Not a family (the leading underscore keeps it out of the registry).
"""
from __future__ import annotations

import hashlib
import json
import math

from codegen.errors import LoweringError
from codegen.kernel import DTYPES
from ir import rope as rope_math


def node_io(G, nid: str) -> tuple[dict, list[str], list[str], dict]:
    """(node data, input value names, output value names, weights role -> bound name)."""
    data = G.nodes[nid]
    return data, list(data["inputs"]), list(data["outputs"]), dict(data["weights"])


def vtype(G, name: str):
    return G.graph["values"][name]


def inner_dims(G, name: str) -> tuple[int, ...]:
    """The static dims of a value after its symbolic first dim (T)."""
    shape = vtype(G, name).shape
    dims = tuple(shape[1:])
    if not all(isinstance(d, int) for d in dims):
        raise LoweringError(f"value {name} has symbolic inner dims {shape}")
    return dims


def ctype_of(G, name: str, opts) -> tuple[str, str]:
    """(dtype tag, C type) of a float value: "act" -> opts.dtype, "f32" -> float."""
    dt = vtype(G, name).dtype
    if dt == "act":
        return opts.dtype, DTYPES[opts.dtype]
    if dt == "f32":
        return "fp32", "float"
    raise LoweringError(f"value {name} has dtype {dt!r}; expected act or f32")


def act_ctype(opts) -> str:
    if opts.dtype not in DTYPES:
        raise LoweringError(f"unsupported activation dtype {opts.dtype!r} (one of {', '.join(DTYPES)})")
    return DTYPES[opts.dtype]


def dims(G) -> dict:
    return G.graph["model"].dims


def c_float(x: float) -> str:
    """A float32 constant as a C literal that reads back to exactly the same float32."""
    x = float(x)
    if not math.isfinite(x):
        raise LoweringError(f"non-finite constant {x!r}")
    import struct
    try:
        x32 = struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        x32 = math.inf
    if not math.isfinite(x32):
        raise LoweringError(f"constant {x!r} does not fit a float32 (the kernels bake it as one)")
    text = repr(x32)
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


def rope_params(G, pairs: str, output: str) -> dict:
    """Template params of the rotary embedding: inverse frequencies and attention factor
    as exact float literals, and the pair / output layouts."""
    model = G.graph["model"]
    R = model.dims["qk_rope_head_dim"]
    if R % 2:
        raise LoweringError(f"qk_rope_head_dim must be even, got {R}")
    inv = [c_float(f) for f in rope_math.inv_freq_values(model.rope, R)]
    return {
        "rope_inv_freq": inv,
        "rope_attention_factor": c_float(rope_math.attention_factor(model.rope)),
        "pairs_adjacent": pairs == "adjacent",
        "out_interleaved": output == "interleaved",
    }


def rope_tag(params: dict) -> str:
    """A short, deterministic name part for a rope configuration (layout + table digest)."""
    layout = ("adj" if params["pairs_adjacent"] else "half") + "_" + ("il" if params["out_interleaved"] else "half")
    blob = json.dumps([params["rope_inv_freq"], params["rope_attention_factor"]], separators=(",", ":"))
    return f"{layout}__rope{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def vec16(n: int, elem_bytes: int) -> int:
    """Elements per load along a row of n: a 16-byte vector when n allows it, else 1 (odd dims)."""
    v = 16 // elem_bytes
    return v if n % v == 0 else 1


def block_threads_for_row(n: int, elem_bytes: int, *, lo: int = 32, hi: int = 1024) -> int:
    """Threads for one CTA per row of n elements: one 16-byte chunk each, rounded to warps."""
    vec = vec16(n, elem_bytes)
    chunks = -(-n // vec)
    t = -(-chunks // 32) * 32
    return max(lo, min(hi, t))


ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
