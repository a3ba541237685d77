"""Nemotron-H (nemotron_h) against HF: each block is norm -> one of Mamba2 | attention | MLP |
MoE -> residual (hybrid_override_pattern M * - E). We map a Mamba2 / attention block to a
mixer with no feed-forward and an MLP / MoE block to a feed-forward with no mixer; the MLP is
non-gated squared ReLU, attention has no rope, the Mamba2 norm is grouped (n_groups 2 here)
and dt is clamped from below at time_step_min; MoE blocks are DeepSeek-V3-routed relu2
experts. Greedy parity in every harness regime, dense (M - *) and with MoE blocks (M E * -)."""
from __future__ import annotations

import pytest
import torch

from models import resolve_spec
from models.import_hf import main as import_main
from runtime import LLM
from tests import zoo_parity

# M - * - M -: every dense block type, two Mamba2 blocks around the attention block.
PATTERN = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"]
# M E * - M E: all four block types; the MoE (DeepSeek-V3's router: sigmoid scores, a
# selection bias, 2 expert groups of which 1 is picked, scaled weights; non-gated relu2
# experts in a latent space, a shared expert) with biases on the shared expert and the
# latent projections (mlp_bias).
MOE_PATTERN = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
           n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, mlp_bias=True, moe_latent_size=24)


def tiny_config(layers_block_type=PATTERN, **over):
    from transformers import NemotronHConfig
    fields = dict(vocab_size=512, hidden_size=64, layers_block_type=list(layers_block_type), num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8,
                  ssm_state_size=16, n_groups=2, chunk_size=8, max_position_embeddings=512, time_step_min=0.01,
                  initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    return NemotronHConfig(**{**fields, **over})


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from transformers import NemotronHForCausalLM
    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_config()).eval()
    return zoo_parity.reference(model, tmp_path_factory.mktemp("nemotron-h"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import NemotronHForCausalLM
    torch.manual_seed(1)    # seed 0 meets a 1e-4 near-tie where HF's own prefill and decode disagree
    model = NemotronHForCausalLM(tiny_config(MOE_PATTERN, **MOE)).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():   # HF leaves routers, their selection bias, experts and biases small or zero
        for name, p in model.named_parameters():
            if ".mixer.experts" in name or ".mixer.gate." in name or name.endswith("proj.bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if name.endswith("bias") else 0.2))
    return zoo_parity.reference(model, tmp_path_factory.mktemp("nemotron-h-moe"))


def test_import_maps_blocks(dense):
    """Blocks map to (mixer, feed-forward) pairs; the mechanisms are read from the config."""
    spec = resolve_spec(dense.path)
    assert spec.layer_kinds == ["mamba2", "none", "full_attention", "none", "mamba2", "none"]
    assert [spec.ffn_kind(i) for i in range(6)] == ["none", "mlp", "none", "mlp", "none", "mlp"]
    assert spec.cache_layers() == [(0, "mamba2"), (2, "full_attention"), (4, "mamba2")]
    assert (spec.mlp.activation, spec.mlp.gated, spec.rope.type) == ("relu2", False, "none")
    assert spec.mamba2.n_groups == 2 and spec.mamba2.time_step_limit == [0.01, float("inf")]
    assert spec.weight_name("embed") == "backbone.embeddings.weight" and spec.moe is None


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_nemotron_h_parity(dense, regime):
    zoo_parity.check_regime(dense, regime)


def test_import_moe_blocks(moe):
    spec = resolve_spec(moe.path)
    assert [spec.ffn_kind(i) for i in range(6)] == ["none", "moe", "none", "mlp", "none", "moe"]
    m = spec.moe
    assert (m.scoring, m.selection_bias, m.gated, m.n_group, m.topk_group) == ("sigmoid", True, False, 2, 1)
    assert (m.shared_expert_intermediate_size, m.shared_expert_gate, m.dense_bias, m.latent_size) == (48, False, True, 24)
    assert m.expert_activation(spec.mlp.activation) == "relu2" and m.routed_scaling_factor == 1.5
    assert spec.cache_layers() == [(0, "mamba2"), (2, "full_attention"), (4, "mamba2")]


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_nemotron_h_moe_parity(moe, regime):
    zoo_parity.check_regime(moe, regime)


def test_import_cli_round_trip(dense, tmp_path):
    """`python -m models.import_hf` writes a spec that loads the same checkpoint and agrees."""
    out = tmp_path / "nemotron.yaml"
    assert import_main([str(dense.path), "-o", str(out)]) == 0
    llm = LLM(out)
    assert zoo_parity._generate(llm, dense.prompts[:3]) == dense.ref[:3]


def test_zoo_spec_matches_import(moe):
    """zoo/nemotron-h-small.yaml (and the 8B it extends) declares what the importer derives
    from an HF checkpoint: the same checkpoint names, layer mapping and MoE mechanisms."""
    from models import load_spec
    zoo, imported = load_spec("zoo/nemotron-h-small.yaml"), resolve_spec(moe.path)
    assert zoo.weight_names == imported.weight_names
    assert zoo.layer_kinds == imported.layer_kinds and zoo.layers.ffn == imported.layers.ffn
    for field in ("scoring", "selection_bias", "router_fp32", "gated", "shared_expert_gate", "n_group", "topk_group",
                  "routed_scaling_factor", "num_experts", "num_experts_per_tok", "intermediate_size",
                  "shared_expert_intermediate_size"):
        assert getattr(zoo.moe, field) == getattr(imported.moe, field), field
    assert (zoo.mlp.activation, zoo.mlp.gated, zoo.rope.type) == (imported.mlp.activation, False, "none")
