"""The zoo: every spec loads; the small variants run; a YAML-only architecture mixing every
layer kind in a new order matches an unbatched full-recompute run of the same model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models import WeightError, load_spec
from runtime import LLM, SamplingParams

ZOO = Path(__file__).resolve().parent.parent / "zoo"
SMALL = ["smollm2-tiny", "mistral-sw-small", "bamba-small", "granite-hybrid-small", "qwen3-next-small",
         "lfm2-small", "smollm3-small", "olmo-hybrid-small", "gpt-oss-small",
         "nemotron-h-small", "falcon-h1-small", "deepseek-v3-small",
         "kimi-linear-small", "deepseek-v4-small"]


@pytest.mark.parametrize("path", sorted(ZOO.glob("*.yaml")), ids=lambda p: p.stem)
def test_zoo_spec_loads(path):
    spec = load_spec(path)
    assert len(spec.layer_kinds) == spec.num_layers


def test_qwen3_next_real_dimensions():
    spec = load_spec(ZOO / "qwen3-next.yaml")
    assert spec.num_layers == 48
    assert [i for i, k in enumerate(spec.layer_kinds) if k == "full_attention"] == list(range(3, 48, 4))
    assert spec.moe.num_experts == 512 and spec.attention.output_gate


def test_missing_weights_point_to_dummy_variant():
    with pytest.raises(WeightError, match=r"qwen3-next\.yaml: checkpoint\.path: no such directory .*"
                                          r"zoo/qwen3-next-small\.yaml"):
        LLM(ZOO / "qwen3-next.yaml")


@pytest.mark.parametrize("name", SMALL)
def test_small_variants_generate(name):
    llm = LLM(ZOO / f"{name}.yaml", max_model_len=256)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in LLM(ZOO / f"{name}.yaml", max_model_len=256, max_num_batched_tokens=7)
         .generate(prompts, params, use_tqdm=False)]
    assert a == b and all(len(t) == 12 for t in a)
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


MIXED = """
name: mixed-order
vocab_size: 256
hidden_size: 64
layers:
  num: 8
  pattern: [mamba2, sliding_attention, full_attention, gated_deltanet]
attention: {num_heads: 4, num_kv_heads: 2, head_dim: 16, sliding_window: 12}
mamba2: {num_heads: 4, head_dim: 16, state_size: 8, chunk_size: 4}
gated_deltanet: {num_k_heads: 2, num_v_heads: 4, head_k_dim: 16, head_v_dim: 16}
mlp: {intermediate_size: 96}
max_model_len: 96
checkpoint: {source: dummy, seed: 7, init_std: 0.15}
"""


def test_yaml_only_hybrid_matches_full_recompute(tmp_path):
    """No zoo file uses this order. Paged + batched + chunked (+ preempted) greedy decoding
    must equal re-running the whole sequence from scratch for every token, one request at a
    time (fresh state, no cache reuse)."""
    spec = tmp_path / "mixed.yaml"
    spec.write_text(MIXED)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (3, 17, 33, 50)]
    new = 10
    fresh = LLM(spec)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ref = []
    for p in prompts:
        seq = list(p)
        for _ in range(new):
            seq += fresh.generate({"prompt_token_ids": seq}, one, use_tqdm=False)[0].outputs[0].token_ids
        ref.append(seq[len(p):])
    assert len({tuple(r) for r in ref}) == len(ref)
    # one group per kind, 2 layers each, mapped onto 2 shared buffers
    llm = LLM(spec, max_num_batched_tokens=9, num_kv_blocks=14)
    kv = llm.engine.kv_manager.config
    assert len(kv.groups) == 4 and kv.num_buffers == 2
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                       use_tqdm=False)]
    assert got == ref
    assert llm.kv_cache_stats()["num_preemptions"] > 0
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_capacity_counts_every_group():
    llm = LLM(ZOO / "qwen3-next-small.yaml", num_kv_blocks=201, max_num_batched_tokens=64)
    cfg = llm.engine.kv_manager.config
    # 2 full layers -> 1 group; 6 gated_deltanet layers -> 3 groups of 2; 2 buffers.
    assert [type(g.spec).__name__ for g in cfg.groups].count("StateSpec") == 3
    state_pages = cfg.groups[0].spec.pages
    per_request = 3 * state_pages + 1000 // 16 + 1           # 3 state groups + 63 KV blocks
    assert llm.kv_cache_capacity(1000) == 200 // per_request
