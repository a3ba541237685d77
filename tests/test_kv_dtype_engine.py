"""KV cache dtypes through the whole engine (`kv_cache_dtype`, cache/kv_dtype.py): block
counts follow the page bytes, greedy output does not depend on chunking or prefix hits with
bf16 / int8 pages, prefix-cache hit counts are the same for every KV dtype, the host tier
round-trips bf16 and int8 pages (scales included) exactly, and MLA / sliding / Mamba2 hybrid
engines run with bf16 KV while their states stay float32."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.test_kv_tiers import TIGHT, assert_tiers_exercised, chat
from tests.zoo_parity import assert_all_free, tight_pool_blocks

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
SHARED = list(range(3, 3 + 40))       # a 40-token prefix: two full blocks to hit
PROMPTS = [SHARED + [50 + i] * (3 + 7 * i) for i in range(3)] + [list(range(60, 65))]


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                         use_tqdm=False)]


def test_block_counts_and_buffers_follow_kv_dtype():
    """smollm2-tiny: 2 layers, 2 kv heads of 16, blocks of 16. Pages: fp32 4096 B, bf16 2048,
    int8 1024 + 256 of scales = 1280; a block holds both layers, so 1 MiB buys 1048576 // 8192 =
    128, // 4096 = 256 and // 2560 = 409 blocks. The runner allocates exactly that and types
    the attention pages accordingly."""
    want = {"auto": (128, torch.float32), "float32": (128, torch.float32), "bfloat16": (256, torch.bfloat16),
            "int8": (409, torch.int8)}
    for name, (blocks, dtype) in want.items():
        llm = LLM("zoo/smollm2-tiny.yaml", kv_cache_memory=1 << 20, kv_cache_dtype=name)
        cfg = llm.engine.kv_manager.config
        runner = llm.engine.runner
        assert cfg.num_blocks == blocks, name
        assert sum(b.numel() for b in runner.kv_buffers) == blocks * cfg.bytes_per_block <= 1 << 20
        assert {c.dtype for c in runner.kv_caches} == {dtype}


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype must be one of auto, float32, bfloat16, int8, fp8_e4m3"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype fp8_e4m3 needs device='cuda'"),
])
def test_bad_kv_cache_dtype_is_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        LLM("zoo/smollm2-tiny.yaml", **kwargs)
    assert "\n" not in str(e.value)


def test_int8_refused_for_latent_caches_in_one_line():
    with pytest.raises(ValueError, match=r"kv_cache_dtype int8: cache 0 \(MLASpec\) has no per-token scales") as e:
        LLM("zoo/deepseek-v3-small.yaml", kv_cache_dtype="int8")
    assert "\n" not in str(e.value)


def test_greedy_unchanged_by_chunking_and_hits_per_kv_dtype():
    """Each KV dtype: the same greedy tokens whether prompts prefill in one step or in chunks of
    16 (int8 scales are per token, so a token's bytes never depend on the split), from prefix
    hits or recomputed; the hit counts are the same for every dtype; every block returns to the
    pool. (How often bf16 / int8 pages change the tokens of the real SmolLM2: bench.kv_dtype.)"""
    outs, hits = {}, {}
    for name in ("float32", "bfloat16", "int8"):
        runs = []
        for budget in (2048, 16):
            llm = LLM("zoo/smollm2-tiny.yaml", max_model_len=256, max_num_batched_tokens=budget,
                      kv_cache_dtype=name)
            runs.append(_generate(llm))
            if budget == 2048:    # again: now every prompt hits what the first run cached
                before = llm.engine.kv_manager.prefix_cache_hits
                runs.append(_generate(llm))
                hits[name] = (before, llm.engine.kv_manager.prefix_cache_hits - before)
            assert_all_free(llm)
        assert all(r == runs[0] for r in runs), name
        outs[name] = runs[0]
    # First run: all prompts in one step, nothing cached yet. Second: prompts of 43, 50, 57 and 5
    # tokens hit their full prompt blocks (a hit leaves at least one token): 32 + 48 + 48 + 0.
    assert hits["float32"] == hits["bfloat16"] == hits["int8"] == (0, 128)
    assert len({t for toks in outs["float32"] for t in toks}) > 5          # the model does not collapse


@pytest.mark.parametrize("name", ["bfloat16", "int8"])
def test_host_tier_round_trips_pages_exactly(tiny_hf, name):
    """The multi-turn chat of test_kv_tiers with a pool too small for it: evicted pages go to
    the host tier and come back as hits, preempted requests swap out and back in. The answers
    equal those of a roomy pool without a tier only if every page came back bit for bit (int8:
    its scales too, in the same payload)."""
    path, _ = tiny_hf("llama")
    want = chat(LLM(path, **TIGHT, num_kv_blocks=400, kv_cache_dtype=name))
    blocks = tight_pool_blocks(path, TIGHT["max_model_len"], TIGHT["max_num_batched_tokens"])
    on = LLM(path, **TIGHT, num_kv_blocks=blocks, kv_host_tier_bytes=1 << 24, preemption_mode="auto",
             swap_min_tokens=24, kv_cache_dtype=name)
    assert chat(on) == want
    assert_tiers_exercised(on)
    cfg = on.engine.kv_manager.config
    assert cfg.groups[0].spec.dtype == {"bfloat16": torch.bfloat16, "int8": torch.int8}[name]
    span = sum(b for _, b in cfg.group_spans(0))
    assert span == len(cfg.groups[0].layer_ids) * cfg.groups[0].spec.page_size_bytes   # int8: scales inside


@pytest.mark.parametrize("spec", ["zoo/bamba-small.yaml", "zoo/deepseek-v3-small.yaml", "zoo/mistral-sw-small.yaml"])
def test_hybrid_mla_and_sliding_engines_with_bf16_kv(spec):
    """Mamba2 + attention, MLA latents, sliding window: bf16 KV pages (states stay float32),
    greedy output the same in one step and in chunks of 16."""
    runs = []
    for budget in (2048, 16):
        llm = LLM(spec, max_model_len=160, max_num_batched_tokens=budget, kv_cache_dtype="bfloat16")
        runs.append(_generate(llm))
        assert_all_free(llm)
    assert runs[0] == runs[1]
    assert len({t for toks in runs[0] for t in toks}) > 5
    from cache.kv_cache_spec import StateSpec
    for g in llm.engine.kv_manager.config.groups:
        assert g.spec.dtype == (torch.float32 if isinstance(g.spec, StateSpec) else torch.bfloat16)


def test_int8_kv_with_mamba2_states():
    """int8 attention pages beside float32 Mamba2 states in one pool: chunking still changes nothing."""
    runs = [_generate(LLM("zoo/bamba-small.yaml", max_model_len=160, max_num_batched_tokens=b, kv_cache_dtype="int8"))
            for b in (2048, 16)]
    assert runs[0] == runs[1]
