"""`dsgraph serve` started as a user starts it (a subprocess on 127.0.0.1), on a tiny random checkpoint
with a tokenizer and chat template saved beside it, on the CPU (reference backend), queried with
the `openai` client: completions, chat, streaming, stop strings, 16 concurrent streams whose greedy
tokens equal engine.generate run alone, a client that leaves mid-stream (its request is aborted and
its cache blocks come back), bad requests as OpenAI-shaped errors, and a clean stop on SIGTERM."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hf_tiny import VOCAB, build                       # noqa: E402
from serve_client import server_log, start_server                  # noqa: E402
from tiny_tokenizer import SPECIAL, save_tokenizer     # noqa: E402

MAX_SEQ_LEN = 256                  # the tiny model's limit: a long answer takes a few seconds on the CPU
ENGINE_ARGS = ["--backend", "reference", "--device", "cpu", "--dtype", "fp32", "--block-size", "4",
               "--max-seq-len", str(MAX_SEQ_LEN)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = build("v3", tmp_path_factory.mktemp("v3"))
    return save_tokenizer(d, VOCAB)


@pytest.fixture(scope="module")
def server(model_dir):
    url, proc = start_server(model_dir, *ENGINE_ARGS)
    yield url, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(model_dir):
    from runtime import Engine
    return Engine.from_pretrained(model_dir, backend="reference", device="cpu", dtype="fp32", block_size=4,
                                  max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def alone(engine, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of one prompt run by itself, in this process."""
    from runtime import SamplingParams
    return engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids


def prompt_ids(i: int, n: int = 5) -> list[int]:
    return [len(SPECIAL) + (7 * i + 3 * j) % (VOCAB - len(SPECIAL)) for j in range(n)]


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_models_and_health(server, client, model_dir):
    assert [m.id for m in client.models.list().data] == [model_dir.name]
    health = httpx.get(f"{server[0]}/health").json()
    assert health["status"] == "ok" and health["free_blocks"] == health["num_blocks"]


def test_completion_equals_generate(client, engine, tokenizer, model_dir):
    p = prompt_ids(1)
    out = client.completions.create(model=model_dir.name, prompt=p, max_tokens=6, **GREEDY)
    choice = out.choices[0]
    assert choice.token_ids == alone(engine, p, 6)
    assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 6, 11)


def test_text_prompt_and_chat_template(client, engine, tokenizer, model_dir):
    out = client.completions.create(model=model_dir.name, prompt="w3 w14 w15", max_tokens=4, **GREEDY)
    assert out.choices[0].token_ids == alone(engine, tokenizer("w3 w14 w15")["input_ids"], 4)
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w7 w8 w9"}]
    chat = client.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=5, **GREEDY)
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
    assert ids[:3] == [1, 4, len(SPECIAL) + 1]           # <s> <|system|> w1: the checkpoint's template ran
    assert chat.choices[0].token_ids == alone(engine, ids, 5)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tokenizer.decode(chat.choices[0].token_ids, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 5


def test_streaming_equals_the_whole_answer(client, model_dir):
    p = prompt_ids(2)
    whole = client.completions.create(model=model_dir.name, prompt=p, max_tokens=7, **GREEDY).choices[0]
    chunks = list(client.completions.create(model=model_dir.name, prompt=p, max_tokens=7, stream=True, **GREEDY))
    assert len(chunks) == 7                               # one chunk per engine step
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.choices[0].token_ids] == whole.token_ids
    assert [c.choices[0].finish_reason for c in chunks][-2:] == [None, "length"]
    assert chunks[-1].usage.completion_tokens == 7 and all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "w4 w5"}]
    chat = client.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=4, **GREEDY)
    pieces = list(client.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=4,
                                                 stream=True, **GREEDY))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == chat.choices[0].message.content
    assert pieces[-1].choices[0].finish_reason == "length" and pieces[-1].usage.total_tokens == chat.usage.total_tokens


def test_stop_strings_and_stop_ids(client, model_dir):
    p = prompt_ids(0)                                     # eight ordinary tokens, the first four distinct
    full = client.completions.create(model=model_dir.name, prompt=p, max_tokens=8, **GREEDY).choices[0]
    words = full.text.split(" ")
    assert len(set(words[:4])) == 4
    stop = words[3]
    want = full.text[:full.text.find(stop)]
    for stream in (False, True):
        kw = dict(model=model_dir.name, prompt=p, max_tokens=8, stop=[stop, "never-there"], stream=stream, **GREEDY)
        if stream:
            chunks = list(client.completions.create(**kw))
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**kw).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert (text, reason) == (want, "stop")
    # a stop token id (in `stop`, or vLLM's stop_token_ids) ends it there, the token not in the text
    tok = full.token_ids[2]
    for body in ({"stop": [tok]}, {"stop_token_ids": [tok]}):
        choice = client.completions.create(model=model_dir.name, prompt=p, max_tokens=8, temperature=0,
                                           extra_body={**body, "ignore_eos": True}).choices[0]
        assert choice.token_ids == full.token_ids[:3] and choice.finish_reason == "stop"
        assert choice.text == " ".join(words[:2])


def test_sixteen_concurrent_streams_equal_generate_alone(client, engine, model_dir):
    prompts = [prompt_ids(i, 2 + i % 7) for i in range(16)]
    lengths = [3 + i % 6 for i in range(16)]

    def run(i):
        tokens = []
        for c in client.completions.create(model=model_dir.name, prompt=prompts[i], max_tokens=lengths[i],
                                           stream=True, **GREEDY):
            tokens += c.choices[0].token_ids
        return tokens

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, range(16)))
    assert got == [alone(engine, p, n) for p, n in zip(prompts, lengths)]


def _wait_aborted(url: str, before: dict) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health").json()
        if health["requests"] == 0 and health["aborted"] > before["aborted"]:
            break
        time.sleep(0.1)
    return health


def test_a_client_that_leaves_mid_stream_is_aborted_and_its_blocks_come_back(server, model_dir):
    url = server[0]
    before = httpx.get(f"{url}/health").json()
    body = {"model": model_dir.name, "prompt": prompt_ids(4), "max_tokens": MAX_SEQ_LEN, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break                                     # leave, mid-answer
    health = _wait_aborted(url, before)
    assert health["aborted"] == before["aborted"] + 1 and health["requests"] == 0
    assert health["free_blocks"] == health["num_blocks"]


def test_a_client_that_leaves_before_its_whole_answer_is_aborted(server, model_dir):
    url = server[0]
    before = httpx.get(f"{url}/health").json()
    body = {"model": model_dir.name, "prompt": prompt_ids(4), "max_tokens": MAX_SEQ_LEN, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    health = _wait_aborted(url, before)
    assert health["aborted"] == before["aborted"] + 1 and health["requests"] == 0
    assert health["free_blocks"] == health["num_blocks"]


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"prompt": [1, 2], "temperature": "hot"}, 400, "'temperature' must be a number"),
    ({"prompt": [1, 2], "n": 2}, 400, "'n' must be 1"),
    ({"prompt": [1, VOCAB + 5]}, 400, "out of range"),
    ({"prompt": {"a": 1}}, 400, "'prompt' must be a string or a list of token ids"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "not served here"),
    ({"prompt": [7] * (MAX_SEQ_LEN + 1)}, 413, f"at most {MAX_SEQ_LEN}"),
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, words):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server[0]}/v1/completions", headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"]


def test_errors_through_the_client_and_others_unaffected(client, engine, model_dir):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="no-such-model", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=model_dir.name,
                                       messages=[{"role": "user", "content": "w1 " * MAX_SEQ_LEN}])
    assert e.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.get("/v1/nothing-here", cast_to=object)
    p = prompt_ids(5)
    assert client.completions.create(model=model_dir.name, prompt=p, max_tokens=3, **GREEDY).choices[0].token_ids \
        == alone(engine, p, 3)


def test_the_load_script_reports_throughput_and_ttft(server):
    """bench/serve_load.py (the GPU load run's script), briefly, against the CPU server."""
    import asyncio

    from bench.serve_load import run_load
    report = asyncio.run(run_load(server[0], streams=4, seconds=1.0, prompt_len=6, max_tokens=4))
    assert report.requests >= 4 and report.errors == 0
    assert report.output_tokens == 4 * report.requests and report.tokens_per_s > 0
    assert 0 < report.ttft_ms["p50"] <= report.ttft_ms["p99"] and report.tpot_ms["p50"] > 0
    health = httpx.get(f"{server[0]}/health").json()
    assert health["requests"] == 0 and health["free_blocks"] == health["num_blocks"]


def test_sigterm_stops_the_server_cleanly(server, model_dir):
    """Last: it stops the module's server.  A stream open at SIGTERM ends (finished, or cut at the
    shutdown timeout) and the process exits 0 with no traceback."""
    url, proc = server
    body = {"model": model_dir.name, "prompt": prompt_ids(6), "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines, opened = [], threading.Event()

    def stream():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    opened.set()
        except httpx.TransportError:
            pass
        opened.set()

    t = threading.Thread(target=stream)
    t.start()
    assert opened.wait(60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    t.join(60)
    assert not t.is_alive()
    err = server_log(proc)
    assert "Traceback" not in err and "dsgraph: server stopped" in err, err
    assert lines and json.loads(lines[0].removeprefix("data: "))["object"] == "text_completion"


def test_sigint_stops_a_server_cleanly(model_dir):
    """Ctrl-C in the terminal: the same graceful stop, exit 0, no traceback."""
    url, proc = start_server(model_dir, *ENGINE_ARGS)
    assert httpx.get(f"{url}/health").status_code == 200
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    err = server_log(proc)
    assert "Traceback" not in err and "dsgraph: server stopped" in err, err
