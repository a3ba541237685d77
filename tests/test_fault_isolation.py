"""A failure that belongs to one request fails that request alone: its blocks are freed,
its caller gets the error, and the engine goes on serving everyone else unchanged."""
from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

import runtime.engine as engine_module
from runtime import LLM, SamplingParams
from runtime.async_engine import AsyncEngine, RequestFailedError
from runtime.serve import build_app
from tests.serving import tiny_chat_spec

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(tiny_chat_spec(tmp_path_factory.mktemp("fault")), max_model_len=128)


def _clean(engine) -> None:
    s = engine.kv_cache_stats()
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == s["num_waiting"] == 0
    assert not engine.scheduler.requests and not engine._detok


def _reference(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


class Broken:
    """A detokenizer that raises on its n-th token (a bug, or a tokenizer that cannot
    decode what the model produced); otherwise the real one."""

    def __init__(self, detok, n: int):
        self.detok, self.n, self.calls = detok, n, 0

    def update(self, token_id):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("cannot decode this")
        return self.detok.update(token_id)

    def __getattr__(self, name):
        return getattr(self.detok, name)


def test_a_failing_request_is_finished_alone(llm):
    ref = _reference(llm)
    engine = llm.engine
    ids = []
    for i, p in enumerate(PROMPTS):
        ids += engine.add_request(engine.make_request(p, PARAMS, f"r{i}"), stream_text=True)
    engine._detok["r1"] = Broken(engine._detok["r1"], 3)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["r1"].outputs[0].finish_reason == "error"
    assert final["r1"].error == "RuntimeError: cannot decode this"
    assert len(final["r1"].outputs[0].token_ids) == 3
    assert [final[f"r{i}"].outputs[0].token_ids for i in (0, 2)] == [ref[0], ref[2]]
    assert final["r0"].error is None and final["r0"].outputs[0].finish_reason == "length"
    engine.step()     # the runner drops the finished rows
    _clean(engine)
    assert _reference(llm) == ref


def test_admission_failure_leaves_nothing_behind(llm, monkeypatch):
    """The detokenizer is built before the scheduler sees the request: failing there
    schedules nothing."""
    engine = llm.engine

    def explode(*a, **k):
        raise MemoryError("no room for a detokenizer")

    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", explode)
    req = engine.make_request(PROMPTS[0], PARAMS)
    with pytest.raises(MemoryError):
        engine.add_request(req, stream_text=True)
    _clean(engine)


def test_async_engine_and_server_keep_serving(llm, monkeypatch):
    engine = llm.engine
    ref = _reference(llm)
    real_tokenize = engine.tokenize

    def tokenize(prompt, tokenizer=None):        # a tokenizer bug that only this prompt hits
        if isinstance(prompt, dict) and prompt.get("prompt") == "boom":
            raise KeyError("tokenizer bug")
        return real_tokenize(prompt, tokenizer)

    monkeypatch.setattr(engine, "tokenize", tokenize)
    tail = real_tokenize(PROMPTS[1])[1][-5:]

    class Flaky(engine_module.IncrementalDetokenizer):   # fails on PROMPTS[1]'s third token
        def update(self, token_id):
            if self.ids[:5] == tail and len(self.ids) == 7:
                raise RuntimeError("cannot decode this")
            return super().update(token_id)

    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", Flaky)
    ae = AsyncEngine(engine)
    ae.start()
    try:
        with TestClient(build_app(ae, "m")) as http:
            body = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
            r = http.post("/v1/completions", json={**body, "prompt": "boom"})
            assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
            assert "KeyError" in r.json()["error"]["message"]
            r = http.post("/v1/completions", json={**body, "prompt": PROMPTS[1]})
            assert r.status_code == 500 and "cannot decode this" in r.json()["error"]["message"]
            with http.stream("POST", "/v1/completions", json={**body, "prompt": PROMPTS[1], "stream": True}) as s:
                events = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert '"request_failed"' in events[-2] and events[-1] == "data: [DONE]"
            assert http.get("/health").json() == {"status": "ok"}
            tok = llm.get_tokenizer()
            for prompt, ids in zip(PROMPTS[::2], ref[::2]):
                r = http.post("/v1/completions", json={**body, "prompt": prompt})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(ids)

            async def direct():
                with pytest.raises(RequestFailedError, match="could not be admitted: KeyError"):
                    await ae.add_request({"prompt": "boom"}, PARAMS, "x")

            asyncio.run(direct())
            assert ae.healthy and http.get("/health").json() == {"status": "ok"}
    finally:
        ae.shutdown()
    engine.step()
    _clean(engine)


@pytest.mark.parametrize("prompt, params, message", [
    ("a\ud800b", PARAMS, "prompt: contains a lone UTF-16 surrogate ('\\ud800') at character 1"),
    ({"prompt_token_ids": [1, 2], "cache_salt": "\udfff"}, PARAMS, "cache_salt: contains a lone UTF-16 surrogate"),
    ("hi", SamplingParams(stop_token_ids=[49152]), "stop_token_ids: token id 49152 is not in the vocabulary"),
])
def test_llm_refuses_what_the_engine_cannot_hold(llm, prompt, params, message):
    with pytest.raises(ValueError) as e:
        llm.generate([PROMPTS[0], prompt], params, use_tqdm=False)
    assert message in str(e.value)
    _clean(llm.engine)
