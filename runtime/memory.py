"""How much memory a model takes, checked before any of it is allocated.

A model that cannot fit (the full DeepSeek-V2-Lite in fp32 on a laptop) fails in a
second with one line that gives the estimate and what the device has, instead of an
allocator traceback (or the OOM killer) minutes into loading.

The estimate is what the engine allocates up front: every bound weight at its load
dtype (routing weights stay float32) and the paged KV cache, plus a margin for a
step's activations and the allocator's slack.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .errors import InputError

# A step's activations and allocator slack, as a fraction of the weights, and at least
# MIN_MARGIN (a prefill of a few thousand tokens through a small model still needs some).
MARGIN_FRACTION = 0.10
MIN_MARGIN = 256 << 20
_MEMINFO = "/proc/meminfo"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int       # bytes
    kv_cache: int      # bytes
    dtype: torch.dtype

    @property
    def margin(self) -> int:
        return max(MIN_MARGIN, int(self.weights * MARGIN_FRACTION))

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.margin

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"about {_size(self.total)} (weights {_size(self.weights)} in {dtype}, "
                f"KV cache {_size(self.kv_cache)}, margin {_size(self.margin)})")


def weight_bytes(specs: dict, dtype: torch.dtype) -> int:
    """Bytes of the weights `specs` (name -> WeightSpec) bind once loaded at `dtype` (a quantised weight as
    stored: FP8 / int8 one byte an element, packed int4 two elements a byte, its float32 scales weights of
    their own)."""
    from .weights import stored_dtype, stored_shape_of
    return sum(math.prod(stored_shape_of(s, s.shape))
               * (stored_dtype(s) or (torch.float32 if s.keep_fp32 else dtype)).itemsize for s in specs.values())


def available_bytes(device) -> int | None:
    """Memory a new allocation can use now: on CUDA the driver's free memory plus what torch's
    caching allocator holds unused (freed tensors' blocks, which the engine's allocations reuse:
    a process that built and dropped an engine before would otherwise look that much fuller);
    the kernel's MemAvailable (free plus reclaimable page cache) on the CPU; None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached))
    if device.type != "cpu":
        return None
    try:
        with open(_MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024   # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    try:  # free pages only (less than MemAvailable), where /proc/meminfo is absent
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(estimate: MemoryEstimate, device, what: str) -> None:
    """Raise one InputError line when `estimate` exceeds what `device` has available."""
    have = available_bytes(device)
    if have is None or estimate.total <= have:
        return
    raise InputError(
        f"{what} needs {estimate.describe()} but {torch.device(device)} has {_size(have)} available; "
        f"use a smaller spec (model_specs/deepseek_tiny.yaml for a smoke run), a 2-byte dtype (bf16), "
        f"fewer num_blocks or a larger device")
