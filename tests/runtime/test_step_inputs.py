"""What the engine hands the backend each step: the ids, positions, slots and logit rows of one
upload, and decode contexts whose lengths are their positions + 1 (a decode graph computes its
context lengths from the positions on the device: runtime/cuda_graphs.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import SamplingParams
from runtime.h2d import upload_into, upload_together
from runtime.kv_cache import BlockAllocator, BlockTables
from tiny_engine import make_engine, prompts


def test_upload_together_keeps_each_part_and_aligns_it():
    parts = [[5, 7, 9], list(range(17)), [], None, [-3]]
    got = upload_together(parts, "cpu")
    base = got[0].data_ptr()   # the device copy starts on an allocator block (>= 512-byte aligned)
    for p, t in zip(parts, got):
        if p is None:
            assert t is None
            continue
        assert t.dtype == torch.int64 and t.tolist() == p
        assert (t.data_ptr() - base) % 128 == 0 or len(p) == 0
    # one storage: one copy to the device
    storages = {t.untyped_storage().data_ptr() for t in got if t is not None}
    assert len(storages) == 1


def test_upload_into_writes_an_existing_tensor_and_refuses_another_shape():
    dst = torch.full((2, 3), -1, dtype=torch.int32)
    ptr = dst.data_ptr()
    upload_into(dst, np.arange(6, dtype=np.int64).reshape(2, 3))
    assert dst.data_ptr() == ptr and dst.dtype == torch.int32 and dst.tolist() == [[0, 1, 2], [3, 4, 5]]
    upload_into(dst[1], [7, 8, 9])   # a view: the rest is untouched
    assert dst.tolist() == [[0, 1, 2], [7, 8, 9]]
    with pytest.raises(ValueError, match=r"shape \(3,\) into a tensor of \(2, 3\)"):
        upload_into(dst, [1, 2, 3])   # would broadcast


def test_table_tensor_pads_with_zeros_and_keeps_order():
    tables = BlockTables(BlockAllocator(64), block_size=4, max_blocks_per_seq=8)
    tables.reserve(1, 9)     # 3 blocks
    tables.reserve(2, 1)     # 1 block
    t = tables.table_tensor([2, 1, 99], "cpu", width=5)
    assert t.dtype == torch.int32 and t.shape == (3, 5)
    assert t[0].tolist() == tables.block_table(2) + [0] * 4
    assert t[1].tolist() == tables.block_table(1) + [0] * 2
    assert t[2].tolist() == [0] * 5
    assert tables.table_tensor([1], "cpu").shape == (1, 3)
    assert np.array_equal(tables.table_rows([2, 1, 99], width=5), t.numpy())


def test_every_step_context_is_consistent_and_decode_lengths_are_positions_plus_one():
    engine = make_engine(block_size=4)
    seen = []
    forward = engine.backend.forward

    def spy(phase, ids, ctx):
        seen.append((phase, ids.clone(), ctx.positions.clone(), list(ctx.query_lens), list(ctx.context_lens),
                     ctx.slot_mapping.clone(), None if ctx.logit_rows is None else ctx.logit_rows.clone()))
        return forward(phase, ids, ctx)
    engine.backend.forward = spy
    engine.generate(prompts([5, 9, 2]), SamplingParams(max_new_tokens=4))
    decodes = 0
    for phase, ids, positions, query_lens, context_lens, slots, rows in seen:
        T = sum(query_lens)
        assert ids.shape == positions.shape == slots.shape == (T,)
        if rows is not None:
            assert rows.tolist() == [sum(query_lens[:b + 1]) - 1 for b in range(len(query_lens))]
        if phase == "decode":
            decodes += 1
            assert query_lens == [1] * len(query_lens)
            assert positions.tolist() == [n - 1 for n in context_lens]
    assert decodes > 0


def test_a_decode_graph_makes_its_context_lengths_from_the_positions():
    """cuda_graphs._decode_lengths: the graph's first node (here on CPU tensors)."""
    from runtime.cuda_graphs import _decode_lengths
    x = {"positions": torch.tensor([0, 511, 4095, 7], dtype=torch.int64),
         "context_lens": torch.zeros(4, dtype=torch.int32)}
    _decode_lengths(x)
    assert x["context_lens"].dtype == torch.int32 and x["context_lens"].tolist() == [1, 512, 4096, 8]
