"""Host lists to device tensors without a stream synchronisation.

A copy from pageable host memory makes CUDA drain the stream first; staging the step's
metadata in pinned memory lets the copy queue behind the previous step's kernels instead.
torch's caching host allocator keeps each pinned buffer alive until its copy has run.
"""
from __future__ import annotations

import numpy as np
import torch


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """values (a list, nested lists or a numpy array) as a `dtype` tensor on `device`."""
    host = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_together(parts: list, device) -> list:
    """int64 lists (None: skipped) as device tensors from one host-to-device copy: a step's ids,
    positions, slots and logit rows cost one upload instead of four (each ~20-50 us of host time on
    a decode step's critical path, PERF_NOTES v16).  Each part starts on a 128-byte boundary, as a
    tensor of its own would."""
    starts, n = [], 0
    for p in parts:
        starts.append(n)
        n += -(-len(p) // 16) * 16 if p is not None else 0
    flat = np.zeros(max(n, 1), dtype=np.int64)
    for p, at in zip(parts, starts):
        if p:
            flat[at:at + len(p)] = p
    whole = upload(flat, torch.int64, device)
    return [None if p is None else whole[at:at + len(p)] for p, at in zip(parts, starts)]
