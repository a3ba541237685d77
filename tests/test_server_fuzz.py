"""Fuzzing a real server with generated request bodies: valid, boundary and hostile.

Whatever a client sends, the server answers below 500, every 4xx is in OpenAI's error shape,
/health stays 200, and afterwards nothing runs, every block is free and a greedy request
gives the text it gave before. CI runs a derandomized, bounded sample; a long run:

    ZOOINFER_FUZZ_EXAMPLES=5000 ZOOINFER_FUZZ_RANDOM=1 python -m pytest tests/test_server_fuzz.py -q
"""
from __future__ import annotations

import json
import os
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving import error_of, metric, running_server, tiny_chat_spec, wait_idle

EXAMPLES = int(os.environ.get("ZOOINFER_FUZZ_EXAMPLES", "250"))
RANDOM = os.environ.get("ZOOINFER_FUZZ_RANDOM") == "1"

# ---------------------------------------------------------------- value strategies
EDGE_INTS = [0, 1, -1, 2, 20, 21, 64, 65, 255, 256, 49151, 49152, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63,
             2 ** 64, -2 ** 63 - 1, 10 ** 30]
ints = st.sampled_from(EDGE_INTS) | st.integers(-5, 300)
floats = (st.floats(allow_nan=True, allow_infinity=True)
          | st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-300, 1e308, 100.0, 100.5]))
chars = st.characters() | st.characters(categories=["Cs"]) | st.sampled_from(["\x00", "\ufffd", "\U0001F600"])
texts = st.lists(chars, max_size=40).map("".join)   # st.text(chars) would drop the surrogates
scalars = st.none() | st.booleans() | ints | floats | texts
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
small_tokens = st.integers(1, 8)          # keeps valid requests quick


def field(valid):
    """Mostly plausible values for a field, sometimes anything at all."""
    return st.one_of(valid, valid, anything)


token_ids = st.lists(st.integers(0, 49151) | st.sampled_from([-1, 49152, 2 ** 63]), max_size=12)
prompts = st.one_of(texts, token_ids, st.lists(texts, max_size=3), st.lists(token_ids, max_size=3),
                    st.just(""), st.just([]), anything)
parts = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                  st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "file", "refusal"]),
                                         "image_url": anything}),
                  st.fixed_dictionaries({"text": texts}), anything)
messages = st.lists(st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "developer", "tool"])),
     "content": st.one_of(texts, st.lists(parts, max_size=3), st.none(), anything)},
    optional={"name": texts, "tool_calls": anything, "mood": anything}), max_size=4)

COMMON = {
    "model": st.sampled_from(["tiny-chat", None, "gpt-4o"]),
    "n": st.integers(1, 3) | st.sampled_from([0, 64, 65, 2 ** 63]),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2.0, -1, 100, 101]),
    "top_p": st.sampled_from([0, 0.1, 0.9, 1, 1.5]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 49152, 10 ** 6, 2 ** 63 - 1, 2 ** 63]),
    "min_p": st.sampled_from([0, 0.05, 1, 1.5]),
    "min_tokens": st.sampled_from([0, 1, 4, 9, 2 ** 63]),
    "seed": ints,
    "stop": texts | st.lists(texts, max_size=5),
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "presence_penalty": st.sampled_from([0, 0.5]),
    "logit_bias": st.dictionaries(st.integers(0, 100).map(str), st.integers(-100, 100), max_size=2),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "user": texts,
    "repetition_penalty": st.sampled_from([1, 1.2]),
}
COMPLETION = {**COMMON, "prompt": prompts, "logprobs": st.integers(0, 21), "echo": st.booleans(),
              "best_of": st.integers(0, 3), "suffix": texts, "add_special_tokens": st.booleans()}
CHAT = {**COMMON, "messages": messages, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 21),
        "max_completion_tokens": small_tokens, "tools": st.lists(anything, max_size=1),
        "tool_choice": st.sampled_from(["none", "auto", "required"])}


@st.composite
def requests(draw):
    """(route, body): a valid body of either route with a few fields added or replaced, by
    plausible values (valid or at a boundary) or, in a hostile body, by anything at all."""
    chat = draw(st.booleans())
    hostile = draw(st.booleans())
    table = CHAT if chat else COMPLETION
    body = ({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Once upon a time"})
    body["max_tokens"] = draw(small_tokens)
    for name in sorted(table):      # each field on its own coin (a list of names favours the first)
        if draw(st.integers(0, 9)) == 0:
            body[name] = draw(field(table[name]) if hostile else table[name])
    if hostile:
        body["max_tokens"] = draw(field(small_tokens | st.sampled_from([0, 256, 10 ** 9, 2 ** 63])))
        for key in draw(st.lists(texts, max_size=2)):      # unknown fields
            body.setdefault(key, draw(anything))
    return ("chat/completions" if chat else "completions"), body


# Bodies that are not (valid) JSON objects at all.
RAW = [b"", b"{", b"null", b"[]", b"42", b'"prompt"', b"\xff\xfe\x00", b'{"prompt": "\xc3\x28"}',
       b'{"prompt": "a\x00b", "max_tokens": 2}', b'{"prompt": "hi", "max_tokens": 1e999}',
       b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", b"[" * 100000 + b"]" * 100000,
       b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"prompt": "hi", "prompt": [1, 2], "max_tokens": 2}',
       b'{"messages": [{"role": "user", "content": [' + b'{"type": "text", "text": "a"},' * 500
       + b'{"type": "text", "text": "a"}]}], "max_tokens": 2}']


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = tiny_chat_spec(tmp_path_factory.mktemp("fuzz"))
    with running_server(spec, "--max-body-bytes", "2000000") as (proc, base):
        yield base
    log = proc.stdout.read()
    assert "Traceback" not in log, log


def _check(r: httpx.Response, stats: Counter) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    stats[r.status_code] += 1
    if r.status_code >= 400:
        error_of(r)
        return
    assert r.status_code == 200
    if not r.headers["content-type"].startswith("text/event-stream"):
        assert r.json()["choices"]
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text[-300:]
    for e in events[:-1]:
        assert "error" not in json.loads(e), e


def _greedy(http: httpx.Client) -> str:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Tell me a story"}],
                                                "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_fuzzed_bodies_never_hurt_the_server(server):
    stats: Counter = Counter()
    with httpx.Client(base_url=server, timeout=120) as http:
        before = _greedy(http)

        @settings(max_examples=EXAMPLES, derandomize=not RANDOM, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def one(request):
            route, body = request
            content = json.dumps(body).encode()     # NaN and lone surrogates as JSON allows them
            headers = {"Content-Type": "application/json"}
            _check(http.post(f"/v1/{route}", content=content, headers=headers), stats)

        one()
        for raw in RAW:
            for route in ("completions", "chat/completions"):
                _check(http.post(f"/v1/{route}", content=raw, headers={"Content-Type": "application/json"}),
                       stats)
        assert http.get("/health").json() == {"status": "ok"}
        text = wait_idle(server)
        assert metric(text, "zooinfer_num_requests_running") == 0
        assert metric(text, "zooinfer_num_requests_waiting") == 0
        assert metric(text, "zooinfer_kv_cache_free_blocks") == metric(text, "zooinfer_kv_cache_blocks")
        assert _greedy(http) == before
    # The sample reached the engine, not only the validators (and was refused often too).
    print(f"fuzz: {sum(stats.values())} bodies, status counts {dict(sorted(stats.items()))}")
    assert stats[200] >= EXAMPLES // 10 and sum(v for k, v in stats.items() if 400 <= k < 500) >= EXAMPLES // 3
