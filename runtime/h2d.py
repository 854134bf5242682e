"""Host lists to device tensors without a stream synchronisation.

A copy from pageable host memory makes CUDA drain the stream first; staging the step's
metadata in pinned memory lets the copy queue behind the previous step's kernels instead.
torch's caching host allocator keeps each pinned buffer alive until its copy has run.
"""
from __future__ import annotations

import numpy as np
import torch


def _staged(values, dtype: torch.dtype, device) -> torch.Tensor:
    """values as a host tensor that a copy to `device` can start from without a stream sync:
    pinned when `device` is a GPU (the caching host allocator then keeps it until the copy ran)."""
    host = torch.as_tensor(values, dtype=dtype)
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """values (a list, nested lists or a numpy array) as a `dtype` tensor on `device`."""
    return _staged(values, dtype, device).to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, values) -> None:
    """values (dst's shape) copied into the existing tensor `dst`, staged as `upload` stages them:
    a step's inputs written straight into buffers a captured graph reads (cuda_graphs.DecodeInputs)."""
    host = _staged(values, dst.dtype, dst.device)
    if host.shape != dst.shape:   # copy_ would broadcast a wrong shape silently
        raise ValueError(f"upload_into: values of shape {tuple(host.shape)} into a tensor of {tuple(dst.shape)}")
    dst.copy_(host, non_blocking=True)


def packed_offsets(lengths: list) -> tuple[list[int], int]:
    """Where each part of a packed int64 upload starts (a None part takes no room), and the
    elements in all.  Each part starts on a 128-byte boundary (16 elements), as a tensor of its
    own would.  The one layout both upload_together and a decode graph's packed inputs use."""
    starts, n = [], 0
    for length in lengths:
        starts.append(n)
        n += -(-length // 16) * 16 if length is not None else 0
    return starts, n


def pack(parts: list) -> tuple[np.ndarray, list[int]]:
    """int64 lists (None: skipped) as one host array laid out by packed_offsets, and each part's start."""
    starts, n = packed_offsets([None if p is None else len(p) for p in parts])
    flat = np.zeros(max(n, 1), dtype=np.int64)
    for p, at in zip(parts, starts):
        if p:
            flat[at:at + len(p)] = p
    return flat, starts


def upload_together(parts: list, device) -> list:
    """int64 lists (None: skipped) as device tensors from one host-to-device copy: a step's ids,
    positions, slots and logit rows cost one upload instead of four (each ~20-50 us of host time on
    a decode step's critical path)."""
    flat, starts = pack(parts)
    whole = upload(flat, torch.int64, device)
    return [None if p is None else whole[at:at + len(p)] for p, at in zip(parts, starts)]
