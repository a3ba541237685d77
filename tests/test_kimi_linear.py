"""Kimi-Linear (HF `kimi_linear`) against HF greedy generate in every harness regime.

`kimi`: the real layout at toy size: KDA x3 then an MLA layer (no rope, direct q), a dense
first MLP, sigmoid-routed MoE with selection bias, group-limited top-k and a shared expert.
`kda_moe`: every layer KDA (HF's layer_types allow it), the same MLPs: a pool of state pages
only. Its requests hold a fixed number of state blocks and never grow, so no pool forces a
preemption: the preempt regime runs where MLA layers grow the cache."""
from __future__ import annotations

import pytest
import torch

from tests import zoo_parity
from tests.conftest import TINY_VOCAB

VARIANTS = {
    # the real layout, small: KDA x3 then MLA, a dense first MLP, MoE after it
    "kimi": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3),
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


# config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct as Moonshot writes it (from memory,
# see zoo/kimi-linear-48b-a3b.yaml): no layer_types, the layout in linear_attn_config.
MOONSHOT_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "model_max_length": 1048576,
    "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "torch_dtype": "bfloat16",
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "short_conv_kernel_size": 4},
}


@pytest.mark.parametrize("with_defaults", [False, True])
def test_moonshot_config_imports_as_the_zoo_spec(tmp_path, with_defaults):
    """The importer reads Moonshot's config.json (as written, and as transformers completes
    it) into the zoo spec's architecture; the zoo YAML and the importer agree field by field."""
    import json

    from models import load_spec
    from models.import_hf import spec_dict_from_hf_config, spec_from_hf_dir
    from models.spec import spec_from_dict
    (tmp_path / "config.json").write_text(json.dumps(MOONSHOT_CONFIG))
    spec = spec_from_hf_dir(tmp_path) if with_defaults else \
        spec_from_dict(spec_dict_from_hf_config(dict(MOONSHOT_CONFIG), tmp_path))
    zoo = load_spec("zoo/kimi-linear-48b-a3b.yaml")
    assert spec.layer_kinds == zoo.layer_kinds and spec.layer_kinds.count("mla") == 7
    assert [spec.ffn_kind(i) for i in range(27)] == [zoo.ffn_kind(i) for i in range(27)] == ["mlp"] + ["moe"] * 26
    for section in ("kda", "mla", "moe", "norm", "mlp"):
        assert getattr(spec, section) == getattr(zoo, section), section
    assert (spec.attention.num_heads, spec.attention.head_dim) == (zoo.attention.num_heads, zoo.attention.head_dim)
    assert spec.rope.type == zoo.rope.type == "none"
    assert (spec.vocab_size, spec.hidden_size, spec.max_model_len, spec.dtype) == \
           (zoo.vocab_size, zoo.hidden_size, zoo.max_model_len, zoo.dtype)
    assert {k: spec.weight_name(k) for k in zoo.weight_names} == zoo.weight_names


def test_cli_writes_a_spec_that_generates_like_the_checkpoint(tmp_path_factory):
    """`python -m models.import_hf <hf_dir> -o spec.yaml` on a tiny checkpoint: the written
    spec loads and generates what LLM(hf_dir) does."""
    from models.import_hf import main
    from runtime import LLM, SamplingParams
    path = tmp_path_factory.mktemp("kimi-cli")
    tiny_kimi("kimi").save_pretrained(path)
    out = path / "spec.yaml"
    assert main([str(path), "-o", str(out)]) == 0
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = ([o.outputs[0].token_ids for o in LLM(p).generate(prompts, params, use_tqdm=False)] for p in (path, out))
    assert a == b
