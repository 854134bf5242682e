"""Running one model over several processes (tensor / expert parallel, torch.distributed).

Launch one process per rank with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), and ask every rank for the same engine:

    torchrun --nproc-per-node 2 my_script.py       # my_script: Engine.from_pretrained(model_dir, tp=2)

Each rank builds its own part of the graphs (ir/passes/shard_for_rank.py), reads only its
slice of the checkpoint (runtime/weights.py, by the table in ir/parallel.py) and runs the
same steps on the same inputs; the all_reduce steps sum the ranks' partial results (gloo on
the CPU, NCCL on GPUs, with NVLink multicast off).  Greedy and seeded sampling then pick the
same token on every rank, because every rank holds the same logits.  On backend="cuda" every
rank loads the same bundle (compiled for all the ranks, codegen/bundle.py) and runs its rank's
plan from it; the ranks check that they agree on the bundle's key before any weight is read.
"""
from __future__ import annotations

import atexit
import hashlib
import os

import torch

from ir.parallel import ParallelError

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_parallel(tp, device: torch.device) -> tuple[int, int, torch.device]:
    """(world, rank, device) for `tp` ranks: the default process group, initialised here from
    torchrun's environment unless the caller already did; tp None or 1 is one process."""
    if tp is None or tp == 1:
        return 1, 0, device
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ParallelError(f"tp must be a whole number >= 1, got {tp!r}")
    import torch.distributed as dist
    if not dist.is_initialized():
        missing = [v for v in LAUNCH_VARS if v not in os.environ]
        if missing:
            raise ParallelError(f"tp={tp} needs one process per rank: launch with torchrun --nproc-per-node {tp} "
                                f"(not set: {', '.join(missing)})")
        if device.type == "cuda":
            # NVLink multicast stays off (issue 12): NCCL runs its plain ring / tree kernels.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # The group this process joined is left at exit, also when the engine refuses to start
        # (ranks that disagree): a gloo group still alive at interpreter teardown aborts the
        # process ("terminate called without an active exception") instead of exiting cleanly.
        atexit.register(_leave_group)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp:
        raise ParallelError(f"tp={tp} but the job has {world} ranks (torchrun --nproc-per-node {tp})")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return world, rank, device


def _leave_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def check_ranks_agree(what: str, text: str) -> None:
    """Raise ParallelError on every rank unless every rank passed the same `text` (e.g. the spec)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = hashlib.sha256(text.encode()).hexdigest()[:16]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if len(set(every)) > 1:
        groups = {}
        for r, h in enumerate(every):
            groups.setdefault(h, []).append(r)
        shown = "; ".join(f"ranks {', '.join(map(str, rs))}: {h}" for h, rs in groups.items())
        raise ParallelError(f"the ranks disagree on the {what} ({shown}); give every rank the same one")


def agree_after(what: str, text: str, failure: Exception | None = None) -> None:
    """check_ranks_agree after a step that may have failed on some ranks only (loading a bundle):
    every rank still takes part in the all-gather, so none is left waiting on one that gave up;
    a rank whose step failed then raises its own error, and the others a ParallelError."""
    try:
        check_ranks_agree(what, text if failure is None else f"(failed: {failure})")
    except ParallelError:
        if failure is not None:
            raise failure from None
        raise
    if failure is not None:
        raise failure


def is_main_rank() -> bool:
    """True on rank 0 (or without a process group): the rank that prints."""
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0
