"""Speculative decoding on the zoo's other layer kinds: greedy output identical with
speculation on and off, and every state kind's rollback exact.

The small zoo specs (seeded random weights, no HF model to compare with) cover KDA + MLA + MoE
(Kimi-Linear), short_conv (LFM2), lightning + MoE (MiniMax), DeepSeek-V4's sliding shared-KV,
CSA and HCA layers, MLA + MoE (DeepSeek-V3) and sinks + sliding + MoE (gpt-oss). The
reference is the same spec's plain greedy run; the speculating run drafts with the oracle of
tests/test_spec_decode.py (the reference with one token made wrong, the position cycling
through 0..k), so steps reject at every draft position and accept all, while prefill is
chunked, the pool is tight enough to preempt, and a second wave hits the prefix cache.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cache.kv_cache_spec import StateSpec
from runtime import LLM, SamplingParams
from runtime.spec_decode import decoder as decoder_mod
from tests.test_parity import _prompts
from tests.test_spec_decode import K, SPEC, OracleProposer, _all_free, _assert_speculated

ZOO = Path(__file__).resolve().parent.parent / "zoo"
VOCAB = 512                   # every spec below
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
MAX_LEN, CHUNK = 96, 16       # a 60-token prompt + its output fits; prefill in 16-token chunks

# spec (its kinds) -> a pool (blocks) small enough that this workload preempts and big enough
# that the first prompt's blocks and state checkpoints survive until it is sent again
POOL = {"kimi-linear-small": 26,        # KDA + MLA + MoE
        "lfm2-small": 16,               # short_conv
        "minimax-small": 16,            # lightning + MoE
        "deepseek-v4-small": 30,        # swa_shared_kv + CSA + HCA
        "deepseek-v3-small": 9,         # MLA + MoE
        "gpt-oss-small": 13}            # sinks + sliding + MoE
STATE_KINDS = ["kimi-linear-small", "lfm2-small", "minimax-small"]


def _install_oracle(monkeypatch, sequences):
    monkeypatch.setattr(decoder_mod, "make_proposer", lambda cfg: OracleProposer(sequences, vocab=VOCAB))


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(POOL))
def test_greedy_identical_with_speculation_on_every_kind(name, monkeypatch):
    """Chunked prefill, preemption and prefix caching in one engine, equal to the plain run
    token for token: the longest prompt alone first (its blocks and state checkpoints are
    cached), then every prompt with it in front (it hits the cache, then the pool preempts)."""
    torch.set_num_threads(1)
    path = ZOO / f"{name}.yaml"
    prompts = _prompts(VOCAB)[1:][::-1]              # 60 down to 7 tokens
    plain = LLM(path, max_model_len=MAX_LEN, max_num_batched_tokens=CHUNK, enable_prefix_caching=False)
    ref = _generate(plain, prompts)
    assert len({tuple(r) for r in ref}) == len(ref), "reference outputs must vary"
    _install_oracle(monkeypatch, [p + r for p, r in zip(prompts, ref)])
    llm = LLM(path, speculative=SPEC, max_model_len=MAX_LEN, max_num_batched_tokens=CHUNK,
              num_kv_blocks=POOL[name], enable_prefix_caching=True)
    assert _generate(llm, prompts[:1]) == ref[:1]
    assert llm.kv_cache_stats()["prefix_cache_hits"] == 0
    assert _generate(llm, prompts) == ref
    stats = llm.kv_cache_stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_preemptions"] > 0, "the pool was meant to force preemption"
    _assert_speculated(llm)
    _all_free(llm)


def _state_pages(llm, rid) -> list[torch.Tensor]:
    """Every state group's pages of request `rid`, one tensor per pool span."""
    r = llm.engine.runner
    row = r.batch.req_id_to_row[rid]
    out = []
    for gid, g in enumerate(r.kv_config.groups):
        if isinstance(g.spec, StateSpec):
            pages = torch.from_numpy(r.batch.block_table[gid].np[row, : g.spec.pages].astype(np.int64))
            out += [span.index_select(0, pages).view(torch.float32).clone() for span in r._copy_spans[gid]]
    assert out, "a state kind has state groups"
    return out


def trace_states(llm, prompt, params=GREEDY) -> tuple[dict[int, list], list[int]]:
    """Run one request alone; after every decode step, its state pages keyed by its computed
    count (a rolled-back step repeats a count), and its output."""
    eng = llm.engine
    req = eng.make_request({"prompt_token_ids": prompt}, params, request_id="r")
    eng.add_request(req)
    seen: dict[int, list] = {}
    while eng.has_unfinished():
        eng.step()
        if "r" in eng.scheduler.requests and req.num_computed_tokens >= len(prompt):
            seen.setdefault(req.num_computed_tokens, []).append(_state_pages(llm, "r"))
    return seen, req.output_token_ids


def check_rollback(path, prompt, monkeypatch, ref=None, speculative=SPEC) -> LLM:
    """Reject at each position of a k = 4 draft in turn (and accept all): after every step
    the request's state pages equal a non-speculative run's after the same committed tokens.
    `ref`: the expected greedy output (default: the plain run's)."""
    plain, plain_out = trace_states(LLM(path, enable_prefix_caching=False), prompt)
    ref = plain_out if ref is None else ref
    _install_oracle(monkeypatch, [prompt + ref])
    spec_llm = LLM(path, enable_prefix_caching=False, speculative=speculative)
    spec, spec_out = trace_states(spec_llm, prompt)
    assert plain_out == spec_out == ref
    s = spec_llm.kv_cache_stats()
    assert s["spec_decode_num_drafts"] >= K + 1
    assert s["spec_decode_num_accepted_tokens_per_pos"][K - 1] > 0     # the all-accepted case happened
    assert [c for c, v in spec.items() if len(v) > 1], "a rejection restores the state, same computed count"
    assert len(spec) >= 4
    for c, snapshots in spec.items():
        for got in snapshots:
            for a, b in zip(got, plain[c][0]):
                # a replay runs the accepted tokens as one chunk, the plain run one at a time: fp32
                # rounding of the state's scale (lightning's states grow to ~100) is all they may differ by
                torch.testing.assert_close(a, b, atol=max(2e-5, 1e-6 * float(b.abs().max())), rtol=1e-4)
    _all_free(spec_llm)
    return spec_llm


@pytest.mark.parametrize("name", STATE_KINDS)
def test_state_rollback_matches_a_plain_run_on_every_state_kind(name, monkeypatch):
    torch.set_num_threads(1)
    check_rollback(ZOO / f"{name}.yaml", _prompts(VOCAB)[4], monkeypatch)
