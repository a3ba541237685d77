"""The OpenAI-compatible server, tested as users meet it: a real server process on a free
loopback port, driven with the official `openai` client (and raw HTTP for the edges)."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from runtime import LLM, SamplingParams
from tests.serving import (ROOT, error_of, free_port, metric, running_server, start_server, tiny_chat_spec,
                           wait_idle)

KEY = "test-key"


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Path:
    return tiny_chat_spec(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def server(spec):
    with running_server(spec, "--api-key", KEY, "--max-body-bytes", "20000", "--body-timeout", "3") as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(spec) -> LLM:
    return LLM(spec)


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_completion_matches_offline_greedy(client, llm):
    r = client.completions.create(model="tiny-chat", prompt="The capital of France is", **GREEDY)
    ref = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.model == "tiny-chat" and r.object == "text_completion"


def test_chat_completion_uses_the_chat_template(client, llm):
    messages = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model="tiny-chat", messages=messages, **GREEDY)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = llm.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False)},
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streaming_equals_non_streaming(client):
    full = client.completions.create(model="tiny-chat", prompt="Once upon a time", **GREEDY)
    chunks = list(client.completions.create(model="tiny-chat", prompt="Once upon a time", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    chat = list(client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                               stream=True, **GREEDY))
    assert chat[0].choices[0].delta.role == "assistant"
    ref = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chat) == ref.choices[0].message.content


def test_n_and_seeds(client):
    kw = dict(model="tiny-chat", prompt="Tell me", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(n=2, seed=11, **kw)
    b = client.completions.create(n=2, seed=11, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]      # reproducible
    assert a.choices[0].text != a.choices[1].text                          # samples differ
    c = client.completions.create(n=1, seed=12, **kw)
    assert c.choices[0].text != a.choices[0].text
    assert a.usage.completion_tokens == 20
    streamed = list(client.completions.create(n=2, seed=11, stream=True, **kw))
    for i in range(2):
        assert "".join(x.choices[0].text for x in streamed if x.choices and x.choices[0].index == i) == a.choices[i].text


def test_stop_strings(client):
    free = client.completions.create(model="tiny-chat", prompt="A B C", **GREEDY).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    assert stop.strip(), free
    r = client.completions.create(model="tiny-chat", prompt="A B C", stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(stop)]
    streamed = list(client.completions.create(model="tiny-chat", prompt="A B C", stop=[stop], stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_logprobs(client):
    r = client.completions.create(model="tiny-chat", prompt="Hi", logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 12 and len(lp.token_logprobs) == 12
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == 12 and all(len(e.top_logprobs) == 3 for e in content)
    assert "".join(e.token for e in content) == c.choices[0].message.content


def test_error_responses(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt="x", temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="max_model_len is 256"):
        client.completions.create(model="tiny-chat", prompt=[5] * 300)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-17", prompt="x")
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny-chat", prompt="x", presence_penalty=2.5)
    anon = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anon.models.list()
    assert error_of(httpx.get(server + "/v1/models"))["code"] == "invalid_api_key"
    r = httpx.get(server + "/v1/nope", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and error_of(r)
    r = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=json.dumps({"prompt": "x" * 30000}))
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
    r = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, content=b"{not json")
    assert r.status_code == 400 and error_of(r)
    assert httpx.get(server + "/health").json() == {"status": "ok"}     # outside /v1: no key
    assert client.models.list().data[0].id == "tiny-chat"


def test_load_with_disconnects(server):
    """64 concurrent streams, a quarter of them dropped mid-stream: the rest complete in
    full, and afterwards nothing runs and every block is free."""
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(http: httpx.AsyncClient, i: int) -> int | None:
        shared = "You are a helpful assistant. Answer briefly and politely. " * 3   # > 2 blocks
        body = {"model": "tiny-chat", "prompt": f"{shared}request {i} says", "max_tokens": 24, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        chunks = 0
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    return data["usage"]["completion_tokens"]
                chunks += 1
                if i % 4 == 0 and chunks == 3:
                    return None          # leave mid-stream: the server must abort and free
        raise AssertionError("stream ended without usage")

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(64))), 240)

    results = asyncio.run(run())
    assert [r for i, r in enumerate(results) if i % 4] == [24] * 48
    text = wait_idle(server)
    assert metric(text, "zooinfer_num_requests_running") == 0
    assert metric(text, "zooinfer_num_requests_waiting") == 0
    assert metric(text, "zooinfer_kv_cache_free_blocks") == metric(text, "zooinfer_kv_cache_blocks")
    assert metric(text, "zooinfer_request_success_total") >= 48
    # every prompt shares its first block with the others: the prefix cache served them
    assert metric(text, "zooinfer_prefix_cache_hits") > 0
    assert 0 < metric(text, "zooinfer_prefix_cache_hit_rate") <= 1
    assert metric(text, "zooinfer_time_to_first_token_seconds_count") >= 64


def test_sigterm_drains_and_exits(spec):
    proc, base = start_server(spec)
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        it = r.iter_lines()
        next(l for l in it if l.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        rest = list(it)                    # the in-flight stream finishes before shutdown
    assert "data: [DONE]" in rest
    # uvicorn re-raises the signal once it has shut down cleanly, as servers conventionally do.
    assert proc.wait(60) in (0, -signal.SIGTERM)
    log = proc.stdout.read()
    assert "Traceback" not in log and "ERROR" not in log, log


def test_cli_reports_missing_weights(tmp_path):
    spec = tmp_path / "missing.yaml"
    spec.write_text(f"extends: {ROOT / 'zoo' / 'smollm2-tiny.yaml'}\n"
                    f"checkpoint: {{source: hf, path: {tmp_path / 'nowhere'}}}\n")
    proc = subprocess.run([sys.executable, "-m", "runtime.serve", str(spec), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"checkpoint.path: no such directory {tmp_path / 'nowhere'} (download" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
