"""Collectives: the one op that talks to the other ranks.

Under tensor / expert parallelism (ir/parallel.py, ir/passes/shard_for_rank.py) each rank
computes a partial sum of some values (o_proj over its heads, the FFN down over its columns,
the MoE over its experts); ``all_reduce`` makes the whole value again on every rank.

Reference semantics: ``torch.distributed.all_reduce`` (sum) on a copy when a process group of
more than one rank is initialised, identity otherwise; a test may install its own reducer for
the calling thread (``use_reducer``) to run every rank's graph in one process.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from ..lazy import torch
from .base import OpDef, TType, expect, is_float, register

_local = threading.local()


@contextmanager
def use_reducer(reduce):
    """Run ``all_reduce`` in this thread through ``reduce(x) -> sum over ranks`` (tests)."""
    before = getattr(_local, "reduce", None)
    _local.reduce = reduce
    try:
        yield
    finally:
        _local.reduce = before


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over every rank, as a new tensor (``x`` itself is left as it was)."""
    reduce = getattr(_local, "reduce", None)
    if reduce is not None:
        return reduce(x)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    out = x.contiguous().clone()   # in place on a copy: the partial sum may still be read
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@register
class AllReduce(OpDef):
    name = "all_reduce"
    doc = "x [T, n] (this rank's partial sum) -> the sum over every rank [T, n]; identity on one rank"

    @classmethod
    def infer(cls, node, ins, model):
        (x,) = ins
        expect(len(x.shape) == 2 and is_float(x), f"all_reduce expects a float [T, n] value, got {x}")
        return [TType(x.shape, x.dtype)], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [all_reduce_sum(ins[0])]
