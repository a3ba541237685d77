"""A draft model that lags while its requests do not speculate (DraftModel.may_lag).

The draft skips the committed tokens of requests that draft nothing this step, and the next
proposal's catch-up forward computes them. Prefix caching publishes every full block of
committed tokens and state checkpoints lie on block boundaries, so the draft still catches
up in every step that publishes a block past what it has computed. The tests switch
speculation off for stretches of steps (the decoder's per-request k forced to 0) and check:
the output equals HF's; the target as its own draft accepts every draft (a draft that
skipped a token would stray); published blocks hold the draft's KV; prefix hits in a
second wave accept as much as the first; exact draft forward counts; and no leaked block.
"""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.conftest import TINY_VOCAB
from tests.test_parity import NEW, _prompts
from tests.test_spec_decode import _all_free, _run
from tests.test_spec_draft import _draft, _stats, near, reference  # noqa: F401 (fixtures)

torch.set_num_threads(1)


def off_for_stretches(llm, period: int = 8, off: int = 4, after: int | None = None) -> None:
    """No request drafts in the first `off` steps of every `period` (as when the cost
    model's cap is 0) nor from engine step `after` on, the configured k in the others."""
    dec = llm.engine.spec_decoder
    k = type(dec)._k.__get__(dec)             # the decoder's own, also when called again
    dec._k = lambda req, *a, **kw: 0 if dec.steps % period < off or (after is not None and dec.steps >= after) \
        else k(req, *a, **kw)


def _published_blocks(llm) -> list[int]:
    return sorted({b.block_id for b in llm.engine.kv_manager.pool.cached.values()})


def _assert_draft_kv_is_targets(llm, blocks: list[int]) -> None:
    """The target as its own draft: the draft's KV equals the target's in `blocks`."""
    caches, offset = llm.engine.runner.kv_caches, llm.engine.runner.draft.offset
    idx = torch.tensor(blocks)
    for cid in range(offset):
        torch.testing.assert_close(caches[offset + cid][idx], caches[cid][idx], atol=1e-4, rtol=1e-4)


def _accepted_all(llm) -> None:
    s = _stats(llm)
    assert s["spec_decode_num_draft_tokens"] > 0
    assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"], s


@pytest.mark.parametrize("family", ["llama", "bamba"])
def test_lagging_draft_equal_to_the_target_accepts_everything(reference, family):
    """Speculation on for a few steps only, then off to the end (the requests finish with
    the draft behind), then a second wave off 4 steps in 8, prefix caching on, the target (attention; Mamba2 hybrid) as its
    own draft: HF's output, every draft accepted, published blocks holding the draft's KV, a
    second wave served from the prefix cache with every draft accepted, fewer draft
    forwards than a draft that never lags, no leaked block."""
    path, prompts, ref = reference(family)
    runs = {}
    for lag in (False, True):
        llm = LLM(path, speculative=_draft(path), enable_prefix_caching=True)
        llm.engine.runner.draft.lag = lag and llm.engine.runner.draft.lag
        assert llm.engine.runner.draft.lag == lag           # the set-up permits lag
        off_for_stretches(llm, period=1000, off=2, after=4)   # drafts in steps 2-3 only
        assert _run(llm, prompts) == ref
        steps = llm.engine.spec_decoder.steps
        assert steps >= 4 + 16                  # the off tail: every request crossed a block boundary
        _accepted_all(llm)
        runs[lag] = llm.engine.runner.draft.num_forwards
        if family == "llama":
            _assert_draft_kv_is_targets(llm, _published_blocks(llm))
        hits = _stats(llm)["prefix_cache_hits"]
        off_for_stretches(llm, after=steps + 1000)
        assert _run(llm, prompts) == ref                     # the second wave hits the prefix cache
        assert _stats(llm)["prefix_cache_hits"] > hits
        _accepted_all(llm)
        _all_free(llm)
    assert runs[True] < runs[False], runs


def test_samples_forked_from_a_lagging_parent_accept_everything(reference):
    """n = 2 greedy samples without prefix caching (the draft lags wherever it may): the
    parent's prefill stops at the fork point, short of its tokens, and the draft computes
    it, so both samples start from the draft's KV of the prompt and accept every draft."""
    path, prompts, ref = reference("llama")
    llm = LLM(path, speculative=_draft(path))
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in ref]
    _accepted_all(llm)
    _all_free(llm)


@pytest.mark.parametrize("draft", ["qwen3", "bamba"])
def test_lagging_wrong_draft_changes_nothing(tiny_hf, reference, draft):
    """An unrelated draft (its own attention groups; a Mamba2 hybrid with state groups) for
    Llama, lagging in the off stretches, with prefix caching and n = 2 samples in a second
    wave: the output equals HF's, no leaked block."""
    path, prompts, ref = reference("llama")
    llm = LLM(path, speculative=_draft(tiny_hf(draft)[0]), enable_prefix_caching=True)
    assert llm.engine.runner.draft.lag
    off_for_stretches(llm)
    assert _run(llm, prompts) == ref
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in ref]
    assert _stats(llm)["prefix_cache_hits"] > 0 and _stats(llm)["spec_decode_num_draft_tokens"] > 0
    _all_free(llm)


def test_lagging_near_draft_under_preemption_and_chunking(reference, near):
    """A tight pool (preemption by recompute) and 16-token steps, speculation off in stretches:
    HF's output, no leaked block."""
    path, prompts, ref = reference("llama")
    llm = LLM(path, speculative=_draft(near("llama")), num_kv_blocks=12, max_model_len=160,
              max_num_batched_tokens=16)
    off_for_stretches(llm, period=6, off=3)
    assert _run(llm, prompts) == ref
    assert _stats(llm)["num_preemptions"] > 0
    _all_free(llm)


@pytest.mark.parametrize("caching", [False, True])
def test_a_draft_that_never_speculates_runs_only_where_blocks_are_published(tiny_hf, caching):
    """Speculation always off: without prefix caching the draft never runs. With it, it runs
    once in each step that publishes a block past what it computed: the prefill (a prompt
    of at least one block) and every decode step whose computed tokens end on a block
    boundary. The published blocks then hold the draft's KV (the target is the draft)."""
    path, _ = tiny_hf("llama")
    prompt = _prompts(TINY_VOCAB)[5]                 # 40 tokens
    new = 40
    llm = LLM(path, speculative=_draft(path), enable_prefix_caching=caching)
    off_for_stretches(llm, period=1, off=1)
    _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=new, min_tokens=new))
    draft = llm.engine.runner.draft
    assert _stats(llm)["spec_decode_num_draft_tokens"] == 0
    # decode steps compute positions len(prompt) .. len(prompt) + new - 2, ending at end = pos + 1
    boundaries = sum(end % 16 == 0 for end in range(len(prompt) + 1, len(prompt) + new))
    assert draft.num_forwards == (1 + boundaries if caching else 0)
    if caching:
        blocks = _published_blocks(llm)
        assert len(blocks) == (len(prompt) + new - 1) // 16
        _assert_draft_kv_is_targets(llm, blocks)
    _all_free(llm)


def test_no_lag_with_swap_preemption_or_a_sliding_draft(tiny_hf):
    """Swapped-out pages come back as computed, and a sliding draft group frees its old
    blocks by the target's count: neither set-up lets the draft lag."""
    path, _ = tiny_hf("llama")
    swap = LLM(path, speculative=_draft(path), enable_prefix_caching=True, kv_host_tier_bytes=1 << 20,
               preemption_mode="swap")
    assert not swap.engine.runner.draft.lag
    sliding = LLM(path, speculative=_draft(tiny_hf("mistral")[0]))
    assert not sliding.engine.runner.draft.lag
    assert LLM(path, speculative=_draft(path), enable_prefix_caching=True, kv_host_tier_bytes=1 << 20,
               preemption_mode="recompute").engine.runner.draft.lag
