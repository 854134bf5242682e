"""The body of the Tuning.linear.gemm_weights_early property tests of gemm_fp8 and gemm_int8
(test_kernels_gemm_fp8.py, test_kernels_gemm_int8.py): the GEMMs that issue their first ring stages' weights
before the PDL wait compute exactly what the knob-off launches do (the arithmetic is unchanged), and the wait
still orders x.

  * eagerly, the knob-on launches (quantiser and GEMMs, as programmatic dependent launches) on the same x
    give the knob-off launches' outputs bit for bit, outputs and workspaces poisoned first;
  * a CUDA graph of the knob-on launches with PDL, captured once over fixed buffers, replayed for x1 and
    then -- x overwritten in place by x2, outputs and workspaces poisoned -- for x2: each replay gives the
    knob-off outputs of its own x bit for bit.  A GEMM that read the quantised rows or scales before its
    wait would see the poison or the last replay's rows.
"""
from __future__ import annotations

import dataclasses

import torch

from harness import poison


def _pdl(launches):
    return [dataclasses.replace(la, pdl=True) for la in launches]


def check_early(off, on, x1, x2, outs, weights, T, workspaces, msg):
    """off / on: the knob-off and knob-on launches of one node (quantiser first); x1, x2: two inputs of the
    same shape; outs: the node's output tensors by name (written in place); workspaces(): fresh poisoned
    workspaces of the node at T."""
    from kernel_cases import runner

    def run(launches, x, work):
        for t in outs.values():
            poison(t)
        return runner().run_all(launches, values={"x": x, **outs}, weights=weights, sizes={"T": T}, workspaces=work)

    def outputs():
        torch.cuda.synchronize()
        return {o: t.clone() for o, t in outs.items()}

    def same(got, want, what):
        for o in outs:
            diff = got[o].view(torch.int16) != want[o].view(torch.int16)
            assert not bool(diff.any()), f"{o} {msg}: {what} differs at {int(diff.sum())} elements"

    run(off, x1, workspaces())
    want1 = outputs()
    run(off, x2, workspaces())
    want2 = outputs()
    run(_pdl(on), x1, workspaces())
    same(outputs(), want1, "the early launch")

    x = x1.clone()
    work = run(_pdl(on), x, workspaces())           # compiled and loaded before the capture; every workspace
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            runner().run_all(_pdl(on), values={"x": x, **outs}, weights=weights, sizes={"T": T}, workspaces=work)
    torch.cuda.current_stream().wait_stream(stream)
    for src, want, what in ((x1, want1, "graph replay of x1"), (x2, want2, "graph replay of x2 after x1")):
        x.copy_(src)
        for t in (*outs.values(), *work.values()):
            poison(t)
        graph.replay()
        same(outputs(), want, what)
