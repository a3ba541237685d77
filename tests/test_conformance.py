"""bench.conformance on a fake vLLM checkout: the fixture substitution starts our server under
the test's model name, vLLM's get_tokenizer gives the served tokenizer, a flag we cannot honour
skips the test naming it, a LoRA server runs without its adapters and only the tests naming
one are skipped, a test reaching no server is skipped as in-process, a file importing vLLM
internals (without vLLM installed) is not applicable, and the junit results parse into the
right pass / fail / skip lists with the failure's reason."""
from __future__ import annotations

import sys

from bench.conformance import report, run_file, server_files
from bench.conformance_skips import NEEDS_CAPABLE_MODEL
from tests.serving import tiny_chat_spec

FAKE = '''
import pytest
from ...utils import RemoteOpenAIServer
from vllm.tokenizers import get_tokenizer

MODEL = "org/fake-model"


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer(MODEL, ["--max-model-len", "256", "--enforce-eager", "--seed", "0"]) as s:
        yield s


def test_models(server):
    assert [m.id for m in server.get_client().models.list().data] == [MODEL]


def test_tokens(server):
    out = server.get_client().completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                                 extra_body={"return_token_ids": True})
    assert out.choices[0].prompt_token_ids == get_tokenizer(tokenizer_name=MODEL).encode("Hello")


def test_wrong(server):
    text = server.get_client().completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].text
    assert text == "never this"


def test_reasoning():
    RemoteOpenAIServer(MODEL, ["--reasoning-parser", "qwen3"])


@pytest.mark.parametrize("model", [MODEL, "my-lora"])
def test_lora(lora_server, model):
    assert lora_server.get_client().models.list().data[0].id == MODEL


@pytest.fixture(scope="module")
def lora_server():
    with RemoteOpenAIServer(MODEL, ["--enable-lora", "--lora-modules", "my-lora=/x", "--max-lora-rank", "8"]) as s:
        yield s


def test_in_process():
    assert False, "never run: it reaches no server"
'''
INTERNAL = '''
from vllm.config import ModelConfig
from ...utils import RemoteOpenAIServer


def test_x():
    pass
'''


# A test at the path of one listed in NEEDS_CAPABLE_MODEL: skipped before its server starts.
CAPABLE = '''
import pytest
from tests.utils import RemoteOpenAIServer


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer("m", []) as s:
        yield s


def test_complex_message_content(server):
    assert False, "never run: listed as needing a capable model"
'''


def test_runner_on_a_fake_checkout(tmp_path):
    checkout = tmp_path / "vllm"
    suite = checkout / "tests" / "entrypoints" / "openai"
    suite.mkdir(parents=True)
    for d in (checkout / "tests", checkout / "tests" / "entrypoints", suite):
        (d / "__init__.py").write_text("")
    (checkout / "tests" / "conftest.py").write_text("import vllm.engine  # vLLM's own: must stay unloaded\n")
    (suite / "test_fake.py").write_text(FAKE)
    (suite / "test_internal.py").write_text(INTERNAL)
    (suite / "test_no_server.py").write_text("def test_y():\n    pass\n")
    assert [p.name for p in server_files(checkout)] == ["test_fake.py", "test_internal.py"]
    spec = str(tiny_chat_spec(tmp_path))
    fake = run_file(sys.executable, checkout, suite / "test_fake.py", spec, tmp_path, timeout=600)
    assert sorted(fake.passed) == ["test_lora[org/fake-model]", "test_models", "test_tokens"]
    assert fake.not_applicable is None
    assert [name for name, _ in fake.failed] == ["test_wrong"] and "never this" in fake.failed[0][1]
    assert sorted(fake.skipped) == [
        ("test_in_process", "not applicable: in-process test of vLLM's Python objects (no server)"),
        ("test_lora[my-lora]", "not applicable: LoRA adapter 'my-lora'"),
        ("test_reasoning", "not applicable: reasoning models (vLLM reasoning parsers) (--reasoning-parser)")]
    internal = run_file(sys.executable, checkout, suite / "test_internal.py", spec, tmp_path, timeout=600)
    assert internal.not_applicable == "imports vllm.config (vLLM internals)" and not internal.passed
    (suite / "chat_completion").mkdir()
    (suite / "chat_completion" / "__init__.py").write_text("")
    (suite / "chat_completion" / "test_chat.py").write_text(CAPABLE)
    capable = run_file(sys.executable, checkout, suite / "chat_completion" / "test_chat.py", spec, tmp_path, timeout=600)
    assert not capable.passed and not capable.failed
    assert capable.skipped == [("test_complex_message_content",
                                "not applicable: needs a capable model: " + NEEDS_CAPABLE_MODEL[
                                    "chat_completion/test_chat.py::test_complex_message_content"])]
    text = report([fake, internal])
    assert "applicable 4: passed 3, failed 1 (75.0% pass); skipped 3; files not applicable 1" in text
