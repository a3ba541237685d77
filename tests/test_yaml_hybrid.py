"""A hybrid that exists only as YAML: layer kinds mixed in an order no zoo file uses, with
mixer-less (MLP-only) and FFN-less (mixer-only) layers and parallel mixers, built with seeded
dummy weights. Its paged, batched, chunked and preempted greedy output must equal a full
recompute: every token produced by a fresh prefill of the whole sequence so far, with no
cache carried between steps."""
from __future__ import annotations

import pytest
import yaml

from runtime import LLM, SamplingParams
from tests.zoo_parity import assert_all_free, tight_pool_blocks

NEW = 12
# Kinds mixed, one entry per layer: sliding, parallel attention + Mamba2, DeltaNet, an
# MLP-only layer, Mamba2 without an MLP, full attention, DeltaNet.
KINDS = ["sliding_attention", "full_attention+mamba2", "gated_deltanet", "none", "mamba2", "full_attention",
         "gated_deltanet"]
FFN = ["mlp", "mlp", "moe", "mlp", "none", "moe", "mlp"]
SPEC = {
    "name": "yaml-hybrid", "vocab_size": 512, "hidden_size": 64,
    "layers": {"num": len(KINDS), "kinds": KINDS, "ffn": FFN},
    "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "sliding_window": 20, "qk_norm": True},
    "mamba2": {"num_heads": 4, "head_dim": 16, "state_size": 16, "chunk_size": 8},
    "gated_deltanet": {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16},
    "mlp": {"intermediate_size": 96},
    "moe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_expert_intermediate_size": 48},
    "max_model_len": 256, "checkpoint": {"source": "dummy", "init_std": 0.2, "seed": 3},
}
LENGTHS = [1, 9, 16, 23, 37, 50]


def _prompts() -> list[list[int]]:
    return [[(7 * n + 13 * j) % 500 + 3 for j in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("yaml-hybrid") / "hybrid.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


@pytest.fixture(scope="module")
def recompute(spec_path):
    """Greedy tokens by full recompute: each step prefills prompt + tokens so far afresh."""
    llm = LLM(spec_path, enable_prefix_caching=False)
    seqs = _prompts()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(NEW):
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], one, use_tqdm=False)
        seqs = [s + o.outputs[0].token_ids for s, o in zip(seqs, outs)]
    assert_all_free(llm)
    out = [s[n:] for s, n in zip(seqs, LENGTHS)]
    assert len({tuple(o) for o in out}) == len(out) and len({t for o in out for t in o}) > 3 * len(out)
    return out


def test_layout(spec_path):
    """7 mixers in cache-id order (the parallel layer has two, the MLP-only layer none), each
    with its own cache; the layer with no FFN has no post-mixer norm."""
    llm = LLM(spec_path)
    spec, model = llm.engine.spec, llm.engine.runner.model
    assert spec.cache_layers() == [(0, "sliding_attention"), (1, "full_attention"), (1, "mamba2"),
                                   (2, "gated_deltanet"), (4, "mamba2"), (5, "full_attention"), (6, "gated_deltanet")]
    assert len(llm.engine.runner.kv_caches) == 7
    assert sorted(model.state_mixers()) == [2, 3, 4, 6]
    groups = {type(g.spec).__name__: [] for g in llm.engine.kv_manager.config.groups}
    for g in llm.engine.kv_manager.config.groups:
        groups[type(g.spec).__name__] += g.layer_ids
    assert {k: sorted(v) for k, v in groups.items()} == {
        "SlidingWindowSpec": [0], "FullAttentionSpec": [1, 5], "StateSpec": [2, 3, 4, 6]}
    assert model.layers[3].mixer is None and model.layers[3].self_attn is None
    assert model.layers[4].mlp is None and not hasattr(model.layers[4], "post_attention_layernorm")


@pytest.mark.parametrize("engine", [
    dict(),                                                         # batched, paged
    dict(max_num_batched_tokens=7),                                 # chunks off block edges
    "preempt",                                                      # a pool for one request
    dict(max_num_seqs=2),
])
def test_equals_full_recompute(spec_path, recompute, engine):
    if engine == "preempt":
        engine = dict(max_model_len=64, max_num_batched_tokens=16)
        engine["num_kv_blocks"] = tight_pool_blocks(spec_path, engine["max_model_len"], engine["max_num_batched_tokens"])
    llm = LLM(spec_path, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == recompute
    if "num_kv_blocks" in engine:
        assert llm.kv_cache_stats()["num_preemptions"] > 0
    assert_all_free(llm)
