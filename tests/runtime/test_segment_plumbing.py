"""The cuda backend's step with persistent segments (Tuning.persistent.segments) on the CPU: the plans
are the tiny model's with segments, the kernels a stub that computes each launch's nodes with their
reference ops into the buffers the backend bound (a segment: every member's node, in graph order).
So the backend must place every member's outputs before the segment's launch runs (their own nodes'
turns come after it), bind the lead's cache, and skip nothing: the logits and greedy tokens equal the
reference backend's, below the segments' token range and above it (where the members' own launches
run again)."""
from __future__ import annotations

import functools

import torch

from codegen import sizes as size_exprs
from codegen.bundle import plan_spec
from codegen.kernel import Options
from codegen.tuning import parse_tune
from ir.graph import topo_order
from runtime import SamplingParams
from runtime.cuda_backend import CudaBackend
from test_cuda_backend_plumbing import ReferenceKernels
from tiny_engine import compiled, make_engine, prompts

H100_SMS = 132


@functools.lru_cache(maxsize=None)
def segmented():
    model, _ = compiled()
    sp = plan_spec(model.spec, Options(dtype="fp32", block_size=4, tuning=parse_tune(["persistent.segments=true"])))
    return sp.plans, sp.graphs


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
