"""Sampling parameters and next-token selection.

`sample_next` never synchronises with the host (no .item(), .tolist(),
.cpu()), so a decode step stays asynchronous and capturable; the only Python
loop is over the rows that actually sample. Order of the filters follows
transformers: temperature, then top-k, then top-p.

Dimension legend: B batch rows, V vocabulary, K kept candidates.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from runtime.errors import InputError

_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range for non-negative seeds
# What sample_next gives a row whose logits are not finite (NaN, +inf, or all -inf): no token
# id, so the caller's one copy of the tokens to the host also tells it, with no sync of its own.
NOT_FINITE = -1


def as_integer(x) -> int | None:
    """`x` as an int when it is a whole number (a Python or numpy integer, a 0-d integer tensor:
    anything with __index__), else None.  A bool is refused: True as a token id is a mistake; so is
    a one-element tensor, which torch lets stand for its element."""
    if isinstance(x, bool) or getattr(x, "ndim", 0) != 0:
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0  # 1 means no nucleus filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # stop at these too (the model's eos always counts, see ignore_eos)
    ignore_eos: bool = False  # True: run past the model's eos token (vLLM's name and default)
    return_logits: bool = False

    def __post_init__(self):
        max_new = as_integer(self.max_new_tokens)
        if max_new is None or max_new < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        top_k = as_integer(self.top_k)
        if top_k is None or top_k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        seed = None if self.seed is None else as_integer(self.seed)
        if self.seed is not None and (seed is None or not 0 <= seed <= _MAX_SEED):
            raise InputError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        self.stop_token_ids = token_id_tuple(self.stop_token_ids, "stop_token_ids")
        for flag in ("ignore_eos", "return_logits"):
            if not isinstance(getattr(self, flag), bool):
                raise InputError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        # plain Python numbers from here on (a numpy integer compares and hashes alike, but prints as np.int64)
        self.max_new_tokens, self.top_k, self.seed = max_new, top_k, seed
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def greedy(self) -> bool:
        # top_k == 1 leaves one candidate whatever the temperature; taking the
        # argmax path makes that exact, ties included, and spends no randomness.
        return self.temperature == 0 or self.top_k == 1


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def token_id_tuple(ids, what: str) -> tuple[int, ...]:
    """One id or a sequence of ids (None: none) as a tuple of non-negative ints."""
    if ids is None:
        return ()
    if as_integer(ids) is not None:
        ids = (ids,)
    try:
        out = tuple(ids)
    except TypeError:
        raise InputError(f"{what} must be a sequence of token ids, got {ids!r}") from None
    ints = tuple(as_integer(t) for t in out)
    for t, i in zip(out, ints):
        if i is None or i < 0:
            raise InputError(f"{what} must hold non-negative integers, got {t!r} in {out!r}")
    return ints


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator private to one request. Unseeded requests get a
    non-deterministically seeded one, so no request touches global RNG state."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_next(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Next token per row: logits [B, V] (any float dtype/device) -> int64 [B]
    on logits.device; NOT_FINITE for a row holding a NaN or +inf (or only -inf),
    from which no sampling draws a meaningful token. A None generator falls
    back to torch's default one."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(
            f"{logits.shape[0]} logit rows but {len(params)} SamplingParams and {len(generators)} generators"
        )
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # [B]; final for greedy rows
    # argmax picks a row's NaN where it has one (torch propagates NaN) and +inf over any finite
    # logit, so a row is finite exactly when its chosen logit is: B values gathered, not a second
    # pass over [B, V] (an amax cost 30-50 us of GPU time a step on an H100, this about 20).
    chosen = logits.gather(1, tokens[:, None])[:, 0]  # [B]
    tokens = torch.where(torch.isfinite(chosen), tokens, NOT_FINITE)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, gen)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """One token (0-dim int64 tensor) from fp32 logits [V]; NOT_FINITE when the row's maximum
    is not (a NaN anywhere propagates to it), where the draw below would be arbitrary."""
    # Shifting by the max first keeps a tiny temperature from overflowing to inf.
    top = logits.max()
    scaled = (logits - top) / p.temperature  # [V]
    vocab = scaled.shape[0]
    order = None  # candidate index -> vocabulary id, when filtered to a sorted subset
    if 0 < p.top_k < vocab:
        scaled, order = torch.topk(scaled, p.top_k)  # [K], sorted descending
    if p.top_p < 1:
        if order is None:
            scaled, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(scaled, dim=-1)
        # Keep a candidate while the mass before it is short of top_p: the
        # smallest prefix reaching top_p, and always the top token (mass 0 before it).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        scaled = scaled.masked_fill(mass_before >= p.top_p, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    # Exponential-race sampling: argmax(probs / Exp(1)) draws from probs
    # without multinomial's validity checks; clamping keeps 0-mass candidates
    # at 0 rather than 0/0 = NaN (which argmax would pick).
    race = torch.empty_like(probs).exponential_(1.0, generator=gen).clamp_min_(torch.finfo(probs.dtype).tiny)
    choice = torch.argmax(probs / race)
    return torch.where(torch.isfinite(top), choice if order is None else order[choice], NOT_FINITE)
