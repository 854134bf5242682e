"""A decode graph's input buffers on the CPU (cuda_graphs.DecodeInputs; the capture itself is
tested on the GPU, tests/gpu/test_e2e_cuda.py): laid out as upload_together lays out a step's
upload, shared by a shape's graphs of every context bucket, copied into only from tensors that are
not already them, and written by the engine straight from the host on a decode step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import runtime.cuda_graphs as cg
from ir.context import StepContext
from runtime import SamplingParams
from runtime.h2d import packed_offsets, upload_together
from tiny_engine import make_engine, prompts


@pytest.mark.parametrize("B", [1, 5, 16, 17, 40])
def test_decode_inputs_are_laid_out_as_upload_together_lays_out_a_step(B):
    ids, positions, slots = list(range(B)), list(range(100, 100 + B)), list(range(200, 200 + B))
    got = upload_together([ids, positions, slots, None], "cpu")   # the engine's decode upload
    x = cg.DecodeInputs(B, 3, "cpu")
    starts, n = packed_offsets([B, B, B])
    assert x.packed.shape == (n,) and got[0].untyped_storage().nbytes() == n * 8
    for view, part, at in zip((x.ids, x.positions, x.slot_mapping), got[:3], starts):
        assert view.storage_offset() == part.storage_offset() == at and view.shape == part.shape == (B,)
        assert view.untyped_storage().data_ptr() == x.packed.untyped_storage().data_ptr()
    tables = np.arange(B * 3, dtype=np.int32).reshape(B, 3)
    x.write(ids, positions, slots, tables)
    assert (x.ids.tolist(), x.positions.tolist(), x.slot_mapping.tolist()) == (ids, positions, slots)
    assert x.block_tables.dtype == torch.int32 and x.block_tables.tolist() == tables.tolist()
    assert x.query_start.tolist() == list(range(B + 1))


class _CopiesInto(TorchDispatchMode):
    """Records the destination of every copy_ made while it is on."""

    def __init__(self):
        super().__init__()
        self.into = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.into.append(args[0].data_ptr())
        return func(*args, **(kwargs or {}))


class _Graph:
    def __init__(self, out, inputs):
        self.out, self.inputs = out, inputs

    def replay(self):   # "the step": logits are the ids, so a replay shows what the buffers hold
        torch.add(self.inputs["ids"].float()[:, None], 0, out=self.out)


def _graphs(monkeypatch):
    dg = cg.DecodeGraphs(backend=None)
    captured = []

    def capture(x, ctx, bucket):
        out = torch.zeros(len(x.ids), 1)
        captured.append(cg._Captured(_Graph(out, x.named), x.named, out))
        return captured[-1]
    monkeypatch.setattr(dg, "_capture", capture)
    return dg, captured


def _ctx(ids, positions, slots, tables, cache):
    return StepContext(positions=positions, query_lens=[1] * len(ids), context_lens=[p + 1 for p in positions.tolist()],
                       block_tables=tables, slot_mapping=slots, kv_cache=cache, block_size=16)


def test_run_copies_a_callers_tensors_and_skips_the_buffers_themselves(monkeypatch):
    dg, captured = _graphs(monkeypatch)
    cache = [torch.zeros(1)]
    x = dg.inputs(3, 4, "cpu")
    buffers = {t.data_ptr() for t in (x.ids, x.positions, x.slot_mapping, x.block_tables)}
    # tensors of the caller's: all four copied in, then replayed
    ids, tables = torch.tensor([5, 6, 7]), torch.arange(12, dtype=torch.int32).reshape(3, 4)
    with _CopiesInto() as copies:
        out = dg.run(ids, _ctx(ids, torch.tensor([10, 20, 30]), torch.tensor([1, 2, 3]), tables, cache))
    assert sorted(p for p in copies.into if p in buffers) == sorted(buffers)
    assert out[:, 0].tolist() == [5, 6, 7] and x.positions.tolist() == [10, 20, 30]
    assert x.block_tables.tolist() == tables.tolist()
    # the buffers themselves (or other views of them), written from the host as the engine writes
    # them: nothing copied
    x.write([1, 2, 3], [40, 50, 60], [7, 8, 9], np.zeros((3, 4), dtype=np.int32))
    positions = x.packed.narrow(0, x.positions.storage_offset(), 3)
    with _CopiesInto() as copies:
        out = dg.run(x.ids, _ctx(x.ids, positions, x.slot_mapping, x.block_tables.view(3, 4), cache))
    assert not [p for p in copies.into if p in buffers]
    assert out[:, 0].tolist() == [1, 2, 3] and len(captured) == 1
    # another context bucket: another graph on the same buffers
    dg.run(x.ids, _ctx(x.ids, torch.tensor([300, 5, 6]), x.slot_mapping, x.block_tables, cache))
    assert len(captured) == 2 and captured[1].inputs is captured[0].inputs is x.named
    assert x.positions.tolist() == [300, 5, 6]
    assert dg.inputs(3, 4, torch.device("cpu")) is x and dg.inputs(3, 5, "cpu") is not x


class _Offering:
    """The reference backend, offering a decode step's buffers as CudaBackend does on a GPU."""

    def __init__(self, inner):
        self.inner, self.graphs, self.decodes = inner, cg.DecodeGraphs(backend=None), []

    def decode_inputs(self, B, W, device):
        return self.graphs.inputs(B, W, device)

    def forward(self, phase, ids, ctx):
        if phase == "decode":
            x = self.graphs.inputs(len(ids), int(ctx.block_tables.shape[1]), ids.device)
            assert all(cg._is(a, b) for a, b in ((ids, x.ids), (ctx.positions, x.positions),
                                                 (ctx.slot_mapping, x.slot_mapping),
                                                 (ctx.block_tables, x.block_tables)))
            assert x.positions.tolist() == [n - 1 for n in ctx.context_lens]
            self.decodes.append(len(ids))
        return self.inner.forward(phase, ids, ctx)


def test_the_engine_writes_a_decode_step_into_the_backends_buffers():
    plain, offered = make_engine(block_size=4), make_engine(block_size=4)
    offered.backend = _Offering(offered.backend)
    ps = prompts([5, 9, 2])
    for a, b in zip(plain.logits(ps, decode_after=2), offered.logits(ps, decode_after=2)):
        assert torch.equal(a, b)
    sp = SamplingParams(max_new_tokens=4)
    assert [o.token_ids for o in plain.generate(ps, sp)] == [o.token_ids for o in offered.generate(ps, sp)]
    assert offered.backend.decodes and set(offered.backend.decodes) >= {1, 3}


def test_the_cuda_backend_offers_no_buffers_where_its_decode_steps_launch_eagerly():
    from types import SimpleNamespace

    from runtime.cuda_backend import CudaBackend
    be = SimpleNamespace(use_graphs=True, graphs_decode=cg.DecodeGraphs(backend=None))
    assert CudaBackend.decode_inputs(be, 2, 4, "cpu") is None   # not a GPU: eager steps
    be.use_graphs = False
    assert CudaBackend.decode_inputs(be, 2, 4, "cuda:0") is None
    assert not be.graphs_decode.buffers
