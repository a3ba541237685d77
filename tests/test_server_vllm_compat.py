"""vLLM's own endpoints and fields that its entrypoint tests use (bench.conformance), on a real
server: /invocations routes a body to chat or completions with their exact answers;
/v1/chat/completions/batch answers each conversation exactly as /v1/chat/completions does
alone and refuses what vLLM refuses there with a 400 naming the field; --root-path serves
the routes under a prefix as well; --enable-per-request-metrics adds vLLM's timing object."""
from __future__ import annotations

import pytest

import json

from tests.serving import error_of, tiny_chat_client


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_chat_client(tmp_path_factory.mktemp("vllm-compat"), "--enable-per-request-metrics") as served:
        yield served


CONVS = [[{"role": "user", "content": "Reply with exactly the word: alpha"}],
         [{"role": "user", "content": "Say beta"}, {"role": "assistant", "content": "beta"},
          {"role": "user", "content": "again"}]]


def test_chat_batch_matches_single_calls(served):
    http, _ = served
    common = {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    r = http.post("/v1/chat/completions/batch", json={"messages": CONVS, **common})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    singles = [http.post("/v1/chat/completions", json={"messages": conv, **common}).json() for conv in CONVS]
    for choice, single in zip(body["choices"], singles):
        want = single["choices"][0]
        assert choice["message"] == want["message"] and choice["token_ids"] == want["token_ids"]
        assert choice["finish_reason"] == want["finish_reason"]
        assert [e["token"] for e in choice["logprobs"]["content"]] == [e["token"] for e in want["logprobs"]["content"]]
    assert body["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert body["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    spelled = http.post("/v1/chat/completions/batch", json={"messages": CONVS[:1], **common,
                                                            "return_tokens_as_token_ids": True}).json()
    ids = singles[0]["choices"][0]["token_ids"]
    assert [e["token"] for e in spelled["choices"][0]["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]


@pytest.mark.parametrize("extra,param", [({"stream": True}, "stream"), ({"n": 2}, "n"),
                                         ({"use_beam_search": True}, "use_beam_search"),
                                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                                         ({"prompt_logprobs": 1}, "prompt_logprobs")])
def test_chat_batch_refusals(served, extra, param):
    http, _ = served
    r = http.post("/v1/chat/completions/batch", json={"messages": CONVS, "max_tokens": 2, **extra})
    assert r.status_code == 400 and error_of(r)["param"] == param, r.text
    r = http.post("/v1/chat/completions/batch", json={"messages": [], "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "messages", r.text
    r = http.post("/v1/chat/completions/batch", json={"messages": [CONVS[0], []], "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "messages", r.text


def test_invocations_is_chat_or_completions(served):
    http, _ = served
    chat = {"messages": CONVS[0], "max_tokens": 5, "temperature": 0, "logprobs": True}
    want, got = (http.post(route, json=chat).json() for route in ("/v1/chat/completions", "/invocations"))
    assert got["object"] == "chat.completion" and got["choices"] == want["choices"] and set(got) == set(want)
    completion = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    want, got = (http.post(route, json=completion).json() for route in ("/v1/completions", "/invocations"))
    assert got["object"] == "text_completion" and got["choices"] == want["choices"]
    r = http.post("/invocations", json={"input": "hi"})
    assert r.status_code == 400 and error_of(r)["param"] == "body", r.text
    r = http.post("/invocations", json={"prompt": "hi", "max_tokens": "many"})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens", r.text


def test_root_path_serves_both_paths():
    """--root-path (runtime.http_guards.RootPath): /llm/v1/x and /v1/x reach the same route,
    the API key check still applies under the prefix, other paths stay 404."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from runtime.http_guards import ApiKeyAuth, RootPath
    app = FastAPI()
    app.get("/v1/models")(lambda: {"ok": True})
    app.add_middleware(ApiKeyAuth, api_key="k")
    app.add_middleware(RootPath, root_path="/llm/")
    client = TestClient(app)
    for path in ("/v1/models", "/llm/v1/models"):
        assert client.get(path, headers={"Authorization": "Bearer k"}).json() == {"ok": True}
        assert client.get(path, headers={"Authorization": "Bearer x"}).status_code == 401
    assert client.get("/llmx/v1/models", headers={"Authorization": "Bearer k"}).status_code == 404


def test_server_wide_flags_set_the_request_fields():
    """--enable-force-include-usage and --return-tokens-as-token-ids act as the per-request
    fields (whose behaviour test_server_api_fields checks): usage on every chunk of a stream
    only, token_id spelling for every request."""
    from types import SimpleNamespace

    from runtime.openai_protocol import CompletionRequest
    from runtime.openai_server import OpenAIServer
    on = SimpleNamespace(force_include_usage=True, tokens_as_ids=True)
    stream, plain = CompletionRequest(prompt="x", stream=True), CompletionRequest(prompt="x")
    for body in (stream, plain):
        OpenAIServer.apply_server_flags(on, body)
        assert body.return_tokens_as_token_ids is True
    assert stream.stream_options.include_usage and stream.stream_options.continuous_usage_stats
    assert plain.stream_options is None
    plain.check()                        # stream_options stays refused without stream: not set here
    off = CompletionRequest(prompt="x", stream=True)
    OpenAIServer.apply_server_flags(SimpleNamespace(force_include_usage=False, tokens_as_ids=False), off)
    assert off.stream_options is None and off.return_tokens_as_token_ids is False


def test_per_request_metrics(served):
    """vLLM's `metrics`: on a non-streaming answer (mean_itl_ms only past one token) and on a
    stream's usage chunk alone; the timings are consistent with each other."""
    http, _ = served
    timed = {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "tokens_per_second"}
    for route, body in (("/v1/chat/completions", {"messages": CONVS[0]}), ("/v1/completions", {"prompt": "Hi"})):
        r = http.post(route, json={**body, "max_tokens": 4, "min_tokens": 4, "temperature": 0}).json()
        m = r["metrics"]
        assert set(m) == timed | {"mean_itl_ms"} and all(v >= 0 for v in m.values()), m
        assert m["mean_itl_ms"] * 3 == pytest.approx(m["generation_time_ms"])
        total_s = (m["time_to_first_token_ms"] + m["generation_time_ms"]) / 1000
        assert m["tokens_per_second"] == pytest.approx(4 / total_s, rel=1e-6)
        one = http.post(route, json={**body, "max_tokens": 1, "temperature": 0}).json()["metrics"]
        assert set(one) == timed
    r = http.post("/v1/chat/completions", json={"messages": CONVS[0], "max_tokens": 3, "temperature": 0, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [("metrics" in e) for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["choices"] == [] and set(events[-1]["metrics"]) >= timed


def test_truncate_prompt_tokens(served):
    """vLLM's truncate_prompt_tokens keeps the last k prompt tokens (or the first, with
    truncation_side "right"), of token and text prompts alike; -1 is max_model_len; < -1 a 400."""
    http, tok = served
    ids = list(range(100, 108))
    body = {"max_tokens": 1, "temperature": 0, "return_token_ids": True, "truncate_prompt_tokens": 4}

    def prompt_ids(**extra):
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["prompt_token_ids"]
    assert prompt_ids(prompt=ids) == ids[-4:]
    assert prompt_ids(prompt=ids, truncation_side="right") == ids[:4]
    assert prompt_ids(prompt=ids, truncation_side="left") == ids[-4:]
    assert prompt_ids(prompt=ids, truncate_prompt_tokens=-1) == ids
    text = "one two three four five six seven"
    assert prompt_ids(prompt=text) == tok.encode(text)[-4:]
    r = http.post("/v1/completions", json={**body, "prompt": ids, "truncate_prompt_tokens": -2})
    assert r.status_code == 400 and error_of(r)["param"] == "truncate_prompt_tokens", r.text


def test_completion_top_logprobs_lead_with_the_sampled_token(served):
    """Completions' top_logprobs as vLLM's: the sampled token first, then the k best, so
    logprobs=0 still names the sampled token; continuous usage needs include_usage."""
    http, _ = served
    for k in (0, 3):
        r = http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 4, "temperature": 0.9, "seed": 3,
                                               "logprobs": k}).json()["choices"][0]["logprobs"]
        for token, top, lp in zip(r["tokens"], r["top_logprobs"], r["token_logprobs"]):
            assert next(iter(top)) == token and top[token] == lp and len(top) in (max(k, 1), k + 1)
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}})
    assert all("usage" not in json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {"))


def test_custom_role_reaches_the_template(served):
    """A role outside OpenAI's goes to the chat template as written (vLLM's behaviour): the
    prompt is the template's rendering of it, string and text-part content alike."""
    http, tok = served
    outs = []
    for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]):
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "my-custom-role", "content": content}],
                                                     "max_tokens": 4, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        outs.append(r.json())
    want = tok.apply_chat_template([{"role": "my-custom-role", "content": "what is 1+1?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert outs[0]["prompt_token_ids"] == tok.encode(want, add_special_tokens=False) == outs[1]["prompt_token_ids"]
    assert outs[0]["choices"][0]["message"] == outs[1]["choices"][0]["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": " ", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0].role", r.text


def test_logprob_token_ids(served):
    """vLLM's logprob_token_ids: each position reports the sampled token and exactly those
    ids, with the logprobs the model gives them (the same values a full top-k reports), in
    completions (streaming too) and chat; a batch mixing rows with and without it keeps
    each row's own; an id outside the vocabulary or without logprobs is a 400."""
    http, _ = served
    common = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
              "return_tokens_as_token_ids": True}
    full = http.post("/v1/completions", json={**common, "logprobs": 20}).json()["choices"][0]["logprobs"]
    pick = [int(t.removeprefix("token_id:")) for t in list(full["top_logprobs"][0])[5:8]]
    r = http.post("/v1/completions", json={**common, "logprobs": 5, "logprob_token_ids": pick}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == full["tokens"]
    first = lp["top_logprobs"][0]
    assert set(first) == {lp["tokens"][0], *(f"token_id:{t}" for t in pick)}
    for key, value in first.items():
        assert value == pytest.approx(full["top_logprobs"][0][key], abs=1e-5)
    streamed = http.post("/v1/completions", json={**common, "logprobs": 1, "logprob_token_ids": pick, "stream": True})
    tops = [t for line in streamed.text.splitlines() if line.startswith("data: {")
            for t in (json.loads(line[6:])["choices"][0]["logprobs"] or {}).get("top_logprobs") or []]
    assert len(tops) == 3 and all(set(t) == {tok, *(f"token_id:{i}" for i in pick)} for t, tok in zip(tops, lp["tokens"]))
    chat = http.post("/v1/chat/completions", json={"messages": CONVS[0], "max_tokens": 2, "temperature": 0,
                                                   "logprobs": True, "logprob_token_ids": [100, 1000],
                                                   "return_tokens_as_token_ids": True}).json()
    for e in chat["choices"][0]["logprobs"]["content"]:
        assert {t["token"] for t in e["top_logprobs"]} == {e["token"], "token_id:100", "token_id:1000"}
    mixed = http.post("/v1/completions", json={**common, "prompt": ["A", "B"], "logprobs": 2}).json()
    assert all(len(c["logprobs"]["top_logprobs"][0]) in (2, 3) for c in mixed["choices"])
    for extra, param in (({"logprobs": 1, "logprob_token_ids": [10 ** 9]}, "logprob_token_ids"),
                         ({"logprob_token_ids": [5]}, "logprob_token_ids")):
        r = http.post("/v1/completions", json={**common, **extra})
        assert r.status_code == 400 and error_of(r)["param"] == param, r.text


@pytest.mark.parametrize("so", [{"regex": {"1": "Python", "2": "C++"}}, {"grammar": ["a"]}, {"json": 5}])
def test_structured_outputs_of_the_wrong_type_are_400(served, so):
    http, _ = served
    r = http.post("/v1/chat/completions", json={"messages": CONVS[0], "max_tokens": 2, "structured_outputs": so})
    assert r.status_code == 400 and error_of(r)["param"] == "structured_outputs", r.text
