"""AsyncEngine: one loop thread drives the engine while asyncio callers stream requests.  Streams
that overlap give each request its greedy tokens alone; leaving a stream early aborts it and
its blocks come back; a step that fails ends every open stream with EngineStoppedError, and the
engine takes no more requests."""
from __future__ import annotations

import asyncio
import time

import pytest

from runtime import SamplingParams
from runtime.async_engine import AsyncEngine, EngineStoppedError
from tiny_engine import make_engine, prompts

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


async def _collect(aengine, prompt, params=GREEDY) -> tuple[list[int], str]:
    tokens, reason = [], None
    async for out in aengine.stream(prompt, params):
        tokens += out.token_ids
        reason = out.finish_reason
    return tokens, reason


def test_overlapping_streams_equal_generate_alone():
    engine = make_engine(num_blocks=128)
    ps = prompts([3, 7, 2, 5, 9, 4], seed=4)
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in ps]
    aengine = AsyncEngine(engine)

    async def main():
        tasks = []
        for p in ps:                       # arrivals spread over the first steps
            tasks.append(asyncio.create_task(_collect(aengine, p)))
            await asyncio.sleep(0.002)
        return await asyncio.gather(*tasks)
    try:
        got = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert [t for t, _ in got] == alone and {r for _, r in got} == {"length"}
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_leaving_a_stream_aborts_it_and_frees_its_blocks():
    engine = make_engine(num_blocks=128)
    aengine = AsyncEngine(engine)

    async def main():
        async for _ in aengine.stream(prompts([5])[0], SamplingParams(max_new_tokens=100, ignore_eos=True)):
            break                          # leave after the first token
        for _ in range(200):
            if aengine.stats["aborted"] == 1 and aengine.stats["requests"] == 0:
                return
            await asyncio.sleep(0.01)
    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()
    assert aengine.stats["aborted"] == 1
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_a_failed_step_ends_every_stream_and_refuses_new_ones(monkeypatch):
    engine = make_engine(num_blocks=128)
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_step()
    monkeypatch.setattr(engine, "step", failing_step)
    aengine = AsyncEngine(engine)

    async def main():
        results = await asyncio.gather(*(_collect(aengine, p) for p in prompts([4, 6], seed=5)),
                                       return_exceptions=True)
        with pytest.raises(EngineStoppedError, match="boom"):
            await _collect(aengine, [1, 2])
        return results
    try:
        results = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert all(isinstance(r, EngineStoppedError) and "RuntimeError: boom" in str(r) for r in results)
    assert not aengine.running


def test_shutdown_ends_open_streams(monkeypatch):
    engine = make_engine(num_blocks=128)
    real_step = engine.step

    def slow_step():                       # 100 steps take seconds: the stream is open at shutdown
        time.sleep(0.05)
        return real_step()
    monkeypatch.setattr(engine, "step", slow_step)
    aengine = AsyncEngine(engine)

    async def main():
        stream = aengine.stream(prompts([4])[0], SamplingParams(max_new_tokens=100, ignore_eos=True))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, aengine.shutdown)
        with pytest.raises(EngineStoppedError, match="shutting down"):
            async for _ in stream:
                pass
    asyncio.run(main())
    assert not aengine.running
