"""Host lists to device tensors without a stream synchronisation.

A copy from pageable host memory makes CUDA drain the stream first; staging the step's
metadata in pinned memory lets the copy queue behind the previous step's kernels instead.
torch's caching host allocator keeps each pinned buffer alive until its copy has run.
"""
from __future__ import annotations

import torch


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """values (a list, nested lists or a numpy array) as a `dtype` tensor on `device`."""
    host = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
