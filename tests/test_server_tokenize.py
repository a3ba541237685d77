"""The tokenizer routes on a real server (vLLM's shapes): /tokenize of text and of chat
messages, /detokenize back, /tokenizer_info, /version and /v1/models/{id}; bad input is a
400 naming the field."""
from __future__ import annotations

import httpx
import pytest

from tests.serving import error_of, tiny_chat_client, tiny_chat_spec

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_chat_client(tmp_path_factory.mktemp("tokenize")) as served:
        yield served


def test_tokenize_and_back(served):
    http, tok = served
    text = "The capital of France is Paris."
    r = http.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256 and body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) and bare["token_strs"] is None


def test_tokenize_chat_matches_the_template(served):
    http, tok = served
    want = tok.encode(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)
    got = http.post("/tokenize", json={"messages": CHAT}).json()
    assert got["tokens"] == want
    prefill = CHAT + [{"role": "assistant", "content": "General"}]
    cont = http.post("/tokenize", json={"messages": prefill, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()
    text = tok.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert cont["tokens"] == tok.encode(text, add_special_tokens=False) and text.endswith("General")


def test_info_version_and_model(served):
    http, tok = served
    info = http.get("/tokenizer_info").json()
    assert info["vocab_size"] == len(tok) and info["eos_token"] == tok.eos_token and info["chat_template"]
    assert http.get("/version").json()["version"]
    card = http.get("/v1/models/tiny-chat")
    assert card.status_code == 200 and card.json()["id"] == "tiny-chat"
    missing = http.get("/v1/models/gpt-17")
    assert missing.status_code == 404 and error_of(missing)["param"] == "model"


@pytest.mark.parametrize("route, body, param", [
    ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-17"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(served, route, body, param):
    import json
    http, _ = served
    r = http.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 404), r.text
    assert param in (error_of(r)["param"] or "") or param in error_of(r)["message"], r.text
