"""Falcon-H1 (falcon_h1) against HF: every layer runs attention and Mamba2 in parallel on the
same normed input (`full_attention+mamba2`, outputs summed), then an MLP, with muP
multipliers everywhere. The multipliers on linear maps are folded into the weights at load
(`weight_scales`), embeddings and logits are scaled at run time. Greedy parity in every
harness regime, with every multiplier != 1 and every bias present (and random, so the bias
scales count); the Mamba2 gated-norm variants (norm then gate, gate then norm, no norm) too."""
from __future__ import annotations

import pytest
import torch
import yaml

from models import resolve_spec
from models.spec import spec_to_dict
from runtime import LLM
from tests import zoo_parity

MULTIPLIERS = dict(attention_in_multiplier=0.8, attention_out_multiplier=0.9, key_multiplier=0.5,
                   ssm_in_multiplier=1.25, ssm_out_multiplier=0.7, ssm_multipliers=[0.5, 0.75, 1.5, 0.6, 1.2],
                   mlp_multipliers=[0.8, 0.6], embedding_multiplier=2.0, lm_head_multiplier=0.3)
BIASES = dict(attention_bias=True, mlp_bias=True, mamba_proj_bias=True, projectors_bias=True)


def tiny_model(**over):
    from transformers import FalconH1Config, FalconH1ForCausalLM
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
                  mamba_d_state=16, mamba_chunk_size=8, max_position_embeddings=512, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False, **MULTIPLIERS)
    torch.manual_seed(0)
    model = FalconH1ForCausalLM(FalconH1Config(**{**fields, **over})).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():       # HF zeroes linear biases at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    model = tiny_model(mamba_rms_norm=True, mamba_norm_before_gate=True, **BIASES)
    return zoo_parity.reference(model, tmp_path_factory.mktemp("falcon-h1"))


def test_import_reads_multipliers(falcon):
    spec = resolve_spec(falcon.path)
    assert spec.layer_kinds == ["full_attention+mamba2"] * 3 and spec.ffn_kind(0) == "mlp"
    assert spec.mamba2.gated_norm == "norm_then_gate" and spec.mamba2.out_proj_bias
    assert spec.embedding_multiplier == 2.0 and spec.logits_scaling == pytest.approx(1 / 0.3)
    s = spec.weight_scales
    assert s["self_attn.k_proj.weight"] == pytest.approx(0.4) and s["self_attn.k_proj.bias"] == 0.5
    assert "self_attn.q_proj.bias" not in s      # an input multiplier leaves biases alone
    assert s["mamba.in_proj.weight"] == [[64, 0.625], [64, 0.9375], [32, 1.875], [32, 0.75], [8, 1.5]]
    assert s["mamba.in_proj.bias"] == [[64, 0.5], [64, 0.75], [32, 1.5], [32, 0.6], [8, 1.2]]
    assert s["feed_forward.down_proj.bias"] == 0.6


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_falcon_h1_parity(falcon, regime):
    zoo_parity.check_regime(falcon, regime)


@pytest.mark.parametrize("norm", [dict(mamba_rms_norm=False), dict(mamba_rms_norm=True, mamba_norm_before_gate=False)],
                         ids=["no_norm", "gate_then_norm"])
def test_gated_norm_variants(norm, tmp_path):
    ref = zoo_parity.reference(tiny_model(**norm), tmp_path)
    zoo_parity.check_regime(ref, "chunked")


def test_weight_scales_matter(falcon, tmp_path):
    """Guard against a vacuous pass: without the folded multipliers the outputs differ."""
    data = spec_to_dict(resolve_spec(falcon.path))
    data["weight_scales"] = {}
    path = tmp_path / "unscaled.yaml"
    path.write_text(yaml.safe_dump(data))
    assert zoo_parity._generate(LLM(path), falcon.prompts) != falcon.ref


@pytest.mark.parametrize("scales, message", [
    ({"self_attn.kk_proj.weight": 2.0}, "weight_scales: no checkpoint tensor of the spec is named self_attn.kk_proj.weight"),
    ({"mamba.in_proj.weight": [[64, 1.0]]},
     "weight_scales.mamba.in_proj.weight: segments cover 64 rows, tensor 'model.layers.0.mamba.in_proj.weight' has 164"),
])
def test_weight_scales_errors(scales, message, tmp_path):
    """A scale naming no tensor (a typo would silently do nothing) or segments that do not
    cover the tensor fail in one line."""
    from models import WeightError, load_spec
    data = spec_to_dict(load_spec("zoo/falcon-h1-small.yaml"))
    data["weight_scales"] = {**data["weight_scales"], **scales}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(WeightError) as e:
        LLM(path)
    assert str(e.value) == f"{path}: {message}"


def test_zoo_spec_matches_import(falcon):
    """zoo/falcon-h1-small.yaml (and the 7B it extends) uses the importer's checkpoint names
    and layer structure, so a real checkpoint loads under it."""
    from models import load_spec
    zoo, imported = load_spec("zoo/falcon-h1-small.yaml"), resolve_spec(falcon.path)
    assert zoo.weight_names == imported.weight_names
    assert zoo.layers.pattern == imported.layers.pattern == ["full_attention+mamba2"]
    assert set(zoo.weight_scales) <= set(imported.weight_scales)
