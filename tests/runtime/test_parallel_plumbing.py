"""The cuda backend's step plumbing on 2 gloo ranks: each rank's lowered plan (its kernels at the
rank's shapes, the all_reduce and moe_local_experts library calls) run by CudaBackend with the
reference ops standing in for the kernels (test_cuda_backend_plumbing.ReferenceKernels) gives
the single-process reference engine's logits for prefill and paged decode.

Then the same through a real bundle: compile_bundle(world=2) (NVRTC on the CPU) makes one bundle
for both ranks; each rank runs Engine.from_pretrained(model_dir, bundle=..., tp=2) with every
compiler entry point made to raise, so it runs its rank's plan from the manifest and reads only
the slices the manifest lists.  Only what needs a GPU is stood in for: the device checks, the
device's arch, and the kernels (reference ops, as above)."""
from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp
from test_cuda_backend_plumbing import ReferenceKernels, SteppedCuda
from tiny_engine import CONFIG, prompts

from ir import load_spec
from ir.config_to_spec import spec_from_config
from ir.parallel import rule_for
from runtime import Engine, SamplingParams
from runtime.model_loader import bind_checkpoint, checkpoint_tensors, compile_graphs, random_weights, weight_specs

pytestmark = pytest.mark.slow     # gloo processes compiling bundles, seconds each

WORLD = 2
LENGTHS = [1, 3, 4, 5]


def _spec():
    return load_spec(spec_from_config(dict(CONFIG, num_attention_heads=4), name="tiny_tp"), file="tiny_tp.yaml")


def _full_weights(spec):
    """The one-process model's random weights as checkpoint tensors (name -> whole tensor)."""
    specs = weight_specs(compile_graphs(spec).graphs)
    return checkpoint_tensors(specs, random_weights(specs, dtype=torch.float32, device="cpu", seed=7, std=0.3))


def _rank_weights(graphs, full):
    """A rank's weights cut from the checkpoint tensors, as its loader reads them."""
    return bind_checkpoint(weight_specs(graphs), full)


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
    ref = Engine(spec, full.graphs, bind_checkpoint(weight_specs(full.graphs), _full_weights(spec)),
                 backend="reference", device="cpu", dtype=torch.float32, block_size=4)
    ps = prompts(LENGTHS)
    want = {"prefill": ref.logits(ps), "decode": ref.logits(ps, decode_after=2)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(port, str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # (the linears' cuBLAS calls above the skinny kernel's token count: sibling-fused ones too)
        assert got["calls"] == ["all_reduce", "gate_up_silu", "linear", "moe_local_experts", "multi_linear", "split"]
        for kind in ("prefill", "decode"):
            for a, b in zip(got[kind], want[kind]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


# -- through a bundle compiled for both ranks ---------------------------------------------------

NEW_TOKENS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_checkpoint(spec, model_dir):
    """The full model as a Hugging Face checkpoint: one tensor per expert, config.json beside it."""
    from safetensors.torch import save_file
    tensors = {name: t.contiguous() for name, t in _full_weights(spec).items()}
    model_dir.mkdir()
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(dict(CONFIG, num_attention_heads=4)))
    return {name: tuple(t.shape) for name, t in tensors.items()}


def _expected_reads(shapes: dict, rank: int, experts: int) -> list:
    """What rank `rank` may read, straight from ir/parallel.py's rules: its slice of each split
    weight, its own experts' tensors, every replicated tensor whole."""
    out = []
    for name, shape in shapes.items():
        rule = rule_for(name)
        if rule is None:
            out.append((name, None))
        elif rule[0] == "experts":
            if int(name.split(".experts.")[1].split(".")[0]) // (experts // WORLD) == rank:
                out.append((name, None))
        else:
            dim = 0 if rule[0] == "rows" else 1
            per = shape[dim] // WORLD
            out.append((name, (dim, rank * per, (rank + 1) * per)))
    return sorted(out, key=repr)


def _forbid(*_, **__):
    raise AssertionError("running a bundle must not run the compiler")


def _bundle_rank_main(rank, port, model_dir, bundle, damaged, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import codegen.bundle
    import codegen.lower
    import codegen.nvrtc
    import ir.graph
    import ir.passes
    import runtime.cuda_backend as cuda_backend
    import runtime.engine as engine_mod
    import runtime.weights as weights_mod
    from codegen.bundle import BundleError
    from ir.parallel import ParallelError
    graphs = compile_graphs(_spec(), world=WORLD, rank=rank).graphs   # for the stand-in kernels only
    seen, opened = {}, []

    class StandIn(SteppedCuda):
        @classmethod
        def from_bundle(cls, loaded, weights, **kw):
            backend = super().from_bundle(loaded, weights, **kw)
            seen.update(cubins=sorted(backend.runner._cubins), use_graphs=backend.use_graphs,
                        world=loaded.world, rank=loaded.rank, key=loaded.key)
            backend.runner = ReferenceKernels(graphs)
            return backend

    # What needs a GPU: the device checks, the device's arch, the kernels.
    engine_mod.check_device = lambda backend, device: torch.device(device)
    cuda_backend.check_cuda_device = torch.device
    cuda_backend.device_arch_of = lambda device: "sm_90"
    cuda_backend.CudaBackend = StandIn
    for mod, name in ((ir.passes, "run_pipeline"), (ir.graph, "build_graph"), (codegen.lower, "lower_graph"),
                      (codegen.nvrtc, "compile_cubin"), (codegen.bundle, "plan_spec"),
                      (codegen.bundle, "compile_bundle")):
        setattr(mod, name, _forbid)
    original = weights_mod.Checkpoint.open.__func__

    def open_and_keep(cls, path):
        opened.append(original(cls, path))
        return opened[-1]
    weights_mod.Checkpoint.open = classmethod(open_and_keep)

    engine = Engine.from_pretrained(model_dir, bundle=bundle, tp=WORLD, device="cpu")
    ps = prompts(LENGTHS)
    outs = engine.generate(ps[:2], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    result = {"prefill": engine.logits(ps), "decode": engine.logits(ps, decode_after=2),
              "tokens": [o.token_ids for o in outs], "reads": sorted(opened[0].reads, key=repr),
              "block_size": engine.block_size, **seen}
    # Rank 1 is handed a damaged bundle: it says so, rank 0 is told the ranks disagree; neither hangs.
    try:
        cuda_backend.open_bundle(None, bundle_dir=damaged if rank == 1 else bundle, device="cpu", dtype=None,
                                 block_size=None, world=WORLD, rank=rank)
        result["mismatch"] = "no error"
    except (BundleError, ParallelError) as exc:
        result["mismatch"] = f"{type(exc).__name__}: {exc}"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_bundle_for_two_ranks_runs_each_rank_from_its_manifest(tmp_path):
    from codegen.bundle import compile_bundle
    spec = _spec()
    res = compile_bundle(spec, tmp_path / "bundle", dtype="fp32", block_size=4, cache_dir=tmp_path / "cache",
                         world=WORLD, progress=False)
    damaged = tmp_path / "damaged"
    shutil.copytree(res.path, damaged)
    next(damaged.glob("kernels/*.cubin")).write_bytes(b"garbage")
    shapes = _write_checkpoint(spec, tmp_path / "model")
    full = compile_graphs(spec)
    ref = Engine(spec, full.graphs, bind_checkpoint(weight_specs(full.graphs), _full_weights(spec)),
                 backend="reference", device="cpu", dtype=torch.float32, block_size=4)
    ps = prompts(LENGTHS)
    want = {"prefill": ref.logits(ps), "decode": ref.logits(ps, decode_after=2),
            "tokens": [o.token_ids for o in ref.generate(ps[:2], SamplingParams(max_new_tokens=NEW_TOKENS,
                                                                                ignore_eos=True))]}
    mp.start_processes(_bundle_rank_main, args=(_free_port(), str(tmp_path / "model"), str(res.path), str(damaged),
                                                str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True)
    kernels = sorted(json.loads((res.path / "manifest.json").read_text())["kernels"])
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert (got["world"], got["rank"], got["key"], got["block_size"]) == (WORLD, rank, res.key, 4)
        assert got["cubins"] == kernels and got["use_graphs"] is False
        for kind in ("prefill", "decode"):
            for a, b in zip(got[kind], want[kind]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        assert got["tokens"] == want["tokens"]
        assert got["reads"] == _expected_reads(shapes, rank, spec.dims["experts"]), f"rank {rank} reads"
    assert torch.load(tmp_path / "rank1.pt")["mismatch"].startswith(f"BundleError: bundle {damaged} is damaged")
    zero = torch.load(tmp_path / "rank0.pt")["mismatch"]
    assert zero.startswith("ParallelError: the ranks disagree on the bundle key (ranks 0:") and "\n" not in zero
