"""The HTTP app in-process (Starlette's TestClient, the tiny engine, no tokenizer), and the text
stream it sends: what the subprocess tests in tests/e2e/test_serve.py do not reach cheaply."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient                 # noqa: E402

from runtime import SamplingParams                         # noqa: E402
from runtime.serve import Server, TextStream               # noqa: E402
from tiny_engine import make_engine, prompts               # noqa: E402


@pytest.fixture
def app_engine():
    engine = make_engine(num_blocks=128)
    with TestClient(Server(engine, None, "tiny").app()) as client:
        yield client, engine


def test_token_ids_without_a_tokenizer(app_engine):
    client, engine = app_engine
    p = prompts([5], seed=9)[0]
    (want,) = engine.generate([p], SamplingParams(max_new_tokens=4, ignore_eos=True))
    r = client.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["text"] == "" and choice["finish_reason"] == "length"
    for path, body, words in (("/v1/completions", {"prompt": "hello"}, "a text prompt needs a tokenizer"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                               "chat messages need a tokenizer")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_routes_and_methods_answer_in_openai_shape(app_engine):
    client, _ = app_engine
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    r = client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_a_stopped_engine_answers_503(app_engine):
    client, _ = app_engine
    client.app.state.server.aengine.shutdown()           # as a failed step or a shutdown stops it
    r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 503


class WordTokenizer:
    """decode() of a table of pieces; piece 0 is the first byte of a two-byte character (U+FFFD alone)."""
    pieces = {0: "\ufffd", 1: "é", 2: "ab", 3: "c", 4: "STOP", 5: "S", 6: "TOP", 7: "x"}

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.pieces[i] for i in ids)
        return text.replace("\ufffdé", "é")          # 0 then 1: the character completed


def test_text_stream_holds_back_half_characters_and_stop_string_prefixes():
    s = TextStream(WordTokenizer(), ["STOP"])
    assert s.add([2], None) == "ab"
    assert s.add([0], None) == ""                    # half a character: not sent yet
    assert s.add([1], None) == "é"
    assert s.add([5], None) == ""                    # "S" may begin "STOP"
    assert s.add([6], None) == "" and s.stopped      # it did: nothing of it is sent
    s = TextStream(WordTokenizer(), ["STOP"])
    assert s.add([5], None) == "" and s.add([3], None) == "Sc"     # it did not: sent once it cannot
    assert s.add([5], "length") == "S"                              # the end flushes what was held
    s = TextStream(WordTokenizer(), [])
    assert s.add([2, 7], None) == "abx" and s.add([3], "stop") == ""   # a stop token is not text
