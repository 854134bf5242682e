"""The cuda backend's step plumbing on 2 gloo ranks: each rank's lowered plan (its kernels at the
rank's shapes, the all_reduce and moe_local_experts library calls) run by CudaBackend with the
reference ops standing in for the kernels (test_cuda_backend_plumbing.ReferenceKernels) gives
the single-process reference engine's logits for prefill and paged decode."""
from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp
from test_cuda_backend_plumbing import ReferenceKernels, SteppedCuda
from tiny_engine import CONFIG, prompts

from ir import load_spec
from ir.config_to_spec import spec_from_config
from runtime import Engine
from runtime.model_loader import compile_graphs, random_weights, weight_specs

WORLD = 2
LENGTHS = [1, 3, 4, 5]


def _spec():
    return load_spec(spec_from_config(dict(CONFIG, num_attention_heads=4), name="tiny_tp"), file="tiny_tp.yaml")


def _full_weights(spec):
    return random_weights(weight_specs(compile_graphs(spec).graphs), dtype=torch.float32, device="cpu", seed=7,
                          std=0.3)


def _rank_weights(graphs, full):
    out = {}
    for G in graphs.values():
        for name in G.graph["weights"]:
            t, shard = full[name], G.graph.get("shards", {}).get(name)
            if shard is not None:
                t = t[:, shard.start:shard.stop] if shard.kind == "cols" else t[shard.start:shard.stop]
            out[name] = t.contiguous()
    return out


def _rank_main(rank, port, out_dir):
    import torch.distributed as dist
    from codegen.lower import lower_graph
    from codegen.kernel import LibraryCall
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    spec = _spec()
    model = compile_graphs(spec, world=WORLD, rank=rank)
    plans = {phase: lower_graph(G) for phase, G in model.graphs.items()}
    calls = sorted({s.op for p in plans.values() for s in p.steps if isinstance(s, LibraryCall)})
    weights = _rank_weights(model.graphs, _full_weights(spec))
    backend = SteppedCuda(plans, weights, ReferenceKernels(model.graphs), dtype=torch.float32,
                          top_k=spec.dims["top_k"])
    engine = Engine(spec, model.graphs, weights, backend="reference", device="cpu", dtype=torch.float32,
                    block_size=4, backend_impl=backend)
    ps = prompts(LENGTHS)
    torch.save({"prefill": engine.logits(ps), "decode": engine.logits(ps, decode_after=2), "calls": calls},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_cuda_backend_steps_on_two_ranks_match_one_process(tmp_path):
    spec = _spec()
    full = compile_graphs(spec)
    ref = Engine(spec, full.graphs, _full_weights(spec), backend="reference", device="cpu", dtype=torch.float32,
                 block_size=4)
    ps = prompts(LENGTHS)
    want = {"prefill": ref.logits(ps), "decode": ref.logits(ps, decode_after=2)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(port, str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["calls"] == ["all_reduce", "linear", "moe_local_experts", "split"]
        for kind in ("prefill", "decode"):
            for a, b in zip(got[kind], want[kind]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
