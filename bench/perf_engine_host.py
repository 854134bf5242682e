"""The engine's own host time per decode step of `generate` (a script, not a test; no GPU).

    python3 -m bench.perf_engine_host [--cases 1x512,128x64,128x2000] [--steps 40]

What `dsgraph bench` does not time: between two decode steps `Engine.generate` samples, advances
and finishes sequences, schedules the next batch (cache blocks) and builds the step's inputs, on
the host, while the GPU waits for it.  Here the backend is a stub that returns zero logits, so what
is timed is that work alone: per decode step, ms of _step (the inputs), _advance (sampling on the
CPU, stop checks), decode_batch (scheduling).  Cases BxL: B prompts of L tokens (the tiny test
model, its positions widened so long prompts are accepted).
"""
from __future__ import annotations

import argparse
import time


import torch

from tests.runtime import tiny_engine
from runtime import SamplingParams
from runtime.engine import Engine
from runtime.scheduler import Scheduler

VOCAB = 64


class ZeroLogits:
    """A backend whose steps cost nothing: zero logits of the right shape."""

    def forward(self, phase, ids, ctx):
        rows = ids.shape[0] if ctx.logit_rows is None else ctx.logit_rows.shape[0]
        return torch.zeros(rows, VOCAB)


def _timed(spent: dict, cls, name: str) -> None:
    f = getattr(cls, name)

    def wrapper(self, *a, **k):
        t = time.perf_counter()
        try:
            return f(self, *a, **k)
        finally:
            key = f"{name}/{a[0]}" if a and isinstance(a[0], str) else name
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x512,128x64,128x2000")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    tiny_engine.CONFIG["max_position_embeddings"] = 8192
    spent: dict[str, float] = {}
    for cls, name in ((Engine, "_step"), (Engine, "_advance"), (Scheduler, "decode_batch")):
        _timed(spent, cls, name)
    print(f"{'case':<10}{'per decode step':>16}{'_step':>8}{'_advance':>10}{'decode_batch':>14}  (ms, host)")
    for case in args.cases.split(","):
        B, L = (int(v) for v in case.split("x"))
        eng = tiny_engine.make_engine(block_size=16, num_blocks=B * (L + args.steps + 32) // 16 + 64,
                                      max_seq_len=L + args.steps + 16)
        eng.backend, eng.max_num_seqs = ZeroLogits(), max(B, 1)
        prompts = [[(i + j) % 60 for j in range(L)] for i in range(B)]
        spent.clear()
        eng.generate(prompts, SamplingParams(max_new_tokens=args.steps + 1, ignore_eos=True))
        per = {k: v * 1e3 / args.steps for k, v in spent.items()}
        total = per.get("_step/decode", 0) + per.get("_advance", 0) + per.get("decode_batch", 0)
        print(f"{case:<10}{total:>16.3f}{per.get('_step/decode', 0):>8.3f}{per.get('_advance', 0):>10.3f}"
              f"{per.get('decode_batch', 0):>14.3f}")


if __name__ == "__main__":
    main()
