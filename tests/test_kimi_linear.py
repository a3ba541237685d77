"""Kimi-Linear (HF `kimi_linear`) against HF greedy generate in every harness regime.

`kda_moe`: every layer KDA (HF's layer_types allow it), the same MLPs: a pool of state pages
only. Its requests hold a fixed number of state blocks and never grow, so no pool forces a
preemption: the preempt regime runs where MLA layers grow the cache."""
from __future__ import annotations

import pytest
import torch

from tests import zoo_parity
from tests.conftest import TINY_VOCAB

VARIANTS = {
    "kda_moe": dict(layer_types=["linear_attention"] * 3, mlp_layer_types=["dense"] + ["sparse"] * 2),
}


def tiny_kimi(variant: str):
    """A tiny random HF Kimi-Linear model in eval mode, weights raised until outputs vary."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    layers = VARIANTS[variant]
    config = KimiLinearConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=len(layers["layer_types"]), num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
        n_group=2, topk_group=1,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4},
        initializer_range=0.2, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        max_position_embeddings=512, **layers)
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():   # HF leaves routers, selection biases and experts unset: seed them
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "experts" in name or "mlp.gate." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def kimi(request, tmp_path_factory):
    model = tiny_kimi(request.param)
    if "full_attention" not in model.config.layer_types:
        # HF's cache cannot hold only linear-attention layers (get_seq_length needs an attention
        # layer): generate without one, recomputing the whole sequence per token.
        model.generation_config.use_cache = False
    ref = zoo_parity.reference(model, tmp_path_factory.mktemp(f"kimi-{request.param}"))
    ref.layer_types = model.config.layer_types
    return ref


def two_request_pool(path) -> int:
    """A pool that admits two requests' KDA states, then runs out as their MLA blocks grow.
    (The harness's default holds one request: its states take 5 of MLA's small pages per
    layer, so requests would run one at a time and never be preempted.)"""
    from cache.kv_cache_spec import StateSpec
    from runtime import LLM
    max_len = max(zoo_parity.LENGTHS) + zoo_parity.NEW + 8
    probe = LLM(path, max_model_len=max_len, max_num_batched_tokens=16, num_kv_blocks=4096)
    live = [(isinstance(g.spec, StateSpec), g.spec.max_live_blocks(max_len, 16))
            for g in probe.engine.kv_manager.config.groups]
    return 2 * sum(n for state, n in live if state) + sum(n for state, n in live if not state)


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_parity(kimi, regime):
    if regime == "preempt" and "full_attention" not in kimi.layer_types:
        pytest.skip("state-only model: requests never grow, nothing to preempt")
    extra = dict(preempt_blocks=two_request_pool(kimi.path)) if regime == "preempt" else {}
    zoo_parity.check_regime(kimi, regime, **extra)
