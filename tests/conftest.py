"""Shared fixtures: tiny random HF checkpoints saved with save_pretrained, and HF greedy
references computed once per session."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(1)

TINY_VOCAB = 512


@pytest.fixture
def one_thread():
    """The test runs on one thread, and the thread count it found is restored afterwards (for
    kernel tests that set their own counts: one leaking 2 threads would slow every test after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny_config(family: str):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen3Config
    # initializer_range 0.2: with the default 0.02 tiny models collapse to one repeated
    # token and parity would pass for the wrong reason (tests assert outputs vary).
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers={"gemma3": 6, "bamba": 4, "qwen3_next": 4, "granite": 4}.get(family, 2),
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if family == "mistral":      # every layer sliding, window smaller than most prompts
        return MistralConfig(**common, sliding_window=20, tie_word_embeddings=False)
    if family == "gemma3":       # 5 sliding : 1 full, window smaller than most prompts
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=20,
                                query_pre_attn_scalar=24, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    if family == "bamba":        # mamba2 layers around one full-attention layer
        from transformers import BambaConfig
        return BambaConfig(**common, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                           mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1,
                           mamba_chunk_size=8, tie_word_embeddings=False)
    if family == "qwen3_next":   # gated DeltaNet x3 + gated full attention, MoE MLPs
        from transformers import Qwen3NextConfig
        return Qwen3NextConfig(**common, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, full_attention_interval=4,
                               tie_word_embeddings=False)
    if family == "granite":      # Granite-4.0-H: mamba2 + attention, MoE + shared MLP, multipliers
        from transformers import GraniteMoeHybridConfig
        c = {**common, "intermediate_size": 32}
        return GraniteMoeHybridConfig(**c, shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                      layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4,
                                      mamba_d_head=16, mamba_d_state=16, mamba_expand=1, mamba_chunk_size=8,
                                      embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.5,
                                      logits_scaling=1.5, tie_word_embeddings=False)
    return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """family -> (hf_dir, HF model in eval mode)."""
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
    cache = {}

    def get(family: str):
        if family not in cache:
            torch.manual_seed(0)
            from transformers import BambaForCausalLM, GraniteMoeHybridForCausalLM, Qwen3NextForCausalLM
            cls = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "mistral": MistralForCausalLM,
                   "gemma3": Gemma3ForCausalLM, "bamba": BambaForCausalLM,
                   "qwen3_next": Qwen3NextForCausalLM, "granite": GraniteMoeHybridForCausalLM}[family]
            model = cls(_tiny_config(family)).eval()
            if family in ("qwen3_next", "granite"):   # HF leaves routers and experts unset: seed them
                gen = torch.Generator().manual_seed(3)
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if any(k in name for k in ("experts", "mlp.gate.weight", "block_sparse_moe")):
                            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            cache[family] = (path, model)
        return cache[family]

    return get


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF `generate`, one prompt at a time (no padding), greedy, exactly `new_tokens`."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out
