"""Prompt logprobs (runtime/worker/prompt_logprobs.py): each prompt token's logprob, rank and
top-k equal HF's full forward; chunked prefill, preemption and n > 1 give the same entries;
a request asking for them is never served by the prefix cache, and leaks no block. Runs that
batch the prompt differently agree on every token and rank and to fp32 rounding in value."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.limits import ParamError

K = 3


@pytest.fixture(scope="module")
def llama(tiny_hf):
    return tiny_hf("llama")


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_reference(model, prompt):
    """(logprob of token j given tokens < j, its rank, top-K ids) for j = 1.. from one HF forward."""
    with torch.no_grad():
        lp = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    target = torch.tensor(prompt[1:])[:, None]
    chosen = lp.gather(-1, target)
    return chosen[:, 0], ((lp > chosen).sum(-1) + 1), lp.topk(K, dim=-1).indices


def _entries(out, prompt):
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None
    chosen = torch.tensor([pl[j][prompt[j]].logprob for j in range(1, len(prompt))])
    ranks = torch.tensor([pl[j][prompt[j]].rank for j in range(1, len(prompt))])
    # The top-K first (best first), then the prompt token if it is not among them.
    tops = torch.tensor([list(pl[j])[:K] for j in range(1, len(prompt))])
    return chosen, ranks, tops


def _assert_same(a, b):
    """Two requests' prompt logprobs: the same tokens with the same ranks at every position, and
    logprobs equal to fp32 rounding (a chunk's GEMMs reduce in another order than the whole
    prompt's, so the last bits may differ)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert list(x) == list(y) and [v.rank for v in x.values()] == [v.rank for v in y.values()]
        torch.testing.assert_close(torch.tensor([v.logprob for v in x.values()]),
                                   torch.tensor([v.logprob for v in y.values()]), atol=1e-5, rtol=0)


def _run(path, prompts, params, **engine):
    llm = LLM(path, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def test_prompt_logprobs_equal_hf_and_chunking_changes_nothing(llama):
    path, model = llama
    prompts = [_prompt(45), _prompt(2, seed=2), _prompt(30, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)
    _, whole = _run(path, prompts, params)
    for p, out in zip(prompts, whole):
        chosen, ranks, tops = _entries(out, p)
        want_lp, want_rank, want_top = _hf_reference(model, p)
        torch.testing.assert_close(chosen, want_lp, atol=1e-4, rtol=0)
        assert ranks.tolist() == want_rank.tolist()
        assert ranks.min() >= 1 and ranks.max() > K, "some prompt token must fall outside the top-K"
        assert tops.tolist() == want_top.tolist()
    for chunk in (16, 7):
        llm, chunked = _run(path, prompts, params, max_num_batched_tokens=chunk, max_num_seqs=3)
        for a, b in zip(whole, chunked):
            _assert_same(b.prompt_logprobs, a.prompt_logprobs)
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
        stats = llm.kv_cache_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]


def test_prompt_logprobs_skip_the_prefix_cache(llama):
    path, _ = llama
    prompt = _prompt(40, seed=4)
    llm = LLM(path)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    asking = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)       # fills the cache
    hits = llm.kv_cache_stats()["prefix_cache_hits"]
    out = llm.generate([{"prompt_token_ids": prompt}], asking, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and llm.kv_cache_stats()["prefix_cache_hits"] == hits
    assert all(set(d) == {prompt[j]} for j, d in enumerate(out.prompt_logprobs) if j)   # k=0: the token alone
    _, fresh = _run(path, [prompt], asking)
    assert out.prompt_logprobs == fresh[0].prompt_logprobs
    again = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32        # the cache still serves the others (two full blocks)
    assert again.prompt_logprobs is None


def test_prompt_logprobs_with_samples_and_preemption(llama):
    path, _ = llama
    prompts = [_prompt(40, seed=5), _prompt(37, seed=6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
    _, ref = _run(path, prompts, params)
    # Two 60-token requests in 6 blocks of 16: one is preempted mid-run and recomputes its prompt.
    llm, tight = _run(path, prompts, params, num_kv_blocks=6, max_num_batched_tokens=16,
                     max_model_len=64, enable_prefix_caching=False)
    assert llm.kv_cache_stats()["num_preemptions"] > 0
    for a, b in zip(tight, ref):
        _assert_same(a.prompt_logprobs, b.prompt_logprobs)
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4, prompt_logprobs=2)
    llm, outs = _run(path, prompts[:1], sampled)
    assert len(outs[0].outputs) == 3
    _assert_same(outs[0].prompt_logprobs, ref[0].prompt_logprobs)
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_prompt_logprobs_bounds():
    with pytest.raises(ParamError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)
    with pytest.raises(ParamError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)
