"""The cuda backend's step with persistent segments (Tuning.persistent.segments) on the CPU: the plans
are the tiny model's with segments, the kernels a stub that computes each launch's nodes with their
reference ops into the buffers the backend bound (a segment: every member's node, in graph order).
So the backend must place every member's outputs before the segment's launch runs (their own nodes'
turns come after it), bind the lead's cache, and skip nothing: the logits and greedy tokens equal the
reference backend's, below the segments' token range and above it (where the members' own launches
run again)."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from codegen import sizes as size_exprs
from codegen.bundle import plan_spec
from codegen.kernel import Options
from codegen.tuning import parse_tune
from ir.graph import topo_order
from ir import load_spec
from ir.config_to_spec import spec_from_config
from runtime import Engine, SamplingParams
from runtime.model_loader import compile_graphs, random_weights, weight_specs
from runtime.cuda_backend import CudaBackend
from test_cuda_backend_plumbing import ReferenceKernels
from tiny_engine import compiled, make_engine, prompts

H100_SMS = 132
GPU_TESTS = str(Path(__file__).resolve().parents[1] / "gpu")   # the GPU engine test's model (lite_widths)


@functools.lru_cache(maxsize=None)
def segmented(which: str = "tiny"):
    model, _ = compiled() if which == "tiny" else lite_widths()
    dtype = "fp32" if which == "tiny" else "bf16"
    sp = plan_spec(model.spec, Options(dtype=dtype, block_size=4, tuning=parse_tune(["persistent.segments=true"])))
    return sp.plans, sp.graphs


@functools.lru_cache(maxsize=None)
def lite_widths():
    """The GPU engine test's model at V2-Lite's widths (tests/gpu/test_kernels_persistent.py LITE_WIDTHS), bf16
    random weights: its segments hold every body V2-Lite's do (the combine + norm, v_up)."""
    if GPU_TESTS not in sys.path:
        sys.path.insert(0, GPU_TESTS)
    from harness import tiny_config
    from test_kernels_persistent import LITE_WIDTHS
    spec = load_spec(spec_from_config(tiny_config(**LITE_WIDTHS, vocab=61), name="lite_widths"), file="lite.yaml")
    model = compile_graphs(spec)
    return model, random_weights(weight_specs(model.graphs), dtype=torch.bfloat16, device="cpu", seed=7, std=0.02)


class NodeKernels(ReferenceKernels):
    """Each launch with work computes its nodes with their reference ops (a segment: every member's)."""

    def __init__(self, graphs):
        super().__init__(graphs)
        self.order = {ph: {n: k for k, n in enumerate(topo_order(G))} for ph, G in graphs.items()}
        self.segments_ran = 0

    def run_all(self, launches, *, values, weights, ctx, sizes, workspaces=None):
        for launch in launches:
            if not all(size_exprs.evaluate(g, sizes) > 0 for g in launch.grid):
                continue
            self.segments_ran += launch.family == "segment"
            for nid in sorted(launch.nodes, key=self.order[self.phase].__getitem__):
                missing = [v for v in self.graphs[self.phase].nodes[nid]["outputs"] if v not in values]
                assert not missing, f"{launch.name}: {nid}'s outputs {missing} were not placed before it ran"
                self.run_node(nid, values, weights)
        return {}


class SegmentedCuda(CudaBackend):
    def forward(self, phase, ids, ctx):
        self.runner.phase, self.runner.step = phase, ctx
        return self._forward(phase, ids, ctx, self._meta(ctx, ids.device), {**self._sizes(ctx), "SMS": H100_SMS})


def test_the_decode_step_with_segments_binds_every_member_and_matches_the_reference():
    model, weights = compiled()
    plans, graphs = segmented()
    assert any(s.family == "segment" for s in plans["decode"].launches)
    stub = NodeKernels(graphs)
    backend = SegmentedCuda(plans, weights, stub, dtype=torch.float32, top_k=model.spec.dims["top_k"])
    backend.use_graphs = False
    ours, ref = make_engine(backend_impl=backend), make_engine()
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, return_logits=True)
    for lens in ([3, 5, 2], [2] * 17):        # decode batches inside the segments' range (<= 16) and above
        ran = stub.segments_ran
        ps = prompts(lens, seed=len(lens))
        for a, b in zip(ours.generate(ps, sp), ref.generate(ps, sp)):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        assert (stub.segments_ran > ran) == (len(lens) <= 16)


@pytest.mark.slow     # ~8 s: a 2048-wide bf16 model on the CPU; the tiny model's test covers the stage
def test_the_decode_step_with_v_up_and_combine_members_matches_the_reference():
    """bf16 at V2-Lite's widths: segments led by v_up (a 3-D grid) and by the MoE combine + norm, each
    member's outputs placed before the segment runs; the same logits and tokens as the reference backend."""
    model, weights = lite_widths()
    plans, graphs = segmented("lite_widths")
    kinds = {m["kind"] for s in plans["decode"].launches if s.family == "segment" for m in s.params["members"]}
    assert {"v_up", "combine_norm"} <= kinds
    stub = NodeKernels(graphs)
    backend = SegmentedCuda(plans, weights, stub, dtype=torch.bfloat16, top_k=model.spec.dims["top_k"])
    backend.use_graphs = False
    kw = dict(backend="reference", device="cpu", dtype=torch.bfloat16, block_size=4)
    ours = Engine(model.spec, model.graphs, weights, backend_impl=backend, **kw)
    ref = Engine(model.spec, model.graphs, weights, **kw)
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True, return_logits=True)
    ps = prompts([3, 5, 2], seed=1)
    for a, b in zip(ours.generate(ps, sp), ref.generate(ps, sp)):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.logits, b.logits)
    assert stub.segments_ran > 0
