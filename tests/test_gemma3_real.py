"""The real Gemma-3-270M (embedded wheels): greedy parity with HF token for token, with one
prompt longer than the 512-token window, in every scheduling regime."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy
from tests.test_parity import NEW, _check_regime, gguf_agreement

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def add(a, b):\n    return",
    "Water boils at 100 degrees Celsius because",
    "1, 2, 3, 4, 5,",
    "The Amazon rainforest spans nine countries and " * 80 + "The Amazon rainforest is",   # > 512 tokens
    "Question: What is the largest planet in the Solar System?\nAnswer:",
    "A",
]
REGIMES = {"default": dict(), "chunked": dict(max_num_batched_tokens=100),   # chunks off block edges
           "preempt": dict(num_kv_blocks=290, max_model_len=1024, max_num_batched_tokens=128),
           "staggered": dict(max_num_batched_tokens=128)}


@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.embedded import ensure_embedded
    path = ensure_embedded("gemma3-270m")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 512 and min(len(p) for p in prompts) <= 3
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return prompts, hf_greedy(model, prompts, NEW)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_gemma3_270m_parity(gemma, regime):
    prompts, ref = gemma
    _check_regime("zoo/gemma3-270m.yaml", prompts, ref, regime, {"max_model_len": 1024, **REGIMES[regime]})


@pytest.mark.slow   # ~80 s on 2 shared cores: a Gemma-3 engine of its own on top of the fixture's
def test_gemma3_gguf_blocks_match_hf_on_dequantized_weights(gemma):
    """Q4_K / Q5_0 / Q6_K / Q8_0 blocks on the quantized kernels vs HF on the dequantized weights."""
    prompts, ref = gemma
    equal, first = gguf_agreement("zoo/gemma3-270m.yaml", prompts, ref)
    assert equal >= 0.95 * len(prompts), first
