"""Families the importer does not list load through the one general config reader when they
are built of mechanisms the zoo has: Ministral (sliding + full layers from `layer_types`) and
Seed-OSS (Llama-style, q/k/v biases without an o bias) match HF in the harness regimes; their spec is read field by field."""
from __future__ import annotations

import pytest
import torch

from models import resolve_spec
from models.import_hf import _FAMILIES
from tests import zoo_parity

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def _model(family: str):
    torch.manual_seed(0)
    if family == "ministral":
        from transformers import MinistralConfig, MinistralForCausalLM
        cfg = MinistralConfig(**COMMON, head_dim=16, sliding_window=20, layer_types=["sliding_attention", "full_attention"])
        return MinistralForCausalLM(cfg).eval()
    from transformers import SeedOssConfig, SeedOssForCausalLM
    return SeedOssForCausalLM(SeedOssConfig(**COMMON, head_dim=16, attention_bias=True,
                                            attention_out_bias=False)).eval()


@pytest.fixture(scope="module", params=["ministral", "seed_oss"])
def family(request, tmp_path_factory):
    assert request.param not in _FAMILIES            # read with no family traits at all
    return request.param, zoo_parity.reference(_model(request.param), tmp_path_factory.mktemp(request.param))


def test_spec_read_by_field(family):
    name, ref = family
    spec = resolve_spec(ref.path)
    if name == "ministral":
        assert spec.layer_kinds == ["sliding_attention", "full_attention"] and spec.attention.sliding_window == 20
    else:
        assert spec.layer_kinds == ["full_attention"] * 2 and spec.attention.head_dim == 16
        assert spec.attention.bias and not spec.attention.o_bias


@pytest.mark.parametrize("regime", ["default", "chunked", "preempt", "prefix_3", "staggered"])
def test_general_reader_parity(family, regime):
    zoo_parity.check_regime(family[1], regime)
