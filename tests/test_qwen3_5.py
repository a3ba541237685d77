"""Qwen3.5 text models (`qwen3_5_text` dense, `qwen3_5_moe_text` MoE): greedy parity with HF
generate in every zoo_parity regime, the importer's reading of their configs (the DeltaNet's
qwen3_5 projection layout, the multimodal checkpoint's text part), and the layer against HF's own."""
from __future__ import annotations

import json

import pytest
import torch

from models.import_hf import spec_from_hf_dir
from tests import zoo_parity

torch.set_num_threads(1)

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, max_position_embeddings=512, initializer_range=0.2,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def _hf_model(family: str):
    """Three gated DeltaNet layers and one gated full-attention layer (the default interval 4)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    torch.manual_seed(0)
    if family == "dense":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON, intermediate_size=128)).eval()
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=32,
                                                       shared_expert_intermediate_size=48)).eval()
    gen = torch.Generator().manual_seed(3)      # HF leaves routers and experts unset: seed them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "mlp.gate.weight" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@pytest.fixture(scope="module", params=["dense", "moe"])
def family(request, tmp_path_factory):
    model = _hf_model(request.param)
    return request.param, zoo_parity.reference(model, tmp_path_factory.mktemp(f"qwen3_5-{request.param}"))


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_qwen3_5_parity(family, regime):
    _, ref = family
    zoo_parity.check_regime(ref, regime)


def test_import_reads_qwen3_5(family):
    name, ref = family
    spec = spec_from_hf_dir(ref.path)
    assert spec.layer_kinds == ["gated_deltanet"] * 3 + ["full_attention"]
    assert spec.gated_deltanet.layout == "qwen3_5"
    assert spec.attention.output_gate and spec.attention.qk_norm and spec.norm.offset == 1.0
    assert spec.rope.partial_rotary_factor == 0.25
    assert (spec.moe is not None) == (name == "moe")
    assert all(spec.ffn_kind(i) == ("moe" if name == "moe" else "mlp") for i in range(4))


def test_multimodal_checkpoint_yields_text_part(tmp_path):
    """A Qwen3.5 image-text checkpoint (config with text_config, tensors under
    model.language_model., a vision tower under model.visual.) loads as its text model and
    generates what HF's Qwen3_5ForConditionalGeneration does on text."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    text = dict(COMMON, intermediate_size=96)
    cfg = Qwen3_5Config(text_config=text, vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2,
                                                         "intermediate_size": 32, "out_hidden_size": 64})
    torch.manual_seed(0)
    ref = zoo_parity.reference(Qwen3_5ForConditionalGeneration(cfg).eval(), tmp_path, vocab=VOCAB)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    spec = spec_from_hf_dir(tmp_path)
    assert spec.layer_kinds == ["gated_deltanet"] * 3 + ["full_attention"]
    assert spec.mlp.intermediate_size == 96 and spec.gated_deltanet.layout == "qwen3_5"
    assert spec.weight_name("layer") == "model.language_model.layers.{i}."
    assert spec.checkpoint.ignore == ["mtp.", "model.visual."]
    zoo_parity.check_regime(ref, "default")


def test_split_layer_matches_hf():
    """Our Gated DeltaNet in the qwen3_5 layout, loaded through the kind's weight sources
    (four HF input linears stacked into one), equals Qwen3_5GatedDeltaNet on a prompt, prefilled in
    two chunks from the stored state."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from attention.state import StateMetadata
    from models.kinds import KINDS
    from models.spec import spec_from_dict
    config = Qwen3_5TextConfig(**COMMON, intermediate_size=128)
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        hf.A_log.copy_(torch.empty(4).uniform_(0.001, 0.05).log())
    spec = spec_from_dict({"name": "t", "vocab_size": VOCAB, "hidden_size": 64, "layers": {"num": 1, "pattern": ["gated_deltanet"]},
                           "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}, "mlp": {"intermediate_size": 8},
                           "gated_deltanet": {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16,
                                              "layout": "qwen3_5"}})
    kind = KINDS["gated_deltanet"]
    ours = kind.make_mixer(spec, 0, None).eval()
    hf_sd = {"linear_attn." + k: v for k, v in hf.state_dict().items()}
    params = dict(ours.named_parameters())
    sources = kind.weight_sources(spec, ours, "", "")
    assert set(sources) == set(params) and {n for parts in sources.values() for n, _, _ in parts} == set(hf_sd)
    with torch.no_grad():
        for pname, parts in sources.items():
            for src, off, rows in parts:
                params[pname][off:off + rows].copy_(hf_sd[src])
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(x.unsqueeze(0))[0]
        conv = torch.zeros(1, *ours.state_shapes()["conv"])
        rec = torch.zeros(1, *ours.state_shapes()["recurrent"])
        first = ours(x[:13], conv, rec, StateMetadata.build([13], [0], [False]))
        rest = ours(x[13:], conv, rec, StateMetadata.build([8], [0], [True]))
    torch.testing.assert_close(torch.cat([first, rest]), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3.5-small", "qwen3.5-moe-small"])
def test_zoo_small_variants(name):
    from tests.test_zoo import test_small_variants_generate
    test_small_variants_generate(name)


def test_zoo_real_dimensions():
    from models.spec import load_spec
    from tests.test_zoo import ZOO
    dense, moe = load_spec(ZOO / "qwen3.5-9b.yaml"), load_spec(ZOO / "qwen3.5-moe-35b-a3b.yaml")
    for spec, layers in ((dense, 32), (moe, 40)):
        assert [i for i, k in enumerate(spec.layer_kinds) if k == "full_attention"] == list(range(3, layers, 4))
        assert spec.gated_deltanet.layout == "qwen3_5" and spec.attention.output_gate
    assert dense.moe is None and dense.mlp.intermediate_size == 12288
    assert moe.moe.num_experts == 256 and all(moe.ffn_kind(i) == "moe" for i in range(40))
