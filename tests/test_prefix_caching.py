"""Prefix caching for every layer kind: exact hit accounting, greedy output identical with
caching on and off, LRU eviction, salts, state checkpoints for Mamba2 / Gated DeltaNet."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _gen(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("shared_blocks", [1, 3, 10])
def test_hits_are_exact(tiny_hf, shared_blocks):
    llm = LLM(tiny_hf("llama")[0])
    base = _ids(shared_blocks * 16 + 9, seed=1)                 # k full blocks + a partial one
    first = base + _ids(5, seed=2)
    second = base[: shared_blocks * 16 + 4] + _ids(7, seed=3)   # diverges mid-block k+1
    _gen(llm, [first])
    s0 = llm.kv_cache_stats()
    assert s0["prefix_cache_hits"] == 0 and s0["prefix_cache_queries"] == len(first)
    _gen(llm, [second])
    s1 = llm.kv_cache_stats()
    assert s1["prefix_cache_hits"] == shared_blocks * 16
    assert s1["prefix_cache_queries"] == len(first) + len(second)
    assert s1["num_free_blocks"] == s1["num_blocks"] and s1["cached_blocks"] > 0


def test_identical_prompt_leaves_one_token_to_compute(tiny_hf):
    llm = LLM(tiny_hf("llama")[0])
    p = _ids(48, seed=4)                                         # exactly 3 blocks
    a = _gen(llm, [p])
    b = _gen(llm, [p])
    assert a == b
    assert llm.kv_cache_stats()["prefix_cache_hits"] == 32      # the last block is recomputed


def test_blocks_filled_while_decoding_are_published(tiny_hf):
    """Decode publishes a block on the step that fills it (hashing is skipped on the other
    steps): a prompt that repeats a finished request's prompt + output hits every full block."""
    llm = LLM(tiny_hf("llama")[0])
    p = _ids(10, seed=12)
    # 10 + 39 - 1 = 48 computed tokens: the last step fills block 3 and the request ends there.
    out = _gen(llm, [p], SamplingParams(temperature=0, max_tokens=39, ignore_eos=True))[0]
    assert llm.kv_cache_stats()["cached_blocks"] == 3
    _gen(llm, [p + out[:38] + _ids(5, seed=13)])
    assert llm.kv_cache_stats()["prefix_cache_hits"] == 48


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3"])
def test_greedy_equal_with_caching_on_and_off(tiny_hf, family):
    path, _ = tiny_hf(family)
    shared = _ids(10 * 16, seed=5)
    prompts = [shared[:16] + _ids(9, 6), shared[:16 + 5] + _ids(3, 7), shared[:48] + _ids(20, 8),
               shared[:48 + 7] + _ids(4, 9), shared + _ids(2, 10), shared[:150] + _ids(11, 11),
               shared[:16] + _ids(9, 6)]
    off = _gen(LLM(path, enable_prefix_caching=False), prompts)
    on = LLM(path, max_num_batched_tokens=40)
    assert _gen(on, prompts) == off                  # one batch: hits between waves of admission
    assert _gen(on, prompts) == off                  # again: everything hits
    stats = on.kv_cache_stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    # Preempting under a tight pool still matches (resumed requests hit their own blocks).
    # Pools just above one 200-token request (sliding groups hold their window + a chunk).
    blocks = {"llama": 16, "qwen3": 16, "mistral": 12, "gemma3": 41}[family]
    tight = LLM(path, num_kv_blocks=blocks, max_model_len=200, max_num_batched_tokens=32)
    assert _gen(tight, prompts) == off
    assert tight.kv_cache_stats()["num_preemptions"] > 0


def test_lru_eviction_and_salt(tiny_hf):
    llm = LLM(tiny_hf("llama")[0], num_kv_blocks=33, max_model_len=256)
    a = _ids(64, seed=20)
    _gen(llm, [a])
    for seed in range(21, 26):          # fill the pool with other prompts: a's blocks get evicted
        _gen(llm, [_ids(100, seed)])
    stats = llm.kv_cache_stats()
    assert stats["evictions"] > 0 and stats["cached_blocks"] <= stats["num_blocks"]
    before = stats["prefix_cache_hits"]
    _gen(llm, [a])
    assert llm.kv_cache_stats()["prefix_cache_hits"] == before      # evicted: no hit
    # A salt keeps identical prompts apart.
    p = _ids(40, seed=30)
    llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)
    h0 = llm.kv_cache_stats()["prefix_cache_hits"]
    llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)
    assert llm.kv_cache_stats()["prefix_cache_hits"] == h0
    llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)
    assert llm.kv_cache_stats()["prefix_cache_hits"] == h0 + 32


@pytest.mark.parametrize("family", ["bamba", "qwen3_next", "granite"])
@pytest.mark.parametrize("shared_blocks", [1, 3])
def test_state_hybrids_hit_at_checkpoints(tiny_hf, family, shared_blocks):
    """State layers keep a checkpoint at each prompt's last full block: a second request
    that shares those k blocks hits exactly k * 16 tokens, and its output is unchanged."""
    path, _ = tiny_hf(family)
    first = _ids(shared_blocks * 16 + 5, seed=60)
    second = first[: shared_blocks * 16] + _ids(9, seed=61)
    off = _gen(LLM(path, enable_prefix_caching=False), [first, second])
    llm = LLM(path)
    assert _gen(llm, [first]) == off[:1]
    assert llm.kv_cache_stats()["prefix_cache_hits"] == 0
    assert _gen(llm, [second]) == off[1:]
    stats = llm.kv_cache_stats()
    assert stats["prefix_cache_hits"] == shared_blocks * 16
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("family", ["bamba", "qwen3_next"])
def test_state_hybrids_checkpoint_at_branch_points(tiny_hf, family):
    """A prompt that shares 3 blocks with a cached one but diverges before that prompt's
    checkpoint hits nothing itself, yet saves a checkpoint at the branch point: the next
    prompt with the same 3-block prefix hits exactly 48 tokens."""
    path, _ = tiny_hf(family)
    base = _ids(3 * 16 + 5, seed=80)                          # 3 full blocks, then diverge mid-block
    prompts = [base + _ids(20, 81), base[:50] + _ids(15, 82), base[:52] + _ids(11, 83)]
    off = _gen(LLM(path, enable_prefix_caching=False), prompts)
    llm = LLM(path)
    hits = []
    for p, ref in zip(prompts, off):
        assert _gen(llm, [p]) == [ref]
        hits.append(llm.kv_cache_stats()["prefix_cache_hits"])
    assert hits == [0, 0, 48]
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("family", ["bamba", "qwen3_next"])
def test_state_hybrids_equal_with_caching_on_and_off(tiny_hf, family):
    path, _ = tiny_hf(family)
    shared = _ids(10 * 16, seed=70)
    prompts = [shared[:32] + _ids(5, 71), shared[:32] + _ids(9, 72), shared + _ids(3, 73),
               shared + _ids(12, 74), shared[:100] + _ids(4, 75)]
    off = _gen(LLM(path, enable_prefix_caching=False), prompts)
    on = LLM(path, max_num_batched_tokens=24)
    assert _gen(on, prompts) == off
    assert _gen(on, prompts) == off
    assert on.kv_cache_stats()["prefix_cache_hits"] > 0
    tight = LLM(path, num_kv_blocks=30, max_model_len=200, max_num_batched_tokens=32)
    assert _gen(tight, prompts) == off
    assert tight.kv_cache_stats()["num_preemptions"] > 0
    stats = tight.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("spec", ["zoo/smollm2-135m.yaml", "zoo/gemma3-270m.yaml"])
def test_real_models_equal_with_caching_on_and_off(spec):
    """A shared system prompt (longer than Gemma's 512 window in the last case), distinct
    questions diverging mid-block: identical greedy text with the cache on."""
    system = "You are a careful assistant who answers in one short sentence. " * 4
    long_doc = "The river flows north through the valley and past the old mill. " * 45
    prompts = [system + "Question: what colour is the sky?", system + "Question: what is two plus two?",
               system + "Question: name a fruit.", long_doc + "Where does the river flow?",
               long_doc + "What stands by the river?"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    off = LLM(spec, enable_prefix_caching=False, max_model_len=1024)
    on = LLM(spec, max_model_len=1024, max_num_batched_tokens=256)
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert len(on.get_tokenizer().encode(long_doc)) > 512
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert on.kv_cache_stats()["prefix_cache_hits"] >= 3 * 32


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_equal_separate_seeded_requests_and_share_the_prompt(tiny_hf, caching):
    path, _ = tiny_hf("llama")
    prompt = _ids(16 * 3 + 5, seed=50)            # 3 full prompt blocks + a partial one
    params = SamplingParams(n=4, temperature=1.0, top_k=40, seed=100, max_tokens=10, ignore_eos=True)
    llm = LLM(path, enable_prefix_caching=caching)
    engine = llm.engine
    ids = engine.add_request(engine.make_request({"prompt_token_ids": prompt}, params))
    assert ids[1:] == [f"{ids[0]}#{i}" for i in range(1, 4)]
    shared_seen = False
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        tables = [engine.kv_manager.get_block_ids(i)[0] for i in ids if i in engine.scheduler.requests]
        if len(tables) == 4 and all(len(t) >= 4 for t in tables):
            assert len({tuple(t[:3]) for t in tables}) == 1      # the 3 full prompt blocks, stored once
            blocks = engine.kv_manager.pool.blocks
            assert all(blocks[b].ref_cnt == 4 for b in tables[0][:3])
            shared_seen = True
    assert shared_seen
    # Forked after 52 prompt tokens: each sample copied the partial 4th block once.
    stats = llm.kv_cache_stats()
    assert (stats["forks"], stats["fork_copied_blocks"]) == (3, 3)
    samples = [outs[i] for i in ids]
    assert len({tuple(s) for s in samples}) == 4
    separate = [LLM(path).generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=1.0, top_k=40, seed=100 + i, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0].token_ids for i in range(4)]
    assert samples == separate
    merged = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.index for c in merged.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in merged.outputs] == separate
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("family", ["mistral", "bamba", "qwen3_next"])
@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_fork_every_layer_kind(tiny_hf, family, caching):
    """Forks share or copy every kind of group (sliding blocks, Mamba2 / DeltaNet states):
    n seeded samples equal n separate requests, with or without the prefix cache."""
    path, _ = tiny_hf(family)
    prompt = _ids(16 * 2 + 7, seed=51)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    llm = LLM(path, enable_prefix_caching=caching, max_model_len=128)
    got = [c.token_ids for c in llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs]
    stats = llm.kv_cache_stats()
    assert stats["forks"] == 2 and stats["fork_copied_blocks"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    ref_llm = LLM(path, enable_prefix_caching=False, max_model_len=128)
    ref = [ref_llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=1.0, seed=7 + i, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
        for i in range(3)]
    assert got == ref
    assert len({tuple(s) for s in got}) == 3
