"""The zoo parity harness (tests/zoo_parity.py) over the families the zoo had before the
2025-26 ones: each regime against HF greedy, hits exact, forks equal seeded requests."""
from __future__ import annotations

import pytest

from tests import zoo_parity


def _with(config, **fields):
    """`config` with `fields` set (HF configs are plain attribute bags)."""
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral", "gemma3", "bamba", "qwen3_next", "granite"])
def family(request, tiny_hf, tmp_path_factory):
    if request.param == "gemma3":   # at conftest's 0.2 the tiny Gemma 3 repeats one token per prompt
        import torch
        from transformers import Gemma3ForCausalLM

        from tests.conftest import _tiny_config
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(_with(_tiny_config("gemma3"), initializer_range=0.05)).eval()
    else:
        _, model = tiny_hf(request.param)
    return request.param, zoo_parity.reference(model, tmp_path_factory.mktemp(f"zp-{request.param}"))


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_family_parity(family, regime):
    name, ref = family
    zoo_parity.check_regime(ref, regime)
