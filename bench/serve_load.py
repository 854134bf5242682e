"""Load a running `dsgraph serve` with many concurrent streaming clients; report tokens/s and latency.

    dsgraph serve MODEL_DIR --backend cuda &                 # or --random-weights --spec deepseek_v2_lite
    python -m bench.serve_load --url http://127.0.0.1:8000 --streams 64 --seconds 60 [--json load.json]

Each of --streams clients sends greedy streaming completions back to back (random token-id
prompts of --prompt-len, --max-tokens new tokens each, ignore_eos so every answer has the same
length) until --seconds have passed; requests still open then finish and count.  Reported:
output tokens per second over the run, time to first token (TTFT: request sent to the first
chunk carrying a token) and time per output token after the first (TPOT), as p50 / p90 / p99.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass


@dataclass
class LoadReport:
    streams: int
    seconds: float                 # wall time, first request sent to last answer received
    requests: int
    errors: int
    output_tokens: int
    tokens_per_s: float
    ttft_ms: dict                  # p50 / p90 / p99
    tpot_ms: dict

    def lines(self) -> list[str]:
        return [f"{self.requests} requests ({self.errors} errors) from {self.streams} streams in {self.seconds:.1f} s",
                f"output   {self.output_tokens} tokens, {self.tokens_per_s:.1f} tokens/s",
                "ttft     " + ", ".join(f"{k} {v:.1f} ms" for k, v in self.ttft_ms.items()),
                "tpot     " + ", ".join(f"{k} {v:.2f} ms" for k, v in self.tpot_ms.items())]


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


async def _one(client, url: str, body: dict) -> tuple[float, float, int]:
    """(ttft s, time after the first token s, tokens) of one streamed completion."""
    import httpx
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise httpx.HTTPStatusError(f"{r.status_code}: {(await r.aread())[:300]!r}", request=r.request,
                                        response=r)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            n = len(event["choices"][0].get("token_ids") or ())
            if n and first is None:
                first = time.perf_counter()
            tokens += n
    end = time.perf_counter()
    first = first or end
    return first - t0, end - first, tokens


async def run_load(url: str, *, streams: int = 64, seconds: float = 60.0, prompt_len: int = 128,
                   max_tokens: int = 128, model: str | None = None, seed: int = 0) -> LoadReport:
    import httpx
    url = url.rstrip("/")
    # idle connections expire here before the server's keep-alive (uvicorn: 5 s) closes them, so a
    # request never goes out on a connection the server is closing at that moment
    limits = httpx.Limits(max_connections=streams + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as c:
        info = (await c.get(f"{url}/v1/models")).json()["data"][0]
        model = model or info["id"]
        vocab = info.get("vocab_size", 1000)
        if prompt_len + max_tokens > info.get("max_model_len", prompt_len + max_tokens):
            raise SystemExit(f"--prompt-len {prompt_len} + --max-tokens {max_tokens} exceed the server's "
                             f"max_model_len {info['max_model_len']}")
        rng = random.Random(seed)
        ttft, tpot, total, errors, done = [], [], 0, 0, 0
        start = time.perf_counter()
        deadline = start + seconds

        async def client():
            nonlocal total, errors, done
            while time.perf_counter() < deadline:
                body = {"model": model, "prompt": [rng.randrange(vocab) for _ in range(prompt_len)],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
                try:
                    first, rest, n = await _one(c, url, body)
                except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, the run goes on
                    errors += 1
                    print(f"serve_load: request failed: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                done += 1
                total += n
                ttft.append(first * 1e3)
                if n > 1:
                    tpot.append(rest * 1e3 / (n - 1))

        await asyncio.gather(*(client() for _ in range(streams)))
        wall = time.perf_counter() - start
    return LoadReport(streams, wall, done, errors, total, total / wall if wall else 0.0,
                      _percentiles(ttft), _percentiles(tpot))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--model", help="the model name to send (default: the server's one model)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--seconds", type=float, default=60.0, help="how long clients keep sending requests")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", metavar="FILE", help="also write the report here")
    args = p.parse_args(argv)
    report = asyncio.run(run_load(args.url, streams=args.streams, seconds=args.seconds, prompt_len=args.prompt_len,
                                  max_tokens=args.max_tokens, model=args.model, seed=args.seed))
    print("\n".join(report.lines()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(asdict(report), f, indent=1)
    return 0 if report.requests and not report.errors else 1


if __name__ == "__main__":
    sys.exit(main())
