"""The cuda backend's step plumbing on the CPU: buffer plan, views, library calls, cache binding.

The kernels are replaced by a stub runner that computes each node with its reference op and
writes the result into the buffers the backend allocated (as a kernel would), so everything the
backend itself does — allocate or alias each value, run the library calls, bind each launch to
its layer's cache, group a node's launches — is checked against the reference backend.
"""
from __future__ import annotations

import torch

from codegen.kernel import Options
from codegen.lower import lower_graph
from ir.context import StepContext
from ir.graph import node_view
from ir.ops import OPS
from runtime.cuda_backend import CudaBackend
from runtime.reference_backend import ReferenceBackend
from tiny_engine import compiled, make_engine, prompts


class ReferenceKernels:
    """Stands in for KernelRunner: one run_all per node, results written into the given buffers."""

    def __init__(self, graphs):
        self.graphs = graphs
        self.phase = None
        self.step: StepContext | None = None
        self.calls = 0

    def run_all(self, launches, *, values, weights, ctx, sizes):
        G = self.graphs[self.phase]
        nid = launches[0].nodes[0]
        assert all(l.nodes[0] == nid for l in launches), "a node's launches must come together"
        data = G.nodes[nid]
        ins = []
        for v in data["inputs"]:
            x = values[v]
            if isinstance(x, dict):   # routing buffers, as the reference ops want them
                K = int(str(G.graph["values"][v].shape[0]).split("*")[1])
                x = {"order": x["order"].long(), "offsets": x["offsets"].long(), "top_k": K}
            ins.append(x)
        w = {role: weights[name] for role, name in data["weights"].items()}
        outs = OPS[data["op"]].run(node_view(G, nid), ins, w, self.step)
        for name, out in zip(data["outputs"], outs):
            buf = values[name]
            if isinstance(buf, dict):
                buf["order"].copy_(out["order"])
                buf["offsets"].copy_(out["offsets"])
            elif G.graph["values"][name].dtype != "state":
                assert buf.shape == out.shape, f"{nid}: buffer {tuple(buf.shape)} for a {tuple(out.shape)} result"
                buf.copy_(out)
        self.calls += 1
        return {}


class SteppedCuda(CudaBackend):
    """CudaBackend with the stub kernels; forward() tells the stub which step it runs."""

    def forward(self, phase, ids, ctx):
        self.runner.phase, self.runner.step = phase, ctx
        return self._forward(phase, ids, ctx, self._meta(ctx, ids.device), self._sizes(ctx))


def test_backend_plumbing_matches_the_reference_backend():
    model, weights = compiled()
    plans = {phase: lower_graph(G, Options(dtype="fp32", block_size=4)) for phase, G in model.graphs.items()}
    stub = ReferenceKernels(model.graphs)
    ours = make_engine(backend_impl=SteppedCuda(model.spec, model.graphs, weights, plans, stub,
                                                dtype=torch.float32, block_size=4))
    ref = make_engine()
    assert isinstance(ref.backend, ReferenceBackend)
    ps = prompts([1, 3, 4, 5, 9])
    for a, b in zip(ours.logits(ps, decode_after=2), ref.logits(ps, decode_after=2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert stub.calls > 0
