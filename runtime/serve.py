"""`dsgraph serve`: an OpenAI-compatible HTTP front over one engine loop (FastAPI + uvicorn).

    POST /v1/completions        text or token-id prompt -> text (+ token_ids)
    POST /v1/chat/completions   messages, through the checkpoint's chat template -> assistant text
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs (503 after), with its load

`stream: true` answers as server-sent events, one chunk per engine step, the last one with the
finish reason and the usage counts; every final response carries usage.  Requests run on an
AsyncEngine (runtime/async_engine.py): they join the running batch between steps, and one whose
client leaves (or whose stop string appears) is aborted, its cache blocks freed at the next step.
A bad request is an OpenAI-shaped JSON error (400, 404 unknown model or route, 413 too long,
503 engine stopped), never a dropped connection, and touches no other request.

fastapi is imported only here, so the rest of dsgraph runs without the [serve] extra.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .async_engine import AsyncEngine, EngineStoppedError
from .engine import Engine
from .errors import CacheFullError, InputError, PromptTooLongError
from .sampling import SamplingParams
from .serve_protocol import Job, RequestError, error_body, parse_job


class TextStream:
    """The text of a growing list of tokens, handed out in pieces safe to send: a piece never ends
    in half a character (the tokenizer decodes a partial UTF-8 sequence to U+FFFD) or in a prefix
    of a stop string, and the text ends before the first stop string (which is not sent).
    Without a tokenizer the text stays empty and the token ids carry the answer."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0                  # characters handed out
        self.stopped = False           # a stop string appeared

    def add(self, ids: list[int], finish_reason: str | None) -> str:
        """Take a step's new tokens; the next piece of text.  A token that ended the request by
        being a stop token (finish_reason "stop") is not part of the text."""
        self.ids += ids
        if self.tokenizer is None:
            return ""
        shown = self.ids[:-1] if finish_reason == "stop" and ids else self.ids
        text = self.tokenizer.decode(shown, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(text, min(hits))
        if finish_reason is not None:
            return self._take(text, len(text))
        safe = len(text.rstrip("\ufffd"))
        hold = 0                       # the longest tail that may still grow into a stop string
        for s in self.stop:
            hold = max([hold] + [k for k in range(1, min(len(s) - 1, safe) + 1) if text.endswith(s[:k], 0, safe)])
        return self._take(text, safe - hold)

    def _take(self, text: str, end: int) -> str:
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however it
    ends (a client that disconnected included), so the request it streams is aborted then."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def _sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Server:
    def __init__(self, engine: Engine, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.aengine: AsyncEngine | None = None
        self.created = int(time.time())

    # ---- one request, from body to events ---------------------------------------------------
    def prepare(self, body, chat: bool) -> tuple[Job, list[int], SamplingParams]:
        job = parse_job(body, chat=chat, default_model=self.model_name)
        if job.model != self.model_name:
            raise RequestError(f"model {job.model!r} is not served here; this server serves {self.model_name!r} "
                               f"(GET /v1/models)", status=404, param="model", code="model_not_found")
        ids = self._prompt_ids(job)
        try:
            params = SamplingParams(
                max_new_tokens=job.max_tokens or self.engine.max_seq_len, temperature=job.temperature,
                top_p=job.top_p, top_k=job.top_k, seed=job.seed, stop_token_ids=tuple(job.stop_token_ids),
                ignore_eos=job.ignore_eos)
            if self.aengine is None or not self.aengine.running:
                raise RequestError("the engine is not running (the server is shutting down)", status=503,
                                   kind="service_unavailable")
            ids, params = self.aengine.check(ids, params)
        except (PromptTooLongError, CacheFullError) as e:
            raise RequestError(_one_request(e), status=413, code="context_length_exceeded") from None
        except InputError as e:
            raise RequestError(_one_request(e)) from None
        return job, ids, params

    def _prompt_ids(self, job: Job) -> list[int]:
        if job.prompt_ids is not None:
            return job.prompt_ids
        tok = self.tokenizer
        if tok is None:
            what = "chat messages need" if job.chat else "a text prompt needs"
            raise RequestError(f"{what} a tokenizer and this server has none (it reads the one in the model "
                               f"folder); send the prompt as token ids to /v1/completions",
                               param="messages" if job.chat else "prompt")
        if job.chat:
            if not getattr(tok, "chat_template", None):
                raise RequestError("the model's tokenizer has no chat template (tokenizer_config.json "
                                   "'chat_template'); use /v1/completions", param="messages")
            try:
                text = tok.apply_chat_template(job.messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - a template that rejects these messages (a jinja error)
                raise RequestError(f"the chat template rejects these messages: {e}", param="messages") from None
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(job.prompt_text)["input_ids"])

    async def events(self, job: Job, ids: list[int], params: SamplingParams) -> AsyncIterator[tuple]:
        """(text piece, new token ids, finish reason or None) per engine step, until the request ends;
        a stop string ends it early (the request is aborted when this generator closes)."""
        text = TextStream(self.tokenizer, job.stop)
        stream = self.aengine.stream(ids, params)
        try:
            async for out in stream:
                piece = text.add(out.token_ids, out.finish_reason)
                reason = "stop" if text.stopped else out.finish_reason
                yield piece, out.token_ids, reason
                if reason is not None:
                    return
        finally:
            await stream.aclose()

    # ---- answers --------------------------------------------------------------------------
    def _head(self, job: Job, rid: str, chunk: bool) -> dict:
        kind = ("chat.completion" if job.chat else "text_completion") + (".chunk" if chunk and job.chat else "")
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _choice(self, job: Job, text: str, token_ids: list[int], reason: str | None, chunk: bool) -> dict:
        choice = {"index": 0, "finish_reason": reason, "logprobs": None, "token_ids": token_ids}
        if not job.chat:
            choice["text"] = text
        elif chunk:
            choice["delta"] = {"content": text} if text or reason is None else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice

    async def complete(self, job: Job, ids: list[int], params: SamplingParams, request: Request) -> JSONResponse:
        rid = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        pieces, tokens, reason = [], [], None

        async def collect():
            nonlocal reason
            async for piece, new, reason in self.events(job, ids, params):
                pieces.append(piece)
                tokens.extend(new)

        # A client that hangs up while its answer is computed has its request aborted (the
        # collecting task is cancelled, which closes the stream), as a streaming client's is.
        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            work.cancel()                               # a no-op once it has finished
            (outcome,) = await asyncio.gather(work, return_exceptions=True)
        if isinstance(outcome, asyncio.CancelledError):
            return _error(RequestError("the client disconnected", status=499))   # nobody reads it
        if isinstance(outcome, EngineStoppedError):
            return _error(RequestError(str(outcome), status=503, kind="service_unavailable"))
        if isinstance(outcome, BaseException):
            raise outcome
        return JSONResponse({**self._head(job, rid, False),
                             "choices": [self._choice(job, "".join(pieces), tokens, reason, False)],
                             "usage": self._usage(len(ids), len(tokens))})

    def stream(self, job: Job, ids: list[int], params: SamplingParams) -> StreamingResponse:
        rid = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex

        async def body():
            count = 0
            if job.chat:
                yield _sse({**self._head(job, rid, True), "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                     "logprobs": None}]})
            events = self.events(job, ids, params)
            try:
                async for piece, new, reason in events:
                    count += len(new)
                    chunk = {**self._head(job, rid, True), "choices": [self._choice(job, piece, new, reason, True)]}
                    if reason is not None:
                        chunk["usage"] = self._usage(len(ids), count)
                    yield _sse(chunk)
            except EngineStoppedError as e:
                yield _sse(error_body(str(e), kind="service_unavailable"))
            finally:
                await events.aclose()
            yield _sse("[DONE]")
        return EventStream(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---- the app --------------------------------------------------------------------------
    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.aengine = AsyncEngine(self.engine)
            try:
                yield
            finally:
                self.aengine.shutdown()

        app = FastAPI(title="dsgraph", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.state.server = self

        @app.exception_handler(HTTPException)
        async def http_error(_request, exc: HTTPException):
            return JSONResponse(error_body(str(exc.detail), kind="not_found_error" if exc.status_code == 404
                                           else "invalid_request_error"), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def server_error(_request, exc: Exception):
            return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", kind="server_error"),
                                status_code=500)

        async def generate(request: Request, chat: bool):
            try:
                try:
                    body = await request.json()
                except ValueError as e:          # json.JSONDecodeError and bad UTF-8 alike
                    raise RequestError(f"the request body is not valid JSON: {e}") from None
                job, ids, params = self.prepare(body, chat)
            except RequestError as e:
                return _error(e)
            return self.stream(job, ids, params) if job.stream else await self.complete(job, ids, params, request)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await generate(request, chat=True)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "dsgraph", "max_model_len": self.engine.max_seq_len,
                                                "vocab_size": self.engine.vocab}]}

        @app.get("/health")
        async def health():
            running = self.aengine is not None and self.aengine.running
            return JSONResponse({"status": "ok" if running else "stopped", **(self.aengine.stats if running else {})},
                                status_code=200 if running else 503)

        return app


async def _disconnected(request: Request, every: float = 0.25) -> None:
    """Returns once the client has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(every)


def _one_request(e: Exception) -> str:
    """The engine's message about "prompt 0" (of a call's prompts), about this request's prompt."""
    return str(e).replace("prompt 0", "the prompt", 1)


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)
