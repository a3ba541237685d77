"""Nemotron-H (nemotron_h) against HF: each block is norm -> one of Mamba2 | attention | MLP |
MoE -> residual (hybrid_override_pattern M * - E). We map a Mamba2 / attention block to a
mixer with no feed-forward and an MLP / MoE block to a feed-forward with no mixer; the MLP is
non-gated squared ReLU, attention has no rope, the Mamba2 norm is grouped (n_groups 2 here)
and dt is clamped from below at time_step_min. Greedy parity in every harness regime."""
from __future__ import annotations

import pytest
import torch

from models import resolve_spec
from models.import_hf import main as import_main
from runtime import LLM
from tests import zoo_parity

# M - * - M -: every dense block type, two Mamba2 blocks around the attention block.
PATTERN = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"]


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


def test_import_maps_blocks(dense):
    """Blocks map to (mixer, feed-forward) pairs; the mechanisms are read from the config."""
    spec = resolve_spec(dense.path)
    assert spec.layer_kinds == ["mamba2", "none", "full_attention", "none", "mamba2", "none"]
    assert [spec.ffn_kind(i) for i in range(6)] == ["none", "mlp", "none", "mlp", "none", "mlp"]
    assert spec.cache_layers() == [(0, "mamba2"), (2, "full_attention"), (4, "mamba2")]
    assert (spec.mlp.activation, spec.mlp.gated, spec.rope.type) == ("relu2", False, "none")
    assert spec.mamba2.n_groups == 2 and spec.mamba2.time_step_limit == [0.01, float("inf")]
    assert spec.weight_name("embed") == "backbone.embeddings.weight"


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_nemotron_h_parity(dense, regime):
    zoo_parity.check_regime(dense, regime)


def test_import_cli_round_trip(dense, tmp_path):
    """`python -m models.import_hf` writes a spec that loads the same checkpoint and agrees."""
    out = tmp_path / "nemotron.yaml"
    assert import_main([str(dense.path), "-o", str(out)]) == 0
    llm = LLM(out)
    assert zoo_parity._generate(llm, dense.prompts[:3]) == dense.ref[:3]
