"""The typed per-step record every op reads: where each token sits and where its cache lives.

One StepContext describes one forward call over a packed batch: sequences are laid
out back to back (sequence b owns tokens ``query_start[b] : query_start[b+1]``).
Prefill packs whole prompts; decode packs one token per sequence.  The same record
serves the reference interpreter (which may read the lists) and the CUDA backend
(which reads only the tensors, so a decode step never syncs the host).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the compile path imports no torch
    import torch


@dataclass
class StepContext:
    positions: torch.Tensor        # [T] int64: position of each token in its sequence
    query_lens: list[int]          # [B] new tokens per sequence this step
    context_lens: list[int]        # [B] tokens in the cache per sequence once this step has written
                                   # (decode: positions[b] + 1, which a decode graph computes itself)
    block_tables: torch.Tensor     # [B, W] int32: cache blocks of each sequence, in order
    slot_mapping: torch.Tensor     # [T] int64: cache row (block * block_size + offset) of each token
    kv_cache: list                 # per layer: [num_blocks, block_size, C + R]
    block_size: int
    # [L] int64 on the device, or None (every row): the rows of the step whose logits the
    # caller uses.  Generation needs only each sequence's last token, so the head's linear
    # (the op that makes the graph's "logits") runs on those L rows alone: at a 16k-token
    # prefill that is 32 rows of lm_head instead of 16k, and a [L, vocab] output.
    logit_rows: "torch.Tensor | None" = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def query_ranges(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.query_lens:
            out.append((start, start + n))
            start += n
        return out

    def prefix_lens(self) -> list[int]:
        """[B] rows each sequence held in the cache before this step (a prefill chunk's prefix)."""
        return [c - q for c, q in zip(self.context_lens, self.query_lens)]

    def key_starts(self) -> list[int]:
        """[B + 1] where each sequence's context rows start when packed sequence after sequence
        (mla_gather_context's rows; the last entry is TK, the step's key rows)."""
        out, start = [0], 0
        for n in self.context_lens:
            start += n
            out.append(start)
        return out

    def gather_rows(self, layer: int, seq: int) -> torch.Tensor:
        """All cache rows of one sequence, in position order: [context_len, C + R]."""
        n = self.context_lens[seq]
        nblocks = -(-n // self.block_size)
        blocks = self.block_tables[seq, :nblocks].long()
        cache = self.kv_cache[layer]
        return cache[blocks.to(cache.device)].reshape(-1, cache.shape[-1])[:n]
