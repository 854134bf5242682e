"""`dsgraph serve` on the GPU (cuda backend): the CPU server tests' core against the generated kernels
(completions, chat, streaming and 16 concurrent streams equal engine.generate run alone), and a
load run of 64 streams reporting tokens/s and time to first token (bench/serve_load.py)."""
from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.hf_tiny import VOCAB, build
from tests.e2e.serve_client import server_log, start_server
from tests.e2e.tiny_tokenizer import SPECIAL, save_tokenizer

pytestmark = pytest.mark.gpu
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ENGINE = dict(backend="cuda", device="cuda", dtype="fp32", block_size=5, max_seq_len=128)
ARGS = ["--backend", "cuda", "--device", "cuda", "--dtype", "fp32", "--block-size", "5", "--max-seq-len", "128"]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = save_tokenizer(build("v3", tmp_path_factory.mktemp("v3")), VOCAB)
    url, proc = start_server(model_dir, *ARGS, timeout=900)       # the first start compiles the bundle
    yield model_dir, url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, server_log(proc)[-3000:]
    assert "Traceback" not in server_log(proc)


@pytest.fixture(scope="module")
def engine(served):
    from runtime import Engine
    return Engine.from_pretrained(served[0], **ENGINE)


def _alone(engine, prompt, n):
    from runtime import SamplingParams
    return engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids


def _prompt(i, n=6):
    return [len(SPECIAL) + (7 * i + 3 * j) % (VOCAB - len(SPECIAL)) for j in range(n)]


def test_completions_chat_and_streams_equal_generate(served, engine):
    model_dir, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    p = _prompt(1)
    out = client.completions.create(model=model_dir.name, prompt=p, max_tokens=8, **GREEDY)
    assert out.choices[0].token_ids == _alone(engine, p, 8) and out.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=model_dir.name, prompt=p, max_tokens=8, stream=True, **GREEDY))
    assert [t for c in chunks for t in c.choices[0].token_ids] == out.choices[0].token_ids
    chat = client.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "w3 w4"}],
                                          max_tokens=5, **GREEDY)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5

    prompts, lengths = [_prompt(i, 2 + i % 9) for i in range(16)], [4 + i % 7 for i in range(16)]

    def run(i):
        return [t for c in client.completions.create(model=model_dir.name, prompt=prompts[i], max_tokens=lengths[i],
                                                     stream=True, **GREEDY) for t in c.choices[0].token_ids]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, range(16)))
    assert got == [_alone(engine, p, n) for p, n in zip(prompts, lengths)]


def test_load_run_of_64_streams(served):
    from bench.serve_load import run_load
    seconds = float(os.environ.get("DSGRAPH_SERVE_LOAD_SECONDS", "20"))
    report = asyncio.run(run_load(served[1], streams=64, seconds=seconds, prompt_len=32, max_tokens=64))
    print("\n".join(report.lines()))
    assert report.errors == 0 and report.requests >= 64 and report.tokens_per_s > 0
