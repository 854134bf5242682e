"""Paged latent KV cache: the storage, a block allocator, per-sequence tables.

MLA caches one latent row per token and layer, [kv_lora_rank + qk_rope_head_dim]
wide (C + R = 512 + 64 = 576 for DeepSeek), shared by all heads. Rows live in
fixed-size blocks; a sequence owns a list of blocks (its block table), and a
token at position p lives in slot block_table[p // block_size] * block_size
+ p % block_size of every layer's [num_blocks * block_size, C + R] view.

All bookkeeping is host-side Python; only `table_tensor` produces a device
tensor, once per step (or the engine writes `table_rows` into a decode graph's own buffer).
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.errors import CacheFullError, InputError
from runtime.h2d import upload


class BlockAllocator:
    """Free list over block ids 0..num_blocks-1; all-or-nothing allocation."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise InputError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        # Reversed so that pops hand out low ids first: deterministic and easy to read in dumps.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise CacheFullError(f"need {n} blocks, only {len(self._free)} free", needed=n, free=len(self._free))
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Validate everything before changing anything: a double free means
        # two sequences would share a block and corrupt each other's cache.
        seen: set[int] = set()
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block {b} is not a block of this cache (0..{self.num_blocks - 1})")
            if self._is_free[b] or b in seen:
                raise ValueError(f"block {b} freed twice")
            seen.add(b)
        for b in blocks:
            self._is_free[b] = True
            self._free.append(b)


class PagedLatentCache:
    """One [num_blocks, block_size, width] tensor per layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        for what, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("width", width)):
            if value < 1:
                raise InputError(f"the KV cache needs {what} >= 1, got {value}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.width = width
        # Zeroed, not empty: a kernel bug that reads an unwritten slot then
        # gives wrong numbers instead of NaNs that poison the whole batch.
        self.layers: list[torch.Tensor] = [
            torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, width: int, dtype: torch.dtype) -> int:
        return num_layers * block_size * width * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def blocks_for_budget(bytes_budget: int, num_layers: int, block_size: int, width: int, dtype: torch.dtype) -> int:
        """How many blocks (across all layers) fit in `bytes_budget`; may be 0."""
        return max(0, int(bytes_budget) // PagedLatentCache.bytes_per_block(num_layers, block_size, width, dtype))


class BlockTables:
    """Which blocks each sequence owns, keyed by an int sequence id.

    An id that was never reserved (or was released) reads as an empty table.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, max_blocks_per_seq: int):
        if block_size < 1 or max_blocks_per_seq < 1:
            raise InputError(
                f"block_size and max_blocks_per_seq must be >= 1, got {block_size} and {max_blocks_per_seq}"
            )
        self.allocator = allocator
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._tables: dict[int, list[int]] = {}
        # Each table also as an int32 row of max_blocks_per_seq, zero-padded, kept as blocks come: a
        # decode step's [B, width] tables are then one stack of rows, where converting B Python lists
        # cost ~0.5 ms a step at B = 128 (the engine's host part).
        self._rows: dict[int, np.ndarray] = {}

    @property
    def free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    def seq_ids(self) -> list[int]:
        return list(self._tables)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def blocks_needed(self, seq_id: int, total_len: int) -> int:
        """Blocks `reserve(seq_id, total_len)` would allocate (for schedulers)."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-total_len // self.block_size) - have)

    def reserve(self, seq_id: int, total_len: int) -> None:
        """Make the sequence own enough blocks for `total_len` tokens. On
        CacheFullError nothing changes, so the caller can preempt and retry."""
        if total_len < 0:
            raise InputError(f"sequence {seq_id}: cannot reserve a negative length {total_len}")
        if total_len > self.max_seq_len:
            raise InputError(
                f"sequence {seq_id} needs {total_len} tokens of KV cache, but the cache holds at most "
                f"{self.max_seq_len} tokens per sequence ({self.max_blocks_per_seq} blocks x {self.block_size})"
            )
        need = self.blocks_needed(seq_id, total_len)
        new = []          # a decode step's usual case: the last block has room, nothing to allocate
        if need:
            try:
                new = self.allocator.allocate(need)
            except CacheFullError as e:
                raise CacheFullError(f"sequence {seq_id}: {e}", needed=e.needed, free=e.free) from None
        table = self._tables.setdefault(seq_id, [])
        if new:
            row = self._rows.setdefault(seq_id, np.zeros(self.max_blocks_per_seq, dtype=np.int32))
            row[len(table):len(table) + len(new)] = new
            table.extend(new)

    def release(self, seq_id: int) -> None:
        """Free the sequence's blocks; a no-op for an unknown id, so aborting a
        sequence whose first reserve failed needs no special case."""
        blocks = self._tables.pop(seq_id, None)
        self._rows.pop(seq_id, None)
        if blocks:
            self.allocator.free(blocks)

    def length_capacity(self, seq_id: int) -> int:
        return len(self._tables.get(seq_id, ())) * self.block_size

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Cache slots of positions start..end-1."""
        capacity = self.length_capacity(seq_id)
        if not 0 <= start <= end <= capacity:
            raise ValueError(
                f"sequence {seq_id}: positions [{start}, {end}) are not within its reserved {capacity} slots"
            )
        table, bs = self._tables.get(seq_id, []), self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def table_rows(self, seq_ids: list[int], width: int | None = None) -> np.ndarray:
        """int32 [B, width] block tables on the host, zero-padded. Padding is never read:
        kernels stop at each sequence's context length. A fixed `width` (e.g.
        max_blocks_per_seq) keeps the shape stable across steps."""
        longest = max((len(self._tables.get(s, ())) for s in seq_ids), default=0)
        if width is None:
            width = max(1, longest)
        elif width < longest:
            raise ValueError(f"table width {width} is narrower than the longest block table ({longest} blocks)")
        rows = np.zeros((len(seq_ids), width), dtype=np.int32)
        w = min(width, self.max_blocks_per_seq)
        if seq_ids:
            empty = np.zeros(self.max_blocks_per_seq, dtype=np.int32)
            rows[:, :w] = np.stack([self._rows.get(s, empty) for s in seq_ids])[:, :w]
        return rows

    def table_tensor(self, seq_ids: list[int], device: torch.device | str, width: int | None = None) -> torch.Tensor:
        """table_rows as an int32 [B, width] tensor on `device`."""
        return upload(self.table_rows(seq_ids, width), torch.int32, device)
