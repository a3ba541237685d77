"""Qwen3-MoE end to end: a tiny random Qwen3MoeForCausalLM saved with save_pretrained loads
through the importer (model_type qwen3_moe: every MoE field read from config.json) and
matches HF greedy `generate` token for token in every regime of the zoo parity harness.

Layers 1 and 5 are MoE (decoder_sparse_step 2; layer 3 is in mlp_only_layers), the rest
dense MLPs, so the dense/MoE split and both checkpoint layouts are exercised.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import zoo_parity
from tests.test_compile import inductor_cache  # noqa: F401  (the compile test's private cache fixture)
from tests.conftest import TINY_VOCAB

ZOO = Path(__file__).resolve().parent.parent / "zoo"
MOE_LAYERS = [1, 5]


def _tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                         decoder_sparse_step=2, mlp_only_layers=[3], initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(3)     # HF leaves routers and 3-D experts unset: seed them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "mlp.gate.weight" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    model = _tiny_qwen3_moe()
    assert [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")] == MOE_LAYERS
    return zoo_parity.reference(model, tmp_path_factory.mktemp("qwen3_moe"))


def test_importer_reads_the_moe_fields(ref):
    from models import resolve_spec
    spec = resolve_spec(ref.path)
    m = spec.moe
    assert (m.num_experts, m.num_experts_per_tok, m.intermediate_size) == (8, 2, 32)
    assert (m.scoring, m.norm_topk_prob, m.shared_expert_intermediate_size) == ("softmax", True, 0)
    assert (m.decoder_sparse_step, m.mlp_only_layers) == (2, [3])
    assert spec.attention.qk_norm and spec.mlp.intermediate_size == 96
    assert [i for i in range(spec.num_layers) if spec.ffn_kind(i) == "moe"] == MOE_LAYERS


@pytest.mark.parametrize("regime", zoo_parity.REGIMES)
def test_qwen3_moe_parity(ref, regime):
    zoo_parity.check_regime(ref, regime)


def test_routing_matters(ref):
    """Guard against a vacuous pass: with the routed experts' weights zeroed the engine no
    longer reproduces HF (the MoE layers carry the outputs)."""
    from runtime import LLM
    llm = LLM(ref.path)
    with torch.no_grad():
        for i in MOE_LAYERS:
            llm.engine.model.layers[i].mlp.experts.down_proj.zero_()
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ref.prompts],
                                                        zoo_parity.GREEDY, use_tqdm=False)]
    assert got != ref.ref


def test_zoo_specs():
    from models import load_spec
    big = load_spec(ZOO / "qwen3-30b-a3b.yaml")
    assert (big.num_layers, big.hidden_size, big.vocab_size) == (48, 2048, 151936)
    a = big.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.qk_norm) == (32, 4, 128, True)
    assert (big.moe.num_experts, big.moe.num_experts_per_tok, big.moe.intermediate_size) == (128, 8, 768)
    assert big.rope.theta == 1e6 and all(big.ffn_kind(i) == "moe" for i in range(48))
    small = load_spec(ZOO / "qwen3-moe-small.yaml")
    assert small.moe.num_experts == 8 and small.checkpoint.source == "dummy"
    assert [small.ffn_kind(i) for i in range(6)] == ["mlp", "moe", "mlp", "mlp", "mlp", "moe"]


def test_small_variant_generates():
    """qwen3-moe-small (dummy weights) runs; chunked prefill leaves its greedy output unchanged."""
    from runtime import LLM, SamplingParams
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in LLM(ZOO / "qwen3-moe-small.yaml", max_model_len=256, **kw)
             .generate(prompts, params, use_tqdm=False)] for kw in ({}, {"max_num_batched_tokens": 7})]
    assert runs[0] == runs[1] and len({t for r in runs[0] for t in r}) > 5


@pytest.mark.slow
def test_small_variant_compiles_one_graph(inductor_cache):
    """qwen3-moe-small compiled: one graph, no breaks, no recompiles, eager's tokens."""
    from tests.test_compile import test_compiled_equals_eager_one_graph_no_recompiles as check
    check(str(ZOO / "qwen3-moe-small.yaml"), inductor_cache)
