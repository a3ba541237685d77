"""MiniMax (`minimax`, MiniMax-Text-01): lightning-attention layers around softmax attention,
a Mixtral-style MoE, normed-input residuals scaled per sub-block. Greedy parity with HF generate
in every zoo_parity regime, the importer's reading of the config, and the zoo specs."""
from __future__ import annotations

import pytest
import torch

from models.import_hf import spec_from_hf_dir
from models.spec import load_spec
from tests import zoo_parity

torch.set_num_threads(1)

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
# distinct residual scales per sub-block, so a mix-up shows in the tokens
FACTORS = dict(full_attn_alpha_factor=1.5, linear_attn_alpha_factor=2.0, mlp_alpha_factor=1.2,
               full_attn_beta_factor=0.8, linear_attn_beta_factor=1.1, mlp_beta_factor=0.9)


def _hf_model():
    from transformers import MiniMaxConfig, MiniMaxForCausalLM
    cfg = MiniMaxConfig(vocab_size=512, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, block_size=16, max_position_embeddings=512, initializer_range=0.2,
                        bos_token_id=None, eos_token_id=None, layer_types=LAYER_TYPES, **FACTORS)
    torch.manual_seed(0)
    model = MiniMaxForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(3)      # HF leaves routers and experts unset: seed them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "mlp.gate" in name or "block_sparse_moe" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return zoo_parity.reference(_hf_model(), tmp_path_factory.mktemp("minimax"))


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_minimax_parity(ref, regime):
    zoo_parity.check_regime(ref, regime)


def test_import_reads_minimax(ref):
    spec = spec_from_hf_dir(ref.path)
    assert spec.layer_kinds == ["lightning_attention", "full_attention", "lightning_attention", "lightning_attention"]
    assert spec.lightning_attention.num_heads == 4 and spec.lightning_attention.head_dim == 16
    assert spec.residual.scales("full_attention") == (1.5, 0.8)
    assert spec.residual.scales("lightning_attention") == (2.0, 1.1)
    assert spec.residual.scales("mlp") == (1.2, 0.9)
    assert spec.moe.num_experts == 4 and all(spec.ffn_kind(i) == "moe" for i in range(4))


def test_residual_errors_name_the_field():
    from models.spec import SpecError, spec_from_dict
    base = {"name": "t", "vocab_size": 64, "hidden_size": 32, "layers": {"num": 1}, "mlp": {"intermediate_size": 8},
            "attention": {"num_heads": 2, "num_kv_heads": 2, "head_dim": 16}}
    with pytest.raises(SpecError, match=r"residual\.alpha\.lightning_attention: not a sub-block"):
        spec_from_dict({**base, "residual": {"alpha": {"lightning_attention": 2.0}}})
    with pytest.raises(SpecError, match=r"residual\.beta\.mlp: expected a number"):
        spec_from_dict({**base, "residual": {"beta": {"mlp": "x"}}})


def test_zoo_real_dimensions():
    from tests.test_zoo import ZOO
    spec = load_spec(ZOO / "minimax-text-01.yaml")
    assert spec.num_layers == 80 and spec.layer_kinds.count("full_attention") == 10
    assert [i for i, k in enumerate(spec.layer_kinds) if k == "full_attention"] == list(range(7, 80, 8))
    assert spec.residual.scales("mlp") == pytest.approx(((2 * 80) ** 0.25, 1.0))
    assert spec.moe.num_experts == 32 and spec.lightning_attention.num_heads == 64


def test_zoo_small_variant():
    from tests.test_zoo import test_small_variants_generate
    test_small_variants_generate("minimax-small")
