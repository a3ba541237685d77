"""vLLM's request and response extras on a real server: echo, return_token_ids, cached
tokens in usage, the chat-template controls and X-Request-Id."""
from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from tests.serving import error_of, metric, tiny_chat_client, tiny_chat_spec, wait_idle

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_chat_client(tmp_path_factory.mktemp("fields")) as served:
        yield served


def _post(http, route, body):
    r = http.post(f"/v1/{route}", content=json.dumps(body), headers={"Content-Type": "application/json"})
    return r


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_echo_and_token_ids(served):
    http, tok = served
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = _post(http, "completions", body).json()["choices"][0]
    echoed = _post(http, "completions", {**body, "echo": True, "return_token_ids": True}).json()["choices"][0]
    assert echoed["text"] == "Once upon a time" + plain["text"]
    assert echoed["prompt_token_ids"] == tok.encode("Once upon a time") and len(echoed["token_ids"]) == 6
    assert tok.decode(echoed["token_ids"]) == plain["text"] and plain["token_ids"] is None
    stream = _post(http, "completions", {**body, "echo": True, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in _events(stream) if e["choices"]) == echoed["text"]
    chat = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = _post(http, "chat/completions", chat).json()
    events = _events(_post(http, "chat/completions", {**chat, "stream": True}))
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]             # first chunk only (vLLM)
    assert not any("prompt_token_ids" in e for e in events[1:])
    assert [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids", [])] == \
        whole["choices"][0]["token_ids"]
    ids = _post(http, "completions", {**body, "prompt": [5, 6, 7], "echo": True}).json()["choices"][0]
    assert ids["text"].startswith(tok.decode([5, 6, 7]))


def test_beam_search_client_disconnect_frees_every_beam(served):
    """A client that drops a use_beam_search call stops the search mid-way: fewer forks than
    the whole search makes, and afterwards nothing runs and every block is free."""
    http, _ = served
    base = str(http.base_url).rstrip("/")
    body = {"prompt": "Once upon a time", "use_beam_search": True, "n": 8, "max_tokens": 200, "ignore_eos": True}
    forks = metric(httpx.get(base + "/metrics").text, "zooinfer_num_forks")
    assert len(_post(http, "completions", body).json()["choices"]) == 8
    whole = metric(httpx.get(base + "/metrics").text, "zooinfer_num_forks") - forks
    # The same call on a raw socket, dropped once the search has forked (mid-search, whatever the load).
    payload = json.dumps(body).encode()
    sock = socket.create_connection((http.base_url.host, http.base_url.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    deadline = time.monotonic() + 60
    while metric(httpx.get(base + "/metrics").text, "zooinfer_num_forks") - forks - whole < 8:
        assert time.monotonic() < deadline, "the search never forked"
        time.sleep(0.05)
    sock.close()
    text = wait_idle(base)
    assert metric(text, "zooinfer_num_requests_running") == metric(text, "zooinfer_num_requests_waiting") == 0
    assert metric(text, "zooinfer_kv_cache_free_blocks") == metric(text, "zooinfer_kv_cache_blocks")
    dropped = metric(text, "zooinfer_num_forks") - forks - whole
    assert 0 < dropped < whole / 2, (dropped, whole)


def test_chat_logprob_bytes_are_the_tokens_bytes(served):
    """Tokens that split a character: `bytes` are the token's own (not U+FFFD's), top_logprobs too."""
    from runtime.token_bytes import TokenBytes
    http, tok = served
    allowed = tok.encode("日本😀", add_special_tokens=False)
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "allowed_token_ids": allowed, "return_tokens_as_token_ids": True}
    content = _post(http, "chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    spell = TokenBytes(tok)
    entries = [e for c in content for e in (c, *c["top_logprobs"])]
    assert len(content) == 8 and all(e["bytes"] == list(spell(int(e["token"][9:]))) for e in entries)
    assert any("\ufffd" in tok.decode([int(e["token"][9:])]) and "\ufffd".encode() not in bytes(e["bytes"])
               for e in content)
    assert {int(e["token"][9:]) for e in content} <= set(allowed)


def test_prompt_logprobs_and_echo_with_logprobs(served):
    """vLLM's shapes: `prompt_logprobs` per choice (completions) or per response (chat), the
    first prompt token null; `echo` + `logprobs` puts the prompt's tokens and logprobs first."""
    http, tok = served
    prompt = "Once upon a time there was"
    ids = tok.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    plain = _post(http, "completions", body).json()["choices"][0]
    asked = _post(http, "completions", {**body, "prompt_logprobs": 1, "n": 2}).json()["choices"]
    pl = asked[0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None and asked[1]["prompt_logprobs"] == pl
    assert all(str(t) in d and 1 <= len(d) <= 2 for t, d in zip(ids[1:], pl[1:]))
    assert plain["prompt_logprobs"] is None
    echoed = _post(http, "completions", {**body, "echo": True}).json()["choices"][0]
    lp = echoed["logprobs"]
    n = len(ids)
    assert echoed["text"] == prompt + plain["text"]
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"] and lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == [pl[j][str(ids[j])]["logprob"] for j in range(1, n)]
    assert lp["text_offset"][:n] == [len(tok.decode(ids[:j])) for j in range(n)]
    assert "".join(lp["tokens"]) == echoed["text"]
    stream = _post(http, "completions", {**body, "echo": True, "stream": True})
    parts = [e["choices"][0]["logprobs"] for e in _events(stream) if e["choices"] and e["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == lp[key]
    chat = _post(http, "chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(d) == 1 for d in chat["prompt_logprobs"][1:])


def test_cached_tokens_in_usage(served):
    http, _ = served
    prompt = "The quick brown fox jumps over the lazy dog. " * 8           # > 4 blocks
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = _post(http, "completions", body).json()["usage"]
    again = _post(http, "completions", body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached == (again["prompt_tokens"] - 1) // 16 * 16 and cached >= 64


def test_chat_template_controls(served):
    http, tok = served
    prefill = CHAT + [{"role": "assistant", "content": "General"}]
    body = {"messages": prefill, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True}
    r = _post(http, "chat/completions", body)
    assert r.status_code == 200, r.text
    text = tok.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert r.json()["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    custom = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{{ suffix }}"
    r = _post(http, "chat/completions", {"messages": CHAT, "max_tokens": 2, "chat_template": custom,
                                         "chat_template_kwargs": {"suffix": "!!"}, "return_token_ids": True})
    assert r.json()["prompt_token_ids"] == tok.encode("<<Hello there>>!!", add_special_tokens=False)
    for bad in ({"continue_final_message": True}, {"chat_template_kwargs": {"tokenize": True}}):
        r = _post(http, "chat/completions", {"messages": CHAT, "max_tokens": 2, **bad})
        assert r.status_code == 400 and error_of(r)["param"] in ("continue_final_message", "chat_template_kwargs")


def test_request_id_header(served):
    http, _ = served
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    fresh = http.get("/health").headers["x-request-id"]
    assert len(fresh) == 32 and fresh != http.get("/health").headers["x-request-id"]


def test_structured_outputs_over_http(served):
    """The official client's response_format, and vLLM's structured_outputs / guided_* fields,
    streaming included; compiled grammars are cached per schema."""
    import openai
    import jsonschema
    http, _ = served
    client = openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny-chat", messages=CHAT, response_format=fmt, max_tokens=60,
                                           seed=seed, temperature=1.0)
        c = r.choices[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), schema)
    stream = client.chat.completions.create(model="tiny-chat", messages=CHAT, response_format=fmt, max_tokens=60,
                                            seed=0, temperature=1.0, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    whole = client.chat.completions.create(model="tiny-chat", messages=CHAT, response_format=fmt, max_tokens=60,
                                           seed=0, temperature=1.0).choices[0].message.content
    assert streamed == whole
    pick = client.completions.create(model="tiny-chat", prompt="Pick:", max_tokens=8, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert pick.choices[0].text in ("left", "right")
    code = client.completions.create(model="tiny-chat", prompt="Code:", max_tokens=12, temperature=1.0, seed=2,
                                     extra_body={"guided_regex": "[A-Z]{3}[0-9]{2}"})
    assert re.fullmatch("[A-Z]{3}[0-9]{2}", code.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=2, extra_body={"guided_regex": "(["})


def test_logprob_details_and_continuous_usage(served):
    http, tok = served
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    lp = _post(http, "completions", body).json()["choices"][0]["logprobs"]
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))] and lp["text_offset"][0] == 0
    as_ids = _post(http, "completions", {**body, "return_tokens_as_token_ids": True, "return_token_ids": True}).json()
    ids = as_ids["choices"][0]["token_ids"]
    assert as_ids["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for d in as_ids["choices"][0]["logprobs"]["top_logprobs"] for k in d)
    chat = _post(http, "chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True,
                                            "top_logprobs": 1, "return_tokens_as_token_ids": True}).json()
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])
    stream = _post(http, "completions", {**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    chunks = [e for e in _events(stream) if e["choices"]]
    # A slow reader may get several steps' tokens in one chunk (outputs are merged, as vLLM's
    # collector does): each chunk's usage is the tokens streamed so far, ending at 6.
    per_chunk = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [sum(per_chunk[:k + 1]) for k in range(len(chunks))]
    assert min(per_chunk) >= 1 and sum(per_chunk) == 6
    streamed = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == lp["text_offset"]
    chat = _post(http, "chat/completions", {"messages": CHAT, "max_tokens": 3, "ignore_eos": True, "stream": True,
                                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    used = [e["usage"]["completion_tokens"] for e in _events(chat) if e["choices"]]
    assert used[0] == 0 and used[-1] == 3        # the role chunk has usage too (vLLM)


def test_beam_search_over_http(served):
    """use_beam_search: the n choices are the engine's n best beams, as LLM.beam_search gives."""
    http, tok = served
    from runtime import LLM
    from runtime.beam_search import BeamSearchParams
    r = _post(http, "completions", {"prompt": "Once upon a time", "n": 3, "use_beam_search": True, "max_tokens": 6,
                                    "length_penalty": 0.5})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    spec = tiny_chat_spec(__import__("pathlib").Path(__import__("tempfile").mkdtemp()))
    ref = LLM(spec).beam_search("Once upon a time", BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    assert texts == [s.text for s in ref[0].sequences] and len(set(texts)) == 3
    chat = _post(http, "chat/completions", {"messages": CHAT, "n": 2, "use_beam_search": True, "max_tokens": 4})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2
    for bad, param in (({"stream": True}, "stream"), ({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"),
                       ({"n": 11}, "n")):
        r = _post(http, "completions", {"prompt": "hi", "use_beam_search": True, "max_tokens": 3, **bad})
        assert r.status_code == 400 and error_of(r)["param"] == param, r.text
