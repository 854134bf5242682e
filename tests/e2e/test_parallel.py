"""Tensor / expert parallel on the CPU: 2 and 4 gloo processes give one process's logits.

Tiny V2-Lite-, V2- and V3-style checkpoints (4 heads; hf_tiny.PARALLEL_CONFIGS) are built with
transformers and loaded by every rank through Engine.from_pretrained(..., tp=N), as a torchrun
launch would; each rank records what it read from the checkpoint, which must be exactly its
slice (ir/parallel.py).  Prefill, paged decode (decode_after) and greedy generation are
compared with a single-process engine in fp32.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from hf_tiny import BLOCK_SIZE, VOCAB, build

from ir.parallel import ParallelError

# gloo processes, seconds each: the full suite; tests/ir/test_parallel_rules.py and
# test_moe_expert_parallel_refs.py cover the split in the quick tier
pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 71], [88, 13, 4, 4, 30]]
NEW_TOKENS = 4
RTOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_env(rank: int, world: int, port: int) -> None:
    """What torchrun sets for each rank (loopback only)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _run(model_dir: str):
    from runtime import Engine, SamplingParams
    engine = Engine.from_pretrained(model_dir, tp=int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None,
                                    device="cpu", dtype=torch.float32, block_size=BLOCK_SIZE)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return {"prefill": engine.logits(PROMPTS), "decode": engine.logits(PROMPTS, decode_after=2),
            "tokens": [o.token_ids for o in outs]}


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    _launch_env(rank, world, port)
    torch.set_num_threads(1)
    import runtime.weights as weights
    opened = []
    original = weights.Checkpoint.open.__func__

    def open_and_keep(cls, path):
        ckpt = original(cls, path)
        opened.append(ckpt)
        return ckpt
    weights.Checkpoint.open = classmethod(open_and_keep)
    result = _run(model_dir)
    result["reads"] = sorted(opened[0].reads, key=repr)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist
    dist.destroy_process_group()


def expected_reads(model_dir, world: int, rank: int) -> list:
    """What rank `rank` may read: its slice of every split weight, its own experts, all the rest."""
    from runtime.weights import Checkpoint
    from ir.parallel import rule_for
    ckpt = Checkpoint.open(model_dir)
    out = []
    n_experts = None
    for name in sorted(ckpt.names()):
        if "rotary_emb" in name:
            continue
        rule = rule_for(name)
        shape = ckpt.shape(name)
        if rule is None:
            out.append((name, None))
        elif rule[0] == "experts":
            expert = int(name.split(".experts.")[1].split(".")[0])
            n_experts = n_experts or 1 + max(int(n.split(".experts.")[1].split(".")[0]) for n in ckpt.names()
                                              if ".experts." in n)
            per = n_experts // world
            if expert // per == rank:
                out.append((name, None))
        else:
            dim = 0 if rule[0] == "rows" else 1
            per = shape[dim] // world
            out.append((name, (dim, rank * per, (rank + 1) * per)))
    return sorted(out, key=repr)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {name: build(name, root / name) for name in ("v2_lite_tp", "v2_tp", "v3_tp")}


def _close(a, b, what):
    scale = b.abs().max().item()
    torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name, world", [("v2_lite_tp", 2), ("v2_tp", 2), ("v3_tp", 2), ("v3_tp", 4)])
def test_ranks_give_the_single_process_logits_and_read_only_their_slices(models, tmp_path, name, world):
    model_dir = str(models[name])
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(v, None)
    want = _run(model_dir)
    mp.start_processes(_rank_main, args=(world, _free_port(), model_dir, str(tmp_path)), nprocs=world,
                       start_method="spawn", join=True)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for kind in ("prefill", "decode"):
            for i, (a, b) in enumerate(zip(got[kind], want[kind])):
                _close(a, b, f"rank {rank} {kind} logits of prompt {i}")
        assert got["tokens"] == want["tokens"], f"rank {rank} greedy tokens"
        assert got["reads"] == expected_reads(model_dir, world, rank), f"rank {rank} read more than its slice"
    assert all(len(t) == NEW_TOKENS for t in want["tokens"]) and VOCAB


def _disagree_main(rank: int, world: int, port: int, out_dir: str) -> None:
    _launch_env(rank, world, port)
    from runtime import Engine
    path = os.path.join(os.path.dirname(__file__), "..", "..", "model_specs", "deepseek_tiny.yaml")
    from ir import load_spec
    spec = load_spec(path)
    if rank == 1:   # a different spec on one rank
        spec = load_spec(spec.text.replace("vocab: ", "vocab: 1", 1), file="other.yaml")
    try:
        Engine.from_spec(spec, tp=world, device="cpu", dtype=torch.float32, block_size=4, num_blocks=4)
        message = "no error"
    except ParallelError as exc:
        message = str(exc)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(message)


def test_ranks_that_disagree_on_the_spec_are_refused(tmp_path):
    mp.start_processes(_disagree_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn",
                       join=True)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "the ranks disagree on the spec (ranks 0:" in text and "ranks 1:" in text, text


def test_tp_outside_torchrun_says_how_to_launch(monkeypatch):
    from runtime import Engine
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    path = os.path.join(os.path.dirname(__file__), "..", "..", "model_specs", "deepseek_tiny.yaml")
    with pytest.raises(ParallelError, match=r"tp=2 needs one process per rank: launch with torchrun "
                                            r"--nproc-per-node 2 \(not set: RANK, WORLD_SIZE"):
        Engine.from_spec(path, tp=2, device="cpu", dtype=torch.float32)
    with pytest.raises(ParallelError, match="cannot run on 3 ranks"):
        Engine.from_spec(path, tp=3, device="cpu", dtype=torch.float32)
