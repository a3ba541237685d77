"""OLMo-Hybrid against HF: its Gated DeltaNet variant (separate q/k/v/g/b/a projections, beta in
[0, 2]) on its own under any chunking and batching, the importer (post-norm attention layers
with q/k norms over all heads, pre-norm linear layers, OLMo-core checkpoint names, NoPE when
rope_theta is null), and greedy parity in every zoo_parity regime, with rope and without."""
from __future__ import annotations

import pytest
import torch

from models.gated_deltanet import SeparateGatedDeltaNet
from tests import zoo_parity
from tests.test_gated_deltanet import HIDDEN, check_schedule

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, max_position_embeddings=512, initializer_range=0.2,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
NOPE = {"rope_type": "default", "rope_theta": None}    # as the released checkpoints have it


def _config(**overrides):
    from transformers import OlmoHybridConfig
    return OlmoHybridConfig(**{**TINY, **overrides})


@pytest.fixture(scope="module", params=[True, False], ids=["neg_eigval", "pos_eigval"])
def deltanet_pair(request):
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet
    assert HIDDEN == TINY["hidden_size"]
    torch.manual_seed(0)
    hf = OlmoHybridGatedDeltaNet(_config(linear_allow_neg_eigval=request.param), layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():   # random everything; gentle decays so state carries far
            p.normal_(0, 0.2)
        hf.A_log.copy_(torch.empty(4).uniform_(0.001, 0.05).log())
        hf.o_norm.weight.add_(1.0)
    ours = SeparateGatedDeltaNet(HIDDEN, 2, 4, 16, 16, rms_norm_eps=1e-5, allow_neg_eigval=request.param).eval()
    w = hf.state_dict()
    ours.load_state_dict({
        "in_proj.weight": torch.cat([w[f"{n}_proj.weight"] for n in "qkvgba"]), "conv1d.weight": w["conv1d.weight"],
        "dt_bias": w["dt_bias"], "A_log": w["A_log"], "norm.weight": w["o_norm.weight"],
        "out_proj.weight": w["o_proj.weight"]})
    return hf, ours


def test_deltanet_variant_matches_hf_whatever_the_schedule(deltanet_pair):
    hf, ours = deltanet_pair
    g = torch.Generator().manual_seed(13)
    seqs = {0: torch.randn(11, HIDDEN, generator=g), 1: torch.randn(70, HIDDEN, generator=g),
            2: torch.randn(7, HIDDEN, generator=g)}
    slots = {0: 5, 1: 1, 2: 3}
    check_schedule(hf, ours, seqs, [[(0, 11), (1, 70), (2, 7)]], slots)
    check_schedule(hf, ours, seqs, [[(1, 9), (0, 2), (2, 1)], [(2, 3), (1, 1), (0, 1)], [(0, 1), (1, 1)],
                                    [(0, 7), (2, 3), (1, 59)]], slots)


def _saved(tmp_path, **overrides):
    from transformers import OlmoHybridForCausalLM
    torch.manual_seed(0)
    model = OlmoHybridForCausalLM(_config(**overrides)).eval()
    model.save_pretrained(tmp_path)
    return model


def test_import_reads_olmo_hybrid(tmp_path):
    from models.import_hf import spec_from_hf_dir
    _saved(tmp_path)
    spec = spec_from_hf_dir(tmp_path)
    assert spec.layer_kinds == ["gated_deltanet"] * 3 + ["full_attention"]
    assert [spec.post_norm(i) for i in range(4)] == [False, False, False, True]
    g, a = spec.gated_deltanet, spec.attention
    assert g.layout == "separate" and g.allow_neg_eigval and g.norm_eps == 1e-5
    assert a.qk_norm and a.qk_norm_all_heads and spec.rope.type == "default"
    nope = tmp_path / "nope"
    _saved(nope, rope_parameters=NOPE)
    assert spec_from_hf_dir(nope).rope.type == "none"


def test_conv_rows_must_add_up(tmp_path):
    """The three conv tensors are sized by the file, but together they must fill the conv."""
    from safetensors.torch import load_file, save_file

    from models import WeightError
    from runtime import LLM
    _saved(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.linear_attn.v_conv1d.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"q_conv1d.weight, .*v_conv1d.weight have 127 rows together, "
                                          r"the spec expects 128$"):
        LLM(tmp_path)


@pytest.mark.parametrize("edit, error", [
    ({"layers": {"norm_position": ["pre", "after"]}}, r"layers\.norm_position\[1\]: 'after' is not one of pre, post$"),
    ({"layers": {"ffn": ["mlp", "mlp", "mlp", "none"]}},
     r"layers\.norm_position: post norms need a mixer and a feed-forward block and no sandwich norms \(layer 3\)$"),
    ({"gated_deltanet": {"layout": "fused"}}, r"gated_deltanet\.layout: 'fused' is not one of qwen3_next, separate, qwen3_5$"),
    ({"attention": {"qk_norm": False}}, r"attention\.qk_norm_all_heads: needs qk_norm: true$"),
])
def test_spec_errors_name_the_field(tmp_path, edit, error):
    from pathlib import Path

    import yaml

    from models import SpecError, load_spec
    base = Path(__file__).resolve().parent.parent / "zoo" / "olmo-hybrid-small.yaml"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"extends": str(base), **edit}))
    with pytest.raises(SpecError, match=error):
        load_spec(path)


@pytest.fixture(scope="module", params=["rope", "nope"])
def olmo(request, tmp_path_factory):
    from transformers import OlmoHybridForCausalLM
    torch.manual_seed(0)
    model = OlmoHybridForCausalLM(_config(**({"rope_parameters": NOPE} if request.param == "nope" else {}))).eval()
    return zoo_parity.reference(model, tmp_path_factory.mktemp(f"olmo-hybrid-{request.param}"))


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_olmo_hybrid_parity(olmo, regime):
    zoo_parity.check_regime(olmo, regime)
