"""One engine loop thread, and an asyncio front that adds, streams and aborts requests.

    aengine = AsyncEngine(engine)          # starts the loop thread
    async for out in aengine.stream(prompt_ids, params):   # RequestOutput per step
        ...
    aengine.shutdown()

The engine is not thread-safe, so only the loop thread touches it: callers post commands
(add, abort) to a queue, which the loop drains between steps; requests arriving while others
decode join the running batch at the next step (continuous batching).  Each step's outputs go
back to the caller's event loop with call_soon_threadsafe.  Leaving a stream early (a client
that disconnects, a stop string found) aborts its request, so its cache blocks are freed at
the next step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator

from .engine import Engine, RequestOutput
from .errors import DsgraphError
from .sampling import SamplingParams

log = logging.getLogger("dsgraph.serve")


class EngineStoppedError(DsgraphError):
    """The engine loop has stopped (shut down, or a step failed): it takes no more requests."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}   # our id -> sink
        self._ids = itertools.count()
        self._engine_ids: dict[int, int] = {}          # our id -> the engine's request id (loop thread only)
        self._stopped: str | None = None               # why the loop stopped, once it has
        self._aborted = 0                              # requests ended by abort (a client left, a stop string)
        self.stats: dict = self._stats()               # the load, as of the last step (read by /health)
        self._lock = threading.Lock()                  # guards _streams and _stopped
        self._thread = threading.Thread(target=self._loop, name="dsgraph-engine", daemon=True)
        self._thread.start()

    # ---- the front (any thread with an event loop) -----------------------------------------
    @property
    def running(self) -> bool:
        return self._stopped is None

    def check(self, prompt, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """Refuse a bad request here, in the caller's thread (Engine.check_request reads only
        the engine's fixed facts), before it is queued."""
        return self.engine.check_request(prompt, params)

    async def stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's RequestOutputs as steps produce them; the last one is finished.  Leaving
        early aborts the request.  EngineStoppedError when the loop stops before it finishes."""
        rid = next(self._ids)
        sink: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._stopped is not None:
                raise EngineStoppedError(self._stopped)
            self._streams[rid] = (asyncio.get_running_loop(), sink)
        self._commands.put(("add", rid, prompt, params))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self._commands.put(("abort", rid))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop after the step under way; streams still open end with EngineStoppedError."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # ---- the loop thread -------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        reason = "the server is shutting down"
        try:
            while True:
                # Block for a command only while idle; between steps take whatever has arrived.
                busy = engine.has_unfinished_requests()
                try:
                    commands = [] if busy else [self._commands.get()]
                    while True:
                        commands.append(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if any(c[0] == "stop" for c in commands):
                    return
                for command in commands:
                    self._apply(command)
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                self.stats = self._stats()
        except Exception as e:  # noqa: BLE001 - a failed step ends every stream with the reason, not silently
            log.exception("the engine loop stopped")
            reason = f"the engine stopped: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._stopped = reason
                streams, self._streams = self._streams, {}
            for engine_id in self._engine_ids.values():
                self.engine.abort(engine_id)
            self._engine_ids.clear()
            for loop, sink in streams.values():
                loop.call_soon_threadsafe(sink.put_nowait, EngineStoppedError(reason))

    def _stats(self) -> dict:
        tables = self.engine.tables
        return {"requests": len(self._engine_ids), "aborted": self._aborted, "free_blocks": tables.free_blocks,
                "num_blocks": tables.allocator.num_blocks}

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, rid, prompt, params = command
            try:
                self._engine_ids[rid] = self.engine.add_request(prompt, params)
            except DsgraphError as e:       # checked by the caller already; a race with nothing, but say so
                self._send(rid, e)
        elif command[0] == "abort":
            engine_id = self._engine_ids.get(command[1])
            if engine_id is not None:
                self.engine.abort(engine_id)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        ours = {e: r for r, e in self._engine_ids.items()}
        for out in outs:
            rid = ours.get(out.request_id)
            if rid is None:
                continue
            if out.finished:
                del self._engine_ids[rid]
                self._aborted += out.finish_reason == "abort"
            self._send(rid, out)

    def _send(self, rid: int, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, sink = target
            try:
                loop.call_soon_threadsafe(sink.put_nowait, item)
            except RuntimeError:            # that caller's event loop has closed: nobody is listening
                pass
