"""Which sequences run this step: admission, decode batches, finishing and preemption.

Continuous batching: every step first admits waiting sequences (one packed prefill)
while the cache has room, then advances every running sequence by one token (one
batched decode).  When a running sequence needs a block and none is free, the most
recently admitted other sequence is preempted: its blocks are freed and it waits to
be recomputed from its tokens so far.  No sequence ever writes another's blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import CacheFullError
from .kv_cache import BlockTables
from .sampling import SamplingParams


@dataclass(eq=False)      # a sequence is an entity: membership tests compare identity, not token lists
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    index: int                         # the prompt's position in the call: what messages name (seq_id is internal)
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    cached: int = 0                    # tokens whose rows are in the cache
    reported: int = 0                  # output tokens Engine.step() has handed out

    @property
    def tokens(self) -> list[int]:
        """A new list of every token (prompt + output): O(length), for prefill.  A decode step's
        per-sequence work uses num_tokens and last_token, which cost O(1) at any context length."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, tables: BlockTables, max_num_seqs: int, max_prefill_tokens: int):
        self.tables = tables
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Sequences to prefill now (their whole token list), with cache reserved for them."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens
            if batch and tokens + n > self.max_prefill_tokens:
                break
            try:
                self.tables.reserve(seq.seq_id, n)
            except CacheFullError as e:
                if not self.running and not batch:   # alone and still no room: nothing to wait for
                    raise self._never_fits(seq, e) from None
                break
            self.waiting.pop(0)
            seq.cached = 0
            batch.append(seq)
            tokens += n
        self.running.extend(batch)
        return batch

    def decode_batch(self) -> list[Sequence]:
        """Running sequences to advance by one token; preempts the newest ones if blocks run out."""
        ready = [s for s in self.running if not s.done]
        i = 0
        while i < len(ready):
            seq = ready[i]
            try:
                self.tables.reserve(seq.seq_id, seq.num_tokens)
                i += 1
            except CacheFullError as e:
                victim = ready[-1]
                if victim is seq and len(ready) == 1:
                    raise self._never_fits(seq, e) from None
                self._preempt(victim)
                ready.remove(victim)
        return ready

    def _never_fits(self, seq: Sequence, e: CacheFullError) -> CacheFullError:
        """The error for a sequence that holds every block it can get and still needs more.  The
        engine refuses such a request before it runs (Engine._check_fits_cache), so with its
        checks this never fires: then the oldest running sequence is never preempted, and once it
        runs alone the whole cache is its own, so every generate call finishes."""
        holds = self.tables.allocator.num_blocks * self.tables.block_size
        return CacheFullError(f"prompt {seq.index} needs {seq.num_tokens} tokens of KV cache but the whole cache "
                              f"holds {holds}; raise num_blocks or lower max_new_tokens", needed=e.needed, free=e.free)

    def _preempt(self, seq: Sequence) -> None:
        self.tables.release(seq.seq_id)
        seq.cached = 0
        self.running.remove(seq)
        self.waiting.insert(0, seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """`seq` leaves (done or aborted), running or still waiting; its blocks are freed."""
        self.tables.release(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


def chunk_tokens(uncached: list[int], budget: int) -> list[int]:
    """Tokens each sequence runs this step under a cap of `budget` tokens (chunked prefill): in order,
    each takes what it still lacks until the budget is spent; the first short of it takes the rest,
    the ones after it none this step."""
    take = []
    for n in uncached:
        t = max(0, min(n, budget))
        take.append(t)
        budget -= t
    return take
