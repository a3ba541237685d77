"""SmolLM3 against HF: NoPE layers (`no_rope_layers`: 1 = rope, 0 = NoPE) as the
full_attention_nope / sliding_attention_nope kinds, with and without SmolLM3's sliding window
on its NoPE layers; greedy parity in every zoo_parity regime."""
from __future__ import annotations

import pytest
import torch

from tests import zoo_parity
from tests.conftest import hf_greedy

VARIANTS = {
    "nope": dict(),                                               # rope, NoPE, rope, NoPE
    "nope_sliding": dict(use_sliding_window=True, sliding_window=20),   # the NoPE layers slide
}


def _model(**overrides):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    config = SmolLM3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           no_rope_layer_interval=2, initializer_range=0.2, bos_token_id=None,
                           eos_token_id=None, pad_token_id=None, **overrides)
    torch.manual_seed(0)
    return SmolLM3ForCausalLM(config).eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def smollm3(request, tmp_path_factory):
    model = _model(**VARIANTS[request.param])
    return request.param, model, zoo_parity.reference(model, tmp_path_factory.mktemp(f"smollm3-{request.param}"))


def test_import_makes_nope_layers(smollm3):
    from models import resolve_spec
    variant, model, ref = smollm3
    assert model.config.no_rope_layers == [1, 0, 1, 0]
    kinds = resolve_spec(ref.path).layer_kinds
    nope = "sliding_attention_nope" if variant == "nope_sliding" else "full_attention_nope"
    assert kinds == ["full_attention", nope] * 2


def test_nope_matters(smollm3):
    """Guard against a vacuous pass: the same weights with rope on every layer generate
    differently, so the NoPE layers are really without rotation."""
    _, model, ref = smollm3
    flags = model.config.no_rope_layers
    for layer in model.model.layers:
        layer.self_attn.use_rope = 1
    try:
        assert hf_greedy(model, ref.prompts[3:5], zoo_parity.NEW) != ref.ref[3:5]
    finally:
        for layer, flag in zip(model.model.layers, flags):
            layer.self_attn.use_rope = flag


def test_no_rope_layers_must_cover_every_layer(tmp_path):
    import json

    from models import SpecError
    from models.import_hf import spec_from_hf_dir
    model = _model()
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["no_rope_layers"] = [1, 0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=r"no_rope_layers: lists 2 layers but num_hidden_layers is 4$"):
        spec_from_hf_dir(tmp_path)


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_smollm3_parity(smollm3, regime):
    zoo_parity.check_regime(smollm3[2], regime)
