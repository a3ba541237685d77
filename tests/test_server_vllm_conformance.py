"""What vLLM's entrypoint tests (bench.conformance) showed missing, on a real server:
chat `echo` (the continued assistant message ahead of the reply, streamed or not), extra keys
inside messages reaching the chat template (a top-level unknown field stays a 400), whole-
vocabulary logprobs (-1) for chat, completions and prompt logprobs under --max-logprobs,
with the entry cap refused naming the field, and vLLM's error wording for out-of-int64 seeds
and several bad logit_bias keys."""
from __future__ import annotations

import json
import math

import pytest

from runtime import vocab_logprobs
from runtime.limits import ParamError
from runtime.sampling_params import SamplingParams
from tests.serving import error_of, tiny_chat_client

VOCAB = 49152           # SmolLM2's vocabulary (the tiny spec keeps its tokenizer)
SAYING = "Here is a common saying about apple. An apple a day, keeps"
CONTINUE = {"messages": [{"role": "user", "content": "tell me a common saying"},
                         {"role": "assistant", "content": SAYING}],
            "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_chat_client(tmp_path_factory.mktemp("conformance"), "--max-logprobs", str(VOCAB)) as served:
        yield served


def _post(http, route: str, body: dict):
    return http.post(f"/v1/{route}", content=json.dumps(body), headers={"Content-Type": "application/json"})


def _stream_text(r) -> list[str]:
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]


def test_chat_echo_puts_the_continued_message_first(served):
    http, _ = served
    plain = _post(http, "chat/completions", CONTINUE).json()["choices"][0]["message"]["content"]
    assert plain and SAYING not in plain
    echoed = _post(http, "chat/completions", {**CONTINUE, "echo": True, "n": 2, "seed": 1}).json()
    assert [c["message"]["content"] for c in echoed["choices"]] == [SAYING + plain] * 2   # greedy: both equal
    deltas = _stream_text(_post(http, "chat/completions", {**CONTINUE, "echo": True, "stream": True}))
    assert deltas[:2] == ["", SAYING] and "".join(deltas) == SAYING + plain     # role chunk, then the echo
    # The last message is the user's: there is nothing to echo.
    ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert _post(http, "chat/completions", {**ask, "echo": True}).json()["choices"][0]["message"] == \
        _post(http, "chat/completions", ask).json()["choices"][0]["message"]


def test_extra_message_keys_reach_the_template_and_unknown_fields_do_not(served):
    http, tok = served
    template = "{% for m in messages %}{{ m.mood }}|{{ m.reasoning_content }}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "x", "mood": "happy", "reasoning_content": "because"}],
            "chat_template": template, "max_tokens": 1, "return_token_ids": True, "add_generation_prompt": False}
    r = _post(http, "chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == tok.encode("happy|because", add_special_tokens=False)
    r = _post(http, "chat/completions", {**body, "mood": "happy"})           # a top-level unknown field
    assert r.status_code == 400 and error_of(r)["param"] == "mood"
    assert error_of(r)["message"] == "unrecognized request argument supplied: mood"


def _check_whole_row(entries: list[dict], top5: list[dict]) -> None:
    """A whole-vocabulary row: every token once, best first, summing to probability 1, and
    its head the same tokens and values as a top-5 request's."""
    assert len(entries) == VOCAB
    values = [e["logprob"] for e in entries]
    assert values == sorted(values, reverse=True)
    assert math.isclose(sum(math.exp(v) for v in values), 1.0, rel_tol=1e-3)
    assert [e["token"] for e in entries[:5]] == [e["token"] for e in top5]
    assert all(math.isclose(a["logprob"], b["logprob"], abs_tol=1e-4) for a, b in zip(entries, top5))


def test_whole_vocabulary_logprobs(served):
    http, tok = served
    chat = {"messages": [{"role": "user", "content": "Beijing is the capital of"}], "max_tokens": 2,
            "temperature": 0, "ignore_eos": True, "logprobs": True}
    full = _post(http, "chat/completions", {**chat, "top_logprobs": -1}).json()["choices"][0]["logprobs"]["content"]
    five = _post(http, "chat/completions", {**chat, "top_logprobs": 5}).json()["choices"][0]["logprobs"]["content"]
    assert len(full) == len(five) == 2
    for f, t in zip(full, five):
        assert f["token"] == t["token"]
        _check_whole_row(f["top_logprobs"], t["top_logprobs"])
    # Completions: -1 is every token too (its dict is keyed by text, so same-text tokens merge).
    comp = {"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    row = _post(http, "completions", {**comp, "logprobs": -1}).json()["choices"][0]["logprobs"]["top_logprobs"][0]
    words = {tok.decode([t]) for t in range(VOCAB)}
    assert set(row) == words
    # Prompt logprobs: each prompt token (after the first) gets the whole row, ranks 1..V.
    prompt = tok.encode("Once upon a time")
    lp = _post(http, "completions", {**comp, "prompt_logprobs": -1}).json()["choices"][0]["prompt_logprobs"]
    one = _post(http, "completions", {**comp, "prompt_logprobs": 1}).json()["choices"][0]["prompt_logprobs"]
    assert lp[0] is None and len(lp) == len(prompt)
    for j in range(1, len(prompt)):
        assert len(lp[j]) == VOCAB and sorted(e["rank"] for e in lp[j].values()) == list(range(1, VOCAB + 1))
        t = str(prompt[j])
        assert lp[j][t]["rank"] == one[j][t]["rank"]
        assert math.isclose(lp[j][t]["logprob"], one[j][t]["logprob"], abs_tol=1e-4)


def test_whole_vocabulary_cap_is_a_400_naming_the_field(served):
    http, _ = served
    long_prompt = " ".join(["word"] * 60)         # 59 x 49152 prompt entries > 2^21
    r = _post(http, "completions", {"prompt": long_prompt, "max_tokens": 1, "prompt_logprobs": -1})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt_logprobs"
    assert str(vocab_logprobs.MAX_LOGPROB_ENTRIES) in error_of(r)["message"]
    r = _post(http, "completions", {"prompt": "hi", "max_tokens": 64, "logprobs": -1})
    assert r.status_code == 400 and error_of(r)["param"] == "logprobs"
    r = _post(http, "completions", {"prompt": "hi", "max_tokens": 1, "logprobs": -2})
    assert r.status_code == 400 and error_of(r)["param"] == "logprobs"


def test_max_logprobs_bounds_every_count():
    """Without a raised --max-logprobs (20, vLLM's default) -1 is refused naming the field;
    a count above the vocabulary is cut to it."""
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ParamError, match=rf"^{name}: -1 \(the whole vocabulary, 100 tokens\)") as e:
            vocab_logprobs.resolve(SamplingParams(**{name: -1}), 100, 20, 5, 4)
        assert e.value.param == name
        with pytest.raises(ParamError, match=rf"^{name}: 21 requested"):
            vocab_logprobs.resolve(SamplingParams(**{name: 21}), 100, 20, 5, 4)
    p = vocab_logprobs.resolve(SamplingParams(logprobs=500, prompt_logprobs=-1), 100, 1000, 5, 4)
    assert (p.logprobs, p.prompt_logprobs) == (100, 100)
    assert vocab_logprobs.resolve(SamplingParams(logprobs=3), 100, 20, 10 ** 6, 10 ** 6).logprobs == 3   # no cap <= 20


def test_vllm_error_wording(served):
    http, _ = served
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for seed, word in ((-(2 ** 63) - 1, "greater_than_equal"), (2 ** 63, "less_than_equal")):
        r = _post(http, "chat/completions", {**chat, "seed": seed})
        assert r.status_code == 400 and word in error_of(r)["message"] and error_of(r)["param"] == "seed"
    r = _post(http, "chat/completions", {**chat, "logit_bias": {"bad1": 5, "7": 1, "bad2": 2}})
    assert r.status_code == 400 and error_of(r)["param"] == "logit_bias"
    assert error_of(r)["message"] == "logit_bias: keys 'bad1', 'bad2' are not token ids"
