"""Hostile requests against a real server: each one that used to kill the engine or be
silently ignored gets a 400 naming the field, and the engine keeps serving everyone."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import pytest

from tests.serving import ROOT, error_of, metric, running_server, tiny_chat_spec, wait_idle

VOCAB = 49152          # SmolLM2's tokenizer, which the tiny-chat spec uses
BIG = 2 ** 63          # one past int64
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = tiny_chat_spec(tmp_path_factory.mktemp("hardening"))
    with running_server(spec, "--max-body-bytes", "20000", "--body-timeout", "2") as (proc, base):
        yield base, proc
    log = proc.stdout.read()      # every request above was answered without an exception
    assert "Traceback" not in log and "ERROR" not in log, log


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


def _post(http, route: str, body: dict) -> httpx.Response:
    # json.dumps, not httpx's json=: lone surrogates go out as \ud800 escapes and NaN as NaN,
    # as a hostile client sends them.
    return http.post(f"/v1/{route}", content=json.dumps(body), headers={"Content-Type": "application/json"})


def _greedy(http, route: str = "completions", **extra) -> httpx.Response:
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    body.setdefault("prompt" if route == "completions" else "messages", "Once upon a time" if route == "completions"
                    else CHAT)
    return _post(http, route, body)


def _text(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["text"] if "text" in c else c["message"]["content"] for c in r.json()["choices"]]


# Each of these alone used to take the engine down for every client.
ENGINE_KILLERS = [
    ("completions", {"prompt": "a\ud800b"}, "prompt", "lone UTF-16 surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content",
     "lone UTF-16 surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content", "lone UTF-16 surrogate"),
    # Beyond int64: pydantic's bound and error type, as vLLM words it; in int64 but negative: ours.
    ("completions", {"prompt": "hi", "seed": 2 ** 64}, "seed", "[type=less_than_equal]"),
    ("completions", {"prompt": "hi", "seed": BIG}, "seed", "[type=less_than_equal]"),
    ("completions", {"prompt": "hi", "seed": -1}, "seed", "[0, 2^63)"),
    ("completions", {"prompt": "hi", "top_k": BIG}, "top_k", "below 2^63"),
    ("completions", {"prompt": "hi", "min_tokens": BIG, "max_tokens": None}, "min_tokens", "[0, 2^63)"),
    ("completions", {"prompt": "hi", "stop_token_ids": [BIG]}, "stop_token_ids", "non-negative token ids"),
    ("completions", {"prompt": "hi", "stop_token_ids": [VOCAB]}, "stop_token_ids", "not in the vocabulary"),
    ("completions", {"prompt": "hi", "temperature": float("nan")}, "temperature", "must be in [0, 100]"),
    ("completions", {"prompt": "hi", "n": 10 ** 9}, "n", "[1, 64]"),
]


@pytest.mark.parametrize("route, body, param, words", ENGINE_KILLERS, ids=[f"{b}" for _, b, _, _ in ENGINE_KILLERS])
def test_engine_killers_are_400s(http, route, body, param, words):
    r = _post(http, route, {"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and words in err["message"], err
    assert http.get("/health").json() == {"status": "ok"}


def test_engine_serves_on_after_every_killer(server, http):
    before = _text(_greedy(http))
    for route, body, _, _ in ENGINE_KILLERS:
        assert _post(http, route, {"max_tokens": 4, **body}).status_code == 400
    assert _text(_greedy(http)) == before
    text = wait_idle(server[0])
    assert metric(text, "zooinfer_kv_cache_free_blocks") == metric(text, "zooinfer_kv_cache_blocks")


def test_samples_are_engine_forks(server, http):
    """n > 1 over HTTP goes through the engine's fan-out: the samples fork from sample 0's
    prompt blocks, as `LLM.generate` does (runtime/parallel_sampling.py)."""
    before = metric(wait_idle(server[0]), "zooinfer_num_forks")
    body = {"prompt": "Tell me a story about a dragon", "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 4}
    assert len(set(_text(_post(http, "completions", body)))) == 4
    assert metric(wait_idle(server[0]), "zooinfer_num_forks") == before + 3


def test_largest_seed_with_n_wraps_instead_of_overflowing(http):
    body = {"prompt": "Tell me", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "n": 3,
            "seed": BIG - 1}
    a, b = _text(_post(http, "completions", body)), _text(_post(http, "completions", body))
    assert a == b and len(set(a)) == 3          # reproducible, and the three samples differ
    # sample 1 of seed 2^63 - 1 is seed 0 (wrapped): the same text as sample 0 of seed 0
    zero = _text(_post(http, "completions", {**body, "n": 1, "seed": 0}))
    assert zero[0] == a[1]


# Parameters that were accepted with a 200 and ignored.
IGNORED = [
    ("completions", {"prompt": "hi", "suffix": " the end"}, "suffix"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "frob": 1}}}, "response_format"),
    ("completions", {"prompt": "hi", "structured_outputs": {"json": {"type": "object"}, "regex": "a"}},
     "structured_outputs"),
    ("completions", {"prompt": "hi", "guided_regex": "(", "guided_choice": ["a"]}, "guided_regex"),
    ("completions", {"prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex"),
    ("completions", {"prompt": "hi", "guided_json": {"type": "object", "properties": {"a": {"type": "frob"}}}},
     "guided_json"),
    ("chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),                                  # auto, and this server has no tool parser
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}, {"type": "text", "text": "hi"}]}]},
     "messages[0].content[0].type"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages[0].content[0].type"),
    ("chat/completions", {"messages": CHAT, "mood": "x"}, "mood"),    # inside a message it reaches the template
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("route, body, param", IGNORED, ids=[p for _, _, p in IGNORED])
def test_unsupported_parameters_are_400s_naming_them(http, route, body, param):
    r = _post(http, route, {"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and param.split(".")[0].split("[")[0] in err["message"], err


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_penalties_and_logit_bias_apply(http, route):
    """Honoured now, not refused: a +100 bias on one token makes greedy output only it, and a
    repetition penalty or an allowed list changes the text; bad values are 400s naming the field."""
    chat = route.startswith("chat")
    tok = _post(http, route, {"max_tokens": 6, "temperature": 0, "logit_bias": {"29": 100}, "ignore_eos": True,
                              "logprobs": True if chat else 1, **({"messages": CHAT} if chat else {"prompt": "hi"})})
    assert tok.status_code == 200, tok.text
    lp = tok.json()["choices"][0]["logprobs"]
    tokens = [e["token"] for e in lp["content"]] if chat else lp["tokens"]
    assert len(tokens) == 6 and len(set(tokens)) == 1
    plain = _text(_greedy(http, route))
    assert _text(_greedy(http, route, repetition_penalty=0.05)) != plain     # < 1 favours seen tokens
    assert _text(_greedy(http, route, allowed_token_ids=[29, 30])) != plain
    for bad, param in (({"logit_bias": {"x1": 5}}, "logit_bias"), ({"logit_bias": {"5": 500}}, "logit_bias"),
                       ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": -1}, "repetition_penalty"),
                       ({"allowed_token_ids": []}, "allowed_token_ids")):
        body = {"max_tokens": 2, **bad, **({"messages": CHAT} if route.startswith("chat") else {"prompt": "hi"})}
        r = _post(http, route, body)
        assert r.status_code == 400 and error_of(r)["param"] == param, r.text


@pytest.mark.parametrize("route, noop", [
    ("completions", {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None,
                     "best_of": 1, "echo": False, "repetition_penalty": 1.0, "user": "u1"}),
    ("chat/completions", {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [],
                          "parallel_tool_calls": True, "store": False, "logprobs": False}),
])
def test_noop_values_are_accepted_and_change_nothing(http, route, noop):
    assert _text(_greedy(http, route, **noop)) == _text(_greedy(http, route))


def test_unknown_field_is_named(http):
    err = error_of(_greedy(http, frobnicate=1))
    assert err["message"] == "unrecognized request argument supplied: frobnicate"


def test_max_tokens_beyond_the_context_is_a_400(http):
    r = _greedy(http, max_tokens=10 ** 9)
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == "max_tokens"
    assert "maximum context length is 256 tokens" in err["message"] and "1000000000 max_tokens" in err["message"]
    prompt = list(range(1, 201))
    assert _greedy(http, prompt=prompt, max_tokens=56).status_code == 200       # exactly the room left
    assert error_of(_greedy(http, prompt=prompt, max_tokens=57))["param"] == "max_tokens"


def test_token_id_lists_are_a_batch(http):
    both = _text(_greedy(http, prompt=[[1, 2, 3], [7, 8, 9, 10]]))
    assert both == _text(_greedy(http, prompt=[1, 2, 3])) + _text(_greedy(http, prompt=[7, 8, 9, 10]))
    assert error_of(_greedy(http, prompt=[[1, 2], [VOCAB]]))["param"] == "prompt"
    assert error_of(_greedy(http, prompt=[]))["param"] == "prompt"


def test_oversized_chunked_body_is_413(http):
    def body():                         # no Content-Length: httpx sends it chunked
        yield b'{"prompt": "'
        for _ in range(25):
            yield b"x" * 1000
        yield b'"}'

    r = http.post("/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"


def test_stalled_body_is_408_and_frees_the_connection(server, http):
    port = int(server[0].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert http.get("/health").json() == {"status": "ok"}


def test_second_server_on_a_busy_port_fails_before_loading(server):
    port = server[0].rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "runtime.serve", str(ROOT / "zoo" / "smollm2-135m.yaml"),
                           "--port", port], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "engine ready" not in proc.stderr + proc.stdout       # nothing was loaded
