"""The OpenAI request bodies `dsgraph serve` takes, read into one checked Job, and the error bodies
it answers with.  Plain Python (no pydantic models): every field is checked here, so a bad value
is one 400 naming the field, in OpenAI's error shape.

    /v1/completions       prompt: text | [token ids] (or a list holding one of those)
    /v1/chat/completions  messages: [{role, content: text | [{type: "text", text}]}]
    both                  model, max_tokens (chat: also max_completion_tokens), temperature, top_p,
                          top_k, seed, stop (strings and token ids), stop_token_ids, ignore_eos,
                          stream, stream_options; n must be 1
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import DsgraphError

# OpenAI's defaults, where OpenAI has one (temperature 1: sampling unless a request asks for 0).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_TOKENS = 16          # /v1/completions' max_tokens when none is given; chat runs to the end


class RequestError(DsgraphError):
    """A request the server refuses: `status` (400, 404, 413, 503) and OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return error_body(str(self), kind=self.kind, param=self.param, code=self.code)


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Job:
    """One checked request: what to run and how to answer."""
    chat: bool
    model: str
    prompt_text: str | None                 # completions: a text prompt (the tokenizer makes ids)
    prompt_ids: list[int] | None            # completions: token ids given directly
    messages: list[dict] | None             # chat: role/content pairs, content as text
    max_tokens: int | None                  # None: up to the sequence limit
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False


def _get(body: dict, name: str, kinds, default, what: str):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RequestError(f"'{name}' must be {what}, got {value!r}", param=name)
    return value


def _integer(body: dict, name: str, default, low: int, high: int | None = None):
    value = _get(body, name, (int,), default, "an integer")
    if value is not None and (value < low or (high is not None and value > high)):
        raise RequestError(f"'{name}' must be an integer >= {low}" + (f" and <= {high}" if high else "")
                           + f", got {value}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = _get(body, name, (int, float), default, "a number")
    if not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value!r}", param=name)
    return float(value)


def _token_ids(value, name: str) -> list[int] | None:
    """`value` as token ids when it is a non-empty list of non-negative integers, else None."""
    if (isinstance(value, list) and value
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        return list(value)
    return None


def parse_job(body, *, chat: bool, default_model: str) -> Job:
    """The Job a /v1/completions (chat=False) or /v1/chat/completions (chat=True) body asks for."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    model = _get(body, "model", (str,), default_model, "a string")
    if _integer(body, "n", 1, 1) != 1:
        raise RequestError("'n' must be 1: dsgraph serve returns one choice per request", param="n")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias"):
        if body.get(name) not in (None, False, [], {}):
            raise RequestError(f"'{name}' is not supported by dsgraph serve", param=name)
    if body.get("best_of") not in (None, 1):
        raise RequestError("'best_of' must be 1", param="best_of")

    prompt_text = prompt_ids = messages = None
    if chat:
        messages = _messages(body.get("messages"))
        max_tokens = _integer(body, "max_completion_tokens", None, 1)
        max_tokens = _integer(body, "max_tokens", max_tokens, 1)
    else:
        prompt_text, prompt_ids = _prompt(body.get("prompt"))
        max_tokens = _integer(body, "max_tokens", DEFAULT_COMPLETION_TOKENS, 1)

    top_k = _integer(body, "top_k", 0, -1)
    stop, stop_ids = _stops(body.get("stop"))
    extra_ids = body.get("stop_token_ids")
    if extra_ids is not None:
        ids = _token_ids(extra_ids, "stop_token_ids") if extra_ids != [] else []
        if ids is None:
            raise RequestError(f"'stop_token_ids' must be a list of token ids, got {extra_ids!r}",
                               param="stop_token_ids")
        stop_ids += ids
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, got {options!r}", param="stream_options")
    return Job(chat=chat, model=model, prompt_text=prompt_text, prompt_ids=prompt_ids, messages=messages,
               max_tokens=max_tokens, temperature=_number(body, "temperature", DEFAULT_TEMPERATURE),
               top_p=_number(body, "top_p", 1.0), top_k=max(top_k, 0),        # -1: off (vLLM's spelling)
               seed=_integer(body, "seed", None, 0), stop=stop, stop_token_ids=stop_ids,
               ignore_eos=_get(body, "ignore_eos", (bool,), False, "true or false"),
               stream=_get(body, "stream", (bool,), False, "true or false"))


def _prompt(value) -> tuple[str | None, list[int] | None]:
    """A completions prompt: text, token ids, or a list holding exactly one of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise RequestError("'prompt' is empty", param="prompt")
        return value, None
    ids = _token_ids(value, "prompt")
    if ids is None:
        raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request), "
                           f"got {_short(value)}", param="prompt")
    return None, ids


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):      # [{type: "text", text: ...}, ...]: the text parts, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts",
                               param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _stops(value) -> tuple[list[str], list[int]]:
    """`stop`: a string, or a list of strings and token ids (up to OpenAI's 4 strings, any ids)."""
    if value is None:
        return [], []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise RequestError(f"'stop' must be a string or a list of strings and token ids, got {_short(value)}",
                           param="stop")
    strings, ids = [], []
    for item in items:
        if isinstance(item, str) and item:
            strings.append(item)
        elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            ids.append(item)
        else:
            raise RequestError(f"'stop' entries must be non-empty strings or token ids, got {item!r}",
                               param="stop")
    return strings, ids


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
