"""Paged cache bookkeeping: no block is ever owned twice, failures change nothing."""
import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.errors import CacheFullError, InputError
from runtime.kv_cache import BlockAllocator, BlockTables, PagedLatentCache

BLOCK_SIZE = 4
NUM_BLOCKS = 12
MAX_BLOCKS_PER_SEQ = 6


class CacheMachine(RuleBasedStateMachine):
    """Random reserve/release over a few sequences against a model of token lengths."""

    def __init__(self):
        super().__init__()
        self.tables = BlockTables(BlockAllocator(NUM_BLOCKS), BLOCK_SIZE, MAX_BLOCKS_PER_SEQ)
        self.lengths: dict[int, int] = {}  # model: tokens reserved so far per sequence

    def _snapshot(self):
        return {s: self.tables.block_table(s) for s in range(4)}, self.tables.free_blocks

    @rule(seq=st.integers(0, 3), total_len=st.integers(0, MAX_BLOCKS_PER_SEQ * BLOCK_SIZE))
    def reserve(self, seq, total_len):
        before = self._snapshot()
        need = -(-total_len // BLOCK_SIZE) - len(before[0][seq])
        try:
            self.tables.reserve(seq, total_len)
        except CacheFullError:
            assert need > self.tables.free_blocks
            assert self._snapshot() == before
            return
        assert self.tables.block_table(seq)[: len(before[0][seq])] == before[0][seq]  # existing blocks kept
        self.lengths[seq] = max(self.lengths.get(seq, 0), total_len)

    @rule(seq=st.integers(0, 3), extra=st.integers(1, 5))
    def reserve_too_long(self, seq, extra):
        before = self._snapshot()
        with pytest.raises(InputError, match="at most 24 tokens per sequence"):
            self.tables.reserve(seq, MAX_BLOCKS_PER_SEQ * BLOCK_SIZE + extra)
        assert self._snapshot() == before

    @rule(seq=st.integers(0, 3))
    def release(self, seq):
        self.tables.release(seq)
        self.lengths.pop(seq, None)
        assert self.tables.block_table(seq) == []

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def slots_are_owned(self, data):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        slots = self.tables.slot_mapping(seq, 0, self.lengths[seq])
        owned = set(self.tables.block_table(seq))
        assert len(set(slots)) == len(slots)
        assert all(s // BLOCK_SIZE in owned for s in slots)

    @invariant()
    def blocks_partitioned(self):
        owned = [b for s in range(4) for b in self.tables.block_table(s)]
        assert len(owned) == len(set(owned)), "a block is owned by two sequences"
        assert len(owned) + self.tables.free_blocks == NUM_BLOCKS
        for s in range(4):
            assert self.tables.length_capacity(s) >= self.lengths.get(s, 0)

    @invariant()
    def table_rows_are_the_tables(self):
        # table_rows stacks rows kept as blocks come (kv_cache.BlockTables._rows): after any run of
        # reserves, refused reserves and releases they are the block tables, zero-padded
        seqs = [3, 0, 2, 1, 0]
        for width in (None, MAX_BLOCKS_PER_SEQ, MAX_BLOCKS_PER_SEQ + 2):
            rows = self.tables.table_rows(seqs, width)
            w = rows.shape[1]
            assert rows.dtype == np.int32 and rows.shape[0] == len(seqs)
            assert w == (width or max(1, max(len(self.tables.block_table(s)) for s in seqs)))
            for row, s in zip(rows.tolist(), seqs):
                t = self.tables.block_table(s)
                assert row == t + [0] * (w - len(t))

    def teardown(self):
        for s in range(4):
            self.tables.release(s)
        assert self.tables.free_blocks == NUM_BLOCKS


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase


@pytest.mark.parametrize("length", [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 2])
def test_slot_mapping_crosses_blocks(length):
    alloc = BlockAllocator(NUM_BLOCKS)
    alloc.allocate(3)  # so the sequence's blocks are not simply 0, 1, 2...
    tables = BlockTables(alloc, BLOCK_SIZE, MAX_BLOCKS_PER_SEQ)
    tables.reserve(7, length)
    table = tables.block_table(7)
    assert len(table) == -(-length // BLOCK_SIZE)
    expected = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)]
    assert tables.slot_mapping(7, 0, length) == expected
    assert tables.slot_mapping(7, length - 1, length) == expected[-1:]  # a decode step's one slot
    with pytest.raises(ValueError, match="reserved"):
        tables.slot_mapping(7, 0, tables.length_capacity(7) + 1)


def test_reserve_grows_only_missing_blocks():
    tables = BlockTables(BlockAllocator(NUM_BLOCKS), BLOCK_SIZE, MAX_BLOCKS_PER_SEQ)
    tables.reserve(1, BLOCK_SIZE)
    first = tables.block_table(1)
    tables.reserve(1, BLOCK_SIZE)  # already enough
    assert tables.block_table(1) == first
    tables.reserve(1, BLOCK_SIZE + 1)
    assert tables.block_table(1)[:1] == first and len(tables.block_table(1)) == 2


def test_allocator_errors():
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(2)
    with pytest.raises(CacheFullError, match="need 2 blocks, only 1 free") as info:
        alloc.allocate(2)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert alloc.num_free == 1
    alloc.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(blocks[:1])
    with pytest.raises(ValueError, match="not a block"):
        alloc.free([3])
    assert alloc.num_free == 3 and alloc.num_blocks == 3


def test_table_tensor_padding():
    tables = BlockTables(BlockAllocator(NUM_BLOCKS), BLOCK_SIZE, MAX_BLOCKS_PER_SEQ)
    tables.reserve(0, 2 * BLOCK_SIZE + 1)
    tables.reserve(1, 1)
    t = tables.table_tensor([1, 0], "cpu")
    assert t.dtype == torch.int32 and t.shape == (2, 3)
    assert t[0].tolist() == tables.block_table(1) + [0, 0]
    assert t[1].tolist() == tables.block_table(0)
    assert tables.table_tensor([0], "cpu", width=MAX_BLOCKS_PER_SEQ).shape == (1, MAX_BLOCKS_PER_SEQ)
    with pytest.raises(ValueError, match="narrower"):
        tables.table_tensor([0], "cpu", width=2)


def test_paged_latent_cache_shapes_and_budget():
    cache = PagedLatentCache(num_layers=2, num_blocks=5, block_size=BLOCK_SIZE, width=576,
                             dtype=torch.bfloat16, device="cpu")
    assert len(cache.layers) == 2 and cache.layers[0].shape == (5, BLOCK_SIZE, 576)
    assert cache.layers[0].dtype == torch.bfloat16
    assert (cache.block_size, cache.num_blocks, cache.width) == (BLOCK_SIZE, 5, 576)
    per_block = 2 * BLOCK_SIZE * 576 * 2
    assert cache.nbytes == 5 * per_block
    assert PagedLatentCache.blocks_for_budget(5 * per_block + per_block - 1, 2, BLOCK_SIZE, 576, torch.bfloat16) == 5
    assert PagedLatentCache.blocks_for_budget(0, 2, BLOCK_SIZE, 576, torch.bfloat16) == 0
    with pytest.raises(InputError, match="block_size"):
        PagedLatentCache(2, 5, 0, 576, torch.bfloat16, "cpu")
