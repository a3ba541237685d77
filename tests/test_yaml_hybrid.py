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
# Kinds mixed, one entry per layer, in an order no zoo file uses: sliding, parallel attention
# + Mamba2, latent attention (MLA, a smaller page packed beside the others), DeltaNet, an
# MLP-only layer, a short convolution and Mamba2 without MLPs, NoPE attention, Kimi's KDA,
# MiniMax's lightning attention, MLA again.
KINDS = ["sliding_attention", "full_attention+mamba2", "mla", "gated_deltanet", "none", "short_conv", "mamba2",
         "full_attention_nope", "kda", "lightning_attention", "mla"]
FFN = ["mlp", "mlp", "moe", "mlp", "mlp", "none", "none", "moe", "mlp", "moe", "mlp"]
SPEC = {
    "name": "yaml-hybrid", "vocab_size": 512, "hidden_size": 64,
    "layers": {"num": len(KINDS), "kinds": KINDS, "ffn": FFN},
    "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "sliding_window": 20, "qk_norm": True},
    "mamba2": {"num_heads": 4, "head_dim": 16, "state_size": 16, "chunk_size": 8},
    "gated_deltanet": {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16},
    "mla": {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 12},
    "short_conv": {"kernel": 3},
    "kda": {"num_heads": 4, "head_dim": 16},
    "lightning_attention": {"num_heads": 4, "head_dim": 16},
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
    """One cache per mixer in cache-id order (the parallel layer has two, the MLP-only layer
    none); the MLA group's smaller pages are packed beside the others; the layers with no FFN
    have no post-mixer norm."""
    llm = LLM(spec_path)
    spec, model = llm.engine.spec, llm.engine.runner.model
    assert spec.cache_layers() == [(0, "sliding_attention"), (1, "full_attention"), (1, "mamba2"), (2, "mla"),
                                   (3, "gated_deltanet"), (5, "short_conv"), (6, "mamba2"),
                                   (7, "full_attention_nope"), (8, "kda"), (9, "lightning_attention"), (10, "mla")]
    assert len(llm.engine.runner.kv_caches) == 11
    assert sorted(model.state_mixers()) == [2, 4, 5, 6, 8, 9]
    cfg = llm.engine.kv_manager.config
    groups: dict[str, list[int]] = {}
    for g in cfg.groups:
        groups.setdefault(type(g.spec).__name__, []).extend(g.layer_ids)
    assert {k: sorted(v) for k, v in groups.items()} == {
        "SlidingWindowSpec": [0], "FullAttentionSpec": [1, 7], "MLASpec": [3, 10], "StateSpec": [2, 4, 5, 6, 8, 9]}
    mla = next(g for g in cfg.groups if type(g.spec).__name__ == "MLASpec")
    assert mla.spec.page_size_bytes == 16 * (16 + 16) * 4 == cfg.page_size_bytes // 2
    slots = cfg.group_slots(mla)                  # its two layers share one pool page
    assert len({buf for buf, _ in slots}) == 1 and sorted(off for _, off in slots) == [0, mla.spec.page_size_bytes]
    assert model.layers[4].mixer is None and model.layers[4].self_attn is None
    for i in (5, 6):
        assert model.layers[i].mlp is None and not hasattr(model.layers[i], "post_attention_layernorm")


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


def test_readme_example_builds():
    """The README's new-hybrid YAML parses and lays out (shapes only, on the meta device)."""
    import re
    from pathlib import Path

    from cache.sizing import make_kv_cache_config
    from models import build_model
    from models.spec import DTYPES, spec_from_dict
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("### A new hybrid architecture, in YAML only"):]
    data = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    spec = spec_from_dict(data)
    kinds = {k for i in range(spec.num_layers) for k in spec.layer_mixers(i)}
    assert kinds == {"kda", "mla", "mamba2", "sliding_attention", "lightning_attention"}
    model = build_model(spec, device="meta")
    config = make_kv_cache_config(model.kv_cache_specs(16, DTYPES[spec.dtype]), 16, memory_bytes=8 << 30,
                                  min_tokens=spec.max_model_len, chunk_tokens=2048)
    assert len(config.groups) >= 5 and config.num_blocks > 100
