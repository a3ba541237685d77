"""The parity harness every zoo family runs: one tiny random HF model, compared with HF greedy
`generate` token for token under each scheduling regime, and no block leaked after any run.

    ref = reference(hf_model, tmp_dir)             # saves the model, computes HF references
    check_regime(ref, "preempt")                   # one of REGIMES

Regimes (each builds a fresh engine from the saved checkpoint):
- default: all prompts at once;
- chunked: a 7-token budget, so prefill chunks end off block boundaries;
- preempt: a pool one request of the longest prompt (+ its output) barely fits; preemption
  is asserted to happen;
- prefix_1, prefix_3: two prompts sharing 1 / 3 full blocks and diverging mid-block, the
  second served after the first: its prefix-cache hits are asserted exact (k * 16 tokens, or
  `expect_hits`), and both outputs equal HF;
- forks: n = 3 seeded samples of one prompt equal 3 separate requests seeded seed + i;
- staggered: half the prompts first, the rest one per step while those decode.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime import LLM, SamplingParams
from tests.conftest import hf_greedy

NEW = 24
LENGTHS = [1, 7, 16, 19, 33, 41, 60]     # block size 16: 1 to 4 blocks, exact fits and off-edge ends
REGIMES = ("default", "chunked", "preempt", "prefix_1", "prefix_3", "forks", "staggered")
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefix_prompts(shared_blocks: int, vocab: int) -> list[list[int]]:
    """Two prompts sharing `shared_blocks` full blocks, the second diverging 4 tokens into
    the next block (the first goes on 5 tokens past it, then 5 more of its own)."""
    base = _ids(shared_blocks * 16 + 9, seed=100 + shared_blocks, vocab=vocab)
    return [base + _ids(5, 200 + shared_blocks, vocab), base[: shared_blocks * 16 + 4] + _ids(7, 300 + shared_blocks, vocab)]


@dataclass
class Reference:
    path: Path
    prompts: list[list[int]]
    ref: list[list[int]]                  # HF greedy tokens per prompt
    prefix: dict[int, tuple[list[list[int]], list[list[int]]]]   # shared blocks -> (prompts, HF tokens)
    vocab: int


def reference(model, tmp_dir: Path, vocab: int | None = None) -> Reference:
    """Save `model` (an HF CausalLM in eval mode) and compute its greedy references; the
    outputs must vary across prompts, or a parity pass would mean nothing."""
    vocab = vocab or model.config.vocab_size
    model.save_pretrained(tmp_dir)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    ref = hf_greedy(model, prompts, NEW)
    assert len({tuple(r) for r in ref}) == len(ref), "reference outputs must vary across prompts"
    assert len({t for r in ref for t in r}) >= 3 * len(ref), "the references collapse onto a few tokens"
    prefix = {}
    for k in (1, 3):
        ps = prefix_prompts(k, vocab)
        prefix[k] = (ps, hf_greedy(model, ps, NEW))
    return Reference(Path(tmp_dir), prompts, ref, prefix, vocab)


def _generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm: LLM) -> None:
    """Every block is back in the pool and no request is left."""
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def staggered(llm: LLM, prompts, params: SamplingParams = GREEDY, first: int | None = None,
              start_after: int = 2) -> list[list[int]]:
    """Greedy tokens when `first` prompts (default half) arrive at once and the rest one per
    step, from step `start_after` on, while those decode."""
    engine = llm.engine
    reqs = [engine.make_request({"prompt_token_ids": p}, params) for p in prompts]
    first = len(reqs) // 2 if first is None else first
    for r in reqs[:first]:
        engine.add_request(r)
    pending, done, steps = reqs[first:], {}, 0
    while engine.has_unfinished() or pending:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if pending and steps >= start_after:
            engine.add_request(pending.pop(0))
    return [done[r.request_id] for r in reqs]


def tight_pool_blocks(path, max_model_len: int, chunk: int) -> int:
    """The smallest pool that holds one request of `max_model_len` tokens, plus 2 blocks."""
    probe = LLM(path, max_model_len=max_model_len, max_num_batched_tokens=chunk, num_kv_blocks=4096)
    groups = probe.engine.kv_manager.config.groups
    return sum(g.spec.max_live_blocks(max_model_len, chunk) for g in groups) + 1 + 2


def check_regime(ref: Reference, regime: str, *, expect_hits: dict[int, int] | None = None,
                 preempt_blocks: int | None = None, **engine_kwargs) -> LLM:
    """Run one regime against the HF references; returns the engine used (for extra asserts)."""
    if regime == "default":
        llm = LLM(ref.path, **engine_kwargs)
        assert _generate(llm, ref.prompts) == ref.ref
    elif regime == "chunked":
        llm = LLM(ref.path, max_num_batched_tokens=7, **engine_kwargs)
        assert _generate(llm, ref.prompts) == ref.ref
    elif regime == "preempt":
        max_len, chunk = max(LENGTHS) + NEW + 8, 16
        blocks = preempt_blocks or tight_pool_blocks(ref.path, max_len, chunk)
        llm = LLM(ref.path, num_kv_blocks=blocks, max_model_len=max_len, max_num_batched_tokens=chunk,
                  **engine_kwargs)
        assert _generate(llm, ref.prompts) == ref.ref
        assert llm.kv_cache_stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    elif regime in ("prefix_1", "prefix_3"):
        k = int(regime[-1])
        prompts, want = ref.prefix[k]
        llm = LLM(ref.path, enable_prefix_caching=True, **engine_kwargs)
        assert _generate(llm, prompts[:1]) == want[:1]
        assert llm.kv_cache_stats()["prefix_cache_hits"] == 0
        assert _generate(llm, prompts[1:]) == want[1:]
        hits = (expect_hits or {}).get(k, k * 16)
        assert llm.kv_cache_stats()["prefix_cache_hits"] == hits
    elif regime == "forks":
        prompt = _ids(16 * 2 + 7, seed=51, vocab=ref.vocab)
        sample = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
        llm = LLM(ref.path, **engine_kwargs)
        got = [c.token_ids for c in llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, seed=7, **sample),
                                                 use_tqdm=False)[0].outputs]
        assert llm.kv_cache_stats()["forks"] == 2
        assert_all_free(llm)
        single = LLM(ref.path, enable_prefix_caching=False, **engine_kwargs)
        separate = [single.generate({"prompt_token_ids": prompt}, SamplingParams(seed=7 + i, **sample),
                                    use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
        assert got == separate
        assert len({tuple(s) for s in got}) == 3, "seeded samples should differ"
        assert_all_free(single)
    elif regime == "staggered":
        llm = LLM(ref.path, max_num_batched_tokens=24, **engine_kwargs)
        assert staggered(llm, ref.prompts) == ref.ref
    else:
        raise ValueError(f"unknown regime {regime!r}; one of {', '.join(REGIMES)}")
    assert_all_free(llm)
    return llm
