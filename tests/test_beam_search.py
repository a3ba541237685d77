"""Beam search: beams are forked requests sharing KV blocks; the result must equal a
brute-force reference that recomputes every beam from scratch with HF transformers, for
full attention, sliding window, Mamba2 and Gated DeltaNet models."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, BeamSearchParams, SamplingParams
from runtime.beam_search import BeamSearch, BeamSearchGroup


def _ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference_beam_search(model, prompt, width, max_tokens, eos=(), ignore_eos=False, length_penalty=1.0):
    """The selection rule of runtime/beam_search.py, run naively: every beam's logprobs come
    from a full HF forward over prompt + beam tokens (no cache, no sharing)."""
    live, completed = [([], 0.0)], []
    for step in range(max_tokens):
        ranked = []
        for order, (tokens, cum) in enumerate(live):
            logprobs = model(torch.tensor([prompt + tokens])).logits[0, -1].float().log_softmax(-1)
            top = sorted(((t, v) for t, v in enumerate(logprobs.tolist())), key=lambda tv: (-tv[1], tv[0]))
            for rank, (t, v) in enumerate(top[: 2 * width]):
                ranked.append((-(cum + v), order, rank, tokens, t))
        ranked.sort(key=lambda c: c[:3])
        new_live = []
        for position, (neg, _, _, tokens, t) in enumerate(ranked):
            if len(new_live) == width:
                break
            if t in eos and not ignore_eos:
                if position < width:
                    completed.append((tokens + [t], -neg))
                continue
            new_live.append((tokens + [t], -neg))
        if step == max_tokens - 1:
            completed.extend(new_live)
            break
        live = new_live
        if not live:
            break
    completed.sort(key=lambda s: -s[1] / len(s[0]) ** length_penalty)
    return completed[:width]


def _check(got, ref):
    assert [s.tokens for s in got] == [r[0] for r in ref]
    for s, (_, cum) in zip(got, ref):
        assert s.cum_logprob == pytest.approx(cum, abs=1e-4)


@pytest.mark.parametrize("family", ["llama", "mistral", "bamba", "qwen3_next"])
def test_beam_search_equals_brute_force_reference(tiny_hf, family):
    path, hf = tiny_hf(family)
    llm = LLM(path, max_model_len=128)
    prompts = [_ids(21, seed=1), _ids(16, seed=2), _ids(7, seed=3)]   # partial block, boundary, short
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for out, p in zip(outs, prompts):
        assert out.prompt_token_ids == p
        _check(out.sequences, reference_beam_search(hf, p, 3, 6))
    assert len({tuple(s.tokens) for s in outs[0].sequences}) == 3
    stats = llm.kv_cache_stats()
    assert stats["forks"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"], "beam search leaked blocks"
    assert not llm.engine.scheduler.requests


@pytest.mark.parametrize("family, blocks", [("llama", 7), ("bamba", 10)])
def test_beam_search_survives_preemption(tiny_hf, family, blocks):
    """A pool too small for all beams at once: beams are preempted (their blocks freed,
    recomputed later, including tokens the driver fed them) and the result is unchanged.
    Beams that wait for their round hold no block against beams that can run (before
    Scheduler._preempt_idle this deadlocked)."""
    path, hf = tiny_hf(family)
    llm = LLM(path, max_model_len=48, num_kv_blocks=blocks, max_num_batched_tokens=32, enable_prefix_caching=False)
    prompts = [_ids(21, seed=11), _ids(30, seed=12), _ids(9, seed=13)]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=6))
    for out, p in zip(outs, prompts):
        _check(out.sequences, reference_beam_search(hf, p, 3, 6))
    stats = llm.kv_cache_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"] and not llm.engine.scheduler.requests


def test_beam_search_end_of_sequence_and_length_penalty(tiny_hf):
    path, hf = tiny_hf("llama")
    llm = LLM(path, max_model_len=128)
    prompt = _ids(19, seed=5)
    greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3),
                          use_tqdm=False)[0].outputs[0].token_ids
    eos = (greedy[1],)                  # a token the best beam wants at step 2
    llm.engine.eos_token_ids = eos
    for lp in (1.0, 0.0, 2.0):
        params = BeamSearchParams(beam_width=4, max_tokens=5, length_penalty=lp)
        got = llm.beam_search({"prompt_token_ids": prompt}, params)[0].sequences
        ref = reference_beam_search(hf, prompt, 4, 5, eos=eos, length_penalty=lp)
        _check(got, ref)
        assert any(s.finished_by_eos and s.tokens[-1] == eos[0] for s in got) or \
            all(len(r[0]) == 5 for r in ref)
    got = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(4, 5, ignore_eos=True))[0].sequences
    _check(got, reference_beam_search(hf, prompt, 4, 5, eos=eos, ignore_eos=True))
    assert all(len(s.tokens) == 5 for s in got)


def test_width_one_is_greedy(tiny_hf):
    path, _ = tiny_hf("qwen3")
    llm = LLM(path, max_model_len=128)
    prompt = _ids(30, seed=7)
    greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=1, max_tokens=8))[0]
    assert out.sequences[0].tokens == greedy
    assert llm.kv_cache_stats()["forks"] == 0


def test_beams_share_prefix_blocks_and_dropped_beams_free_theirs(tiny_hf):
    path, _ = tiny_hf("llama")
    llm = LLM(path, max_model_len=128, enable_prefix_caching=False)   # sharing comes from forks alone
    engine = llm.engine
    prompt = _ids(16 * 3 + 5, seed=9)                    # 3 full blocks + 5 tokens
    search = BeamSearch(engine)
    req, group = search.prepare({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=8))
    search.add(req, group)
    pool = engine.kv_manager.pool
    seen_shared = False
    while not search.done:
        search.step()
        beams = [rid for rid in group.live if rid in engine.scheduler.requests]
        tables = [engine.kv_manager.get_block_ids(rid)[0] for rid in beams]
        if len(tables) == 4 and all(len(t) >= 3 for t in tables):
            # The prompt's full blocks are stored once, referenced by every beam.
            assert len({tuple(t[:3]) for t in tables}) == 1
            assert all(pool.blocks[b].ref_cnt == 4 for b in tables[0][:3])
            seen_shared = True
        # Never more than the beams' own partial blocks on top of the shared ones.
        stats = engine.kv_cache_stats()
        in_use = stats["num_blocks"] - stats["num_free_blocks"]
        assert in_use <= 3 + 4 * 2
    assert seen_shared
    stats = engine.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["fork_copied_blocks"] > 0


def test_group_selection_rules():
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    g = BeamSearchGroup("g", params, eos_token_ids=(9,), max_tokens=3)
    g.add_beam("a", [], 0.0)
    assert g.record("a", {5: -0.1, 9: -0.2, 6: -1.0, 7: -2.0})
    d = g.select()
    # EOS ranked 2nd (within the top 2): a finished sequence; the live beams are 5 and 6.
    assert d == {"a": [(5, -0.1), (6, -1.0)]}
    assert [(s.tokens, s.finished_by_eos) for s in g.completed] == [([9], True)]
    g.add_beam("a", [5], -0.1)
    g.add_beam("b", [6], -1.0)
    assert not g.record("b", {1: -0.5, 9: -0.01, 2: -3.0, 3: -4.0})
    assert g.record("a", {1: -3.0, 2: -3.1, 3: -3.2, 4: -3.3})
    d = g.select()
    # Ranked: b+9 (-1.01, EOS, rank 0 -> finished), b+1 (-1.5), a+1 (-3.1): live b+1, a+1.
    assert d == {"b": [(1, pytest.approx(-1.5))], "a": [(1, pytest.approx(-3.1))]}
    assert g.completed[-1].tokens == [6, 9]
    g.add_beam("b", [6, 1], -1.5)
    g.add_beam("a", [5, 1], -3.1)
    g.record("a", {1: -0.1, 2: -0.2, 3: -0.3, 4: -0.4})
    g.record("b", {1: -0.1, 2: -0.2, 3: -0.3, 4: -0.4})
    assert g.select() == {"a": [], "b": []}           # max_tokens: everything finishes
    assert g.done
    best = g.results()
    assert [s.tokens for s in best] == [[9], [6, 9]]   # -0.2/1 and -1.01/2 beat -1.6/3
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)
