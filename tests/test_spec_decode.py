"""Speculative decoding: lossless under every scheduling regime, exact state rollback,
rejection sampling that follows the target distribution, the ngram proposer, config errors.

Tiny random models almost never continue an n-gram of their prompt, so most tests draft with
an oracle: it knows each prompt's greedy reference and proposes it with one token made wrong
at a position that cycles through 0..k (k: every draft right), so every step rejects at a
different position, or accepts all. Greedy output must equal HF's token for token.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.spec_decode import decoder as decoder_mod
from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.proposer import NgramProposer, Proposer
from runtime.spec_decode.rejection import layout, verify
from tests.conftest import TINY_VOCAB, hf_greedy
from tests.test_parity import NEW, _prompts, tiny_reference

K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "adaptive": False}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)


class OracleProposer(Proposer):
    """Drafts the reference continuation with the token at `wrong` made wrong; `wrong`
    cycles 0, 1, ..., k (k: nothing wrong) call by call."""

    def __init__(self, sequences: list[list[int]], k: int = K, vocab: int = TINY_VOCAB):
        self.sequences, self.k, self.vocab = sequences, k, vocab
        self.cycle = itertools.cycle(range(k + 1))

    def propose(self, token_ids, ks):
        out = []
        for t, k in zip(token_ids, ks.tolist()):
            seq = next((s for s in self.sequences if s[:len(t)] == list(t)), None)
            draft = [] if seq is None else list(seq[len(t): len(t) + k])
            wrong = next(self.cycle)
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % self.vocab
            out.append(draft)
        return out


@pytest.fixture
def oracle(monkeypatch):
    """oracle(sequences): engines built from now on draft with an OracleProposer."""
    def install(sequences):
        monkeypatch.setattr(decoder_mod, "make_proposer", lambda cfg: OracleProposer(sequences))
    return install


def _run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _all_free(llm):
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def _assert_speculated(llm):
    s = llm.kv_cache_stats()
    acc, prop = np.array(s["spec_decode_num_accepted_tokens_per_pos"]), s["spec_decode_num_draft_tokens"]
    assert prop > 0 and s["spec_decode_num_accepted_tokens"] > 0
    assert (acc[:K - 1] > 0).all(), acc                   # drafts accepted deep into the run
    assert s["spec_decode_num_accepted_tokens"] < prop    # and rejected too


FAMILIES = ["llama", "mistral", "bamba", "qwen3_next"]   # full, sliding, mamba2, gated DeltaNet + MoE
PREEMPT_BLOCKS = {"llama": 12, "mistral": 12, "bamba": 24, "qwen3_next": 24}
REGIMES = {"default": dict(), "chunked": dict(max_num_batched_tokens=5),
           "staggered": dict(max_num_batched_tokens=24), "preempt": None}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_hf):
    return (request.param, *tiny_reference(tiny_hf, request.param))


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_identical_with_speculation(family, regime, oracle):
    name, path, prompts, ref = family
    oracle([p + r for p, r in zip(prompts, ref)])
    kwargs = REGIMES[regime] or dict(num_kv_blocks=PREEMPT_BLOCKS[name], max_model_len=160,
                                     max_num_batched_tokens=16)
    llm = LLM(path, speculative=SPEC, **kwargs)
    if regime == "staggered":
        from tests.zoo_parity import staggered
        got = staggered(llm, prompts, GREEDY, first=4, start_after=3)
    else:
        got = _run(llm, prompts)
    assert got == ref
    if regime == "preempt":
        assert llm.kv_cache_stats()["num_preemptions"] > 0
    _assert_speculated(llm)
    _all_free(llm)


def test_prefix_caching_and_n_in_the_mix(family, oracle):
    """A second wave of the same prompts hits the prefix cache (blocks published only for
    committed tokens), with n = 2 greedy samples and logprobs, all equal to HF."""
    name, path, prompts, ref = family
    oracle([p + r for p, r in zip(prompts, ref)])
    llm = LLM(path, speculative=SPEC, enable_prefix_caching=True)
    assert _run(llm, prompts) == ref
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, n=2, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, r in zip(outs, ref):
        assert [c.token_ids for c in o.outputs] == [r, r]
        for c in o.outputs:
            assert len(c.logprobs) == NEW
            assert all(max(d.values(), key=lambda x: x.logprob) is d[t] for d, t in zip(c.logprobs, r))
    assert llm.kv_cache_stats()["prefix_cache_hits"] > 0
    _assert_speculated(llm)
    _all_free(llm)


@pytest.mark.parametrize("name", ["bamba", "qwen3_next"])
def test_state_rollback_matches_a_plain_run_at_every_step(tiny_hf, oracle, name):
    """Reject at each position of a k = 4 draft in turn (and accept all): after every step
    the request's state pages equal a non-speculative run's after the same committed tokens."""
    path, model = tiny_hf(name)
    prompt = _prompts(TINY_VOCAB)[4]
    ref = hf_greedy(model, [prompt], NEW)[0]
    oracle([prompt + ref])

    def states(llm, rid):
        r = llm.engine.runner
        row = r.batch.req_id_to_row[rid]
        out = []
        for gid, g in enumerate(r.kv_config.groups):
            if hasattr(g.spec, "pages") and type(g.spec).__name__ == "StateSpec":
                pages = torch.from_numpy(r.batch.block_table[gid].np[row, : g.spec.pages].astype(np.int64))
                out += [span.index_select(0, pages).view(torch.float32).clone() for span in r._copy_spans[gid]]
        assert out, "a state hybrid has state groups"
        return out

    def trace(llm):
        eng = llm.engine
        req = eng.make_request({"prompt_token_ids": prompt}, GREEDY, request_id="r")
        eng.add_request(req)
        seen = {}
        while eng.has_unfinished():
            eng.step()
            if "r" in eng.scheduler.requests and req.num_computed_tokens >= len(prompt):
                seen.setdefault(req.num_computed_tokens, []).append(states(llm, "r"))
        return seen, req.output_token_ids

    plain, plain_out = trace(LLM(path, enable_prefix_caching=False))
    spec_llm = LLM(path, enable_prefix_caching=False, speculative=SPEC)
    spec, spec_out = trace(spec_llm)
    assert plain_out == spec_out == ref
    s = spec_llm.kv_cache_stats()
    assert s["spec_decode_num_drafts"] >= K + 1
    # every rejection position 0..K-1 and the all-accepted case happened
    assert s["spec_decode_num_accepted_tokens_per_pos"][K - 1] > 0
    rolled_back = [c for c, v in spec.items() if len(v) > 1]
    assert rolled_back, "a rejection restores the state and stays at the same computed count"
    assert len(spec) >= 4
    for c, snapshots in spec.items():
        want = plain[c][0]
        for got in snapshots:
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    _all_free(spec_llm)


def test_draft_equals_target_accepts_everything_and_wrong_drafts_change_nothing(tiny_hf, monkeypatch):
    path, model = tiny_hf("llama")
    prompts = _prompts(TINY_VOCAB)[:4]
    ref = hf_greedy(model, prompts, NEW)
    seqs = [p + r for p, r in zip(prompts, ref)]

    class Exact(OracleProposer):
        def propose(self, token_ids, ks):
            return [next(list(s[len(t): len(t) + k]) for s in self.sequences if s[:len(t)] == list(t))
                    for t, k in zip(token_ids, ks.tolist())]

    class Wrong(OracleProposer):
        def propose(self, token_ids, ks):
            return [[(t[-1] + 1 + j) % self.vocab for j in range(k)] for t, k in zip(token_ids, ks.tolist())]

    for cls, rate in ((Exact, 1.0), (Wrong, None)):
        monkeypatch.setattr(decoder_mod, "make_proposer", lambda cfg, cls=cls: cls(seqs))
        llm = LLM(path, speculative=SPEC)
        assert _run(llm, prompts) == ref
        s = llm.kv_cache_stats()
        if rate is not None:
            assert s["spec_decode_acceptance_rate"] == rate
            assert s["spec_decode_mean_acceptance_length"] > K   # k accepted + the bonus token per step
        _all_free(llm)


def test_ngram_speculation_on_a_repetitive_prompt(tiny_hf):
    """The real ngram proposer end to end; with max_tokens, EOS-free stop ids and a stop id."""
    path, model = tiny_hf("llama")
    prompt = (_prompts(TINY_VOCAB)[3] * 4)[:60]
    ref = hf_greedy(model, [prompt], NEW)[0]
    llm = LLM(path, speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert _run(llm, [prompt]) == [ref]
    # a stop token id mid-run: the output ends at its first occurrence, as without speculation
    stop = ref[NEW // 2]
    first = ref.index(stop)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=NEW,
                                                                    stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[: first + 1] and out.outputs[0].finish_reason == "stop"
    for m in (5, 7):   # max_tokens cuts a draft run exactly
        assert _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=m)) == [ref[:m]]
    assert llm.kv_cache_stats()["spec_decode_num_drafts"] > 0
    _all_free(llm)


class Echo(Proposer):
    """Drafts the request's last k tokens again (any deterministic guess will do)."""

    def propose(self, token_ids, ks):
        return [list(t[-k:]) for t, k in zip(token_ids, ks.tolist())]


def test_seeded_sampling_with_speculation_is_reproducible(tiny_hf, monkeypatch):
    path, model = tiny_hf("llama")
    prompts = _prompts(TINY_VOCAB)[2:6]
    monkeypatch.setattr(decoder_mod, "make_proposer", lambda cfg: Echo())
    params = SamplingParams(temperature=0.7, max_tokens=NEW, seed=11, logprobs=1)
    a = LLM(path, speculative=SPEC)
    first, second = _run(a, prompts, params), _run(LLM(path, speculative=SPEC), prompts, params)
    assert first == second
    assert a.kv_cache_stats()["spec_decode_num_draft_tokens"] > 0
    _all_free(a)


def test_beam_search_unchanged_by_speculation(tiny_hf):
    """Beams take their tokens from the search: they never speculate, and the search's
    result is the same with speculation on."""
    from runtime.beam_search import BeamSearchParams
    path, _ = tiny_hf("llama")
    prompt = {"prompt_token_ids": _prompts(TINY_VOCAB)[3]}
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    plain = LLM(path).beam_search([prompt], params)[0]
    spec_llm = LLM(path, speculative=SPEC)
    spec = spec_llm.beam_search([prompt], params)[0]
    assert [s.tokens for s in spec.sequences] == [s.tokens for s in plain.sequences]
    _all_free(spec_llm)


# ----------------------------------------------------------------- rejection sampling
def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * observed.sum()
    keep = expected > 0
    assert (observed[~keep] == 0).all(), "a zero-probability token was emitted"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_follows_the_target_distribution():
    """20000 requests with the same two drafts: the first emitted token follows p0, and the
    token after an accepted first draft follows p1 (Leviathan et al.: lossless)."""
    vocab, r, k = 6, 20000, 2
    g = torch.Generator().manual_seed(0)
    p0 = torch.softmax(torch.randn(vocab, generator=g), 0)
    p1 = torch.softmax(torch.randn(vocab, generator=g), 0)
    p2 = torch.softmax(torch.randn(vocab, generator=g), 0)
    nd = np.full(r, k)
    probs = torch.stack([p0, p1, p2]).repeat(r, 1)            # request-major, k + 1 rows each
    drafts = np.tile(np.array([[int(p0.argmax()), int(p1.argmin())]]), (r, 1))
    torch.manual_seed(1)
    emitted, acc = verify(probs.argmax(-1), probs, np.zeros(r, dtype=bool), drafts, nd, {})
    assert chi_square(torch.bincount(torch.from_numpy(emitted[:, 0]), minlength=vocab).float(), p0) < 20.5  # 5 dof
    second = emitted[acc >= 1, 1]
    assert chi_square(torch.bincount(torch.from_numpy(second), minlength=vocab).float(), p1) < 20.5
    # both drafts accepted: the bonus token follows p2
    third = emitted[acc == 2, 2]
    assert len(third) > 100
    assert chi_square(torch.bincount(torch.from_numpy(third), minlength=vocab).float(), p2) < 20.5
    assert abs((acc >= 1).mean() - float(p0[drafts[0, 0]])) < 0.02    # accepted with probability p0(d0)


def test_rejection_greedy_rows_and_seeded_generators():
    vocab = 5
    probs = torch.softmax(torch.randn(7, vocab, generator=torch.Generator().manual_seed(2)), -1)
    nd = np.array([2, 0, 3])          # rows 0-2, 3, 4-7... 3+1+4 = 8 flat rows
    probs = torch.cat([probs, probs[:1]])
    target = probs.argmax(-1)
    drafts = np.zeros((3, 3), dtype=np.int64)
    start, _ = layout(nd)
    drafts[0, :2] = [target[0], (target[1] + 1) % vocab]      # accept 1, reject the 2nd
    drafts[2, :3] = target[start[2]: start[2] + 3].numpy()    # accept all
    greedy = np.array([True, True, True])
    emitted, acc = verify(target, None, greedy, drafts, nd, {})
    assert acc.tolist() == [1, 0, 3]
    assert emitted[0, :2].tolist() == [int(target[0]), int(target[1])]
    assert emitted[1, 0] == target[start[1]] and emitted[2, 3] == target[start[2] + 3]
    sampled = np.array([False, False, False])
    runs = [verify(target, probs, sampled, drafts, nd,
                   {i: torch.Generator().manual_seed(5 + i) for i in range(3)}) for _ in range(2)]
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])


# ----------------------------------------------------------------- proposer and config
def test_ngram_proposer_batch():
    p = NgramProposer(k=3, n_min=1, n_max=3)
    got = p.propose([[1, 2, 3, 4, 1, 2], [5, 6, 7], [1, 2, 3, 9, 9, 1, 2, 3, 9], [4, 4]], np.array([3, 3, 2, 3]))
    # longest suffix first (1 2 -> 3 4 1), no match, the latest earlier occurrence (2 3 9 -> 9 1), capped at the end
    assert got == [[3, 4, 1], [], [9, 1], [4]]
    assert NgramProposer(k=2, n_min=2, n_max=2).propose([[1, 2, 1, 2]], np.array([2])) == [[1, 2]]
    assert NgramProposer(k=2, n_min=2, n_max=2).propose([[3, 1, 2, 1]], np.array([2])) == [[]]


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "speculative.method: must be one of"),
    ({"num_speculative_tokens": 0}, "speculative.num_speculative_tokens: must be a positive integer"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "speculative.prompt_lookup_min: 5 exceeds"),
    ({"k": 3}, "speculative.k: unknown field"),
    ({"disable_by_batch_size": 0}, "speculative.disable_by_batch_size: must be a positive integer"),
    ({"method": "mtp", "model": "zoo/smollm2-135m.yaml"}, "speculative.model: only the 'draft' method"),
    ({"method": "draft"}, "speculative.model: the 'draft' method needs"),
    ({"method": "ngram", "model": "zoo/smollm2-135m.yaml"}, "speculative.model: only the 'draft' method"),
    ("{not json", "speculative: not valid JSON"),
])
def test_config_errors_name_the_field(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SpeculativeConfig.parse(value)


def test_yaml_section_and_explicit_off(tiny_hf, tmp_path):
    import yaml
    from models import resolve_spec
    from models.spec import spec_to_dict
    path, _ = tiny_hf("llama")
    data = spec_to_dict(resolve_spec(path))
    data["checkpoint"]["path"] = str(path)
    data["speculative"] = {"method": "ngram", "num_speculative_tokens": 2}
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(data))
    llm = LLM(f)
    assert llm.engine.spec_decoder.config.num_speculative_tokens == 2
    assert LLM(f, speculative={"method": None}).engine.spec_decoder is None
    data["speculative"] = {"method": "ngram", "num_speculative_tokens": -1}
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        LLM(f)


def test_metrics_render_speculation(tiny_hf, oracle):
    """kv_cache_stats() counters reach /metrics: drafts, draft and accepted tokens, and the
    acceptance per draft position."""
    from runtime.metrics import ServerMetrics
    from tests.serving import metric
    path, model = tiny_hf("llama")
    prompts = _prompts(TINY_VOCAB)[:3]
    ref = hf_greedy(model, prompts, NEW)
    oracle([p + r for p, r in zip(prompts, ref)])
    llm = LLM(path, speculative=SPEC)
    assert _run(llm, prompts) == ref
    stats = llm.kv_cache_stats()
    m = ServerMetrics("x")
    m.update_engine_state(stats)
    text = m.render().decode()
    assert metric(text, 'zooinfer_spec_decode_tokens{kind="num_accepted_tokens",model_name="x"}') == \
        stats["spec_decode_num_accepted_tokens"] > 0
    assert metric(text, 'zooinfer_spec_decode_tokens{kind="num_draft_tokens",model_name="x"}') == \
        stats["spec_decode_num_draft_tokens"]
    per_pos = stats["spec_decode_acceptance_per_position"]
    # the oracle's cycle: position j survives the drafts whose wrong token is past j
    assert per_pos[0] > per_pos[K - 1] > 0
    assert metric(text, 'zooinfer_spec_decode_acceptance_per_position{model_name="x",position="0"}') == \
        pytest.approx(per_pos[0])


def test_stop_string_mid_draft_run_cuts_as_without_speculation(tiny_hf, oracle):
    """A stop string completed by an accepted draft ends the request there: the tokens
    verified after it are dropped (output, logprobs), exactly the plain run's output."""
    from transformers import AutoTokenizer

    from models.embedded import ensure_embedded
    tok = AutoTokenizer.from_pretrained(str(ensure_embedded("smollm2-135m")))
    path, model = tiny_hf("llama")
    prompts = _prompts(TINY_VOCAB)[3:6]
    ref = hf_greedy(model, prompts, NEW)
    oracle([p + r for p, r in zip(prompts, ref)])
    outs = {}
    for name, kwargs in (("plain", {}), ("spec", {"speculative": SPEC})):
        llm = LLM(path, **kwargs)
        llm.engine.tokenizer = tok      # the tiny model's ids are < 512: any tokenizer spells them
        texts = [tok.decode(r) for r in ref]
        stops = [t[len(t) // 2: len(t) // 2 + 3] for t in texts]
        got = []
        for p, stop in zip(prompts, stops):
            o = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=NEW, stop=[stop],
                                                                     logprobs=0), use_tqdm=False)[0].outputs[0]
            assert o.finish_reason == "stop" and len(o.logprobs) == len(o.token_ids) < NEW
            got.append((o.token_ids, o.text, o.stop_reason))
        outs[name] = got
        _all_free(llm)
    assert outs["spec"] == outs["plain"]
    assert llm.kv_cache_stats()["spec_decode_num_accepted_tokens"] > 0


def test_drafts_take_only_leftover_budget(tiny_hf, oracle):
    """A step schedules drafts only once every running request's committed tokens and every
    admissible waiting request are served; under a tight budget speculation shrinks to zero."""
    path, model = tiny_hf("llama")
    prompts = _prompts(TINY_VOCAB)
    ref = hf_greedy(model, prompts, NEW)
    oracle([p + r for p, r in zip(prompts, ref)])
    budget = 12
    llm = LLM(path, speculative=SPEC, max_num_batched_tokens=budget)
    sched = llm.engine.scheduler
    steps, schedule = [], sched.schedule

    def recording():
        owed = {r.request_id: r.num_tokens - r.num_computed_tokens for r in sched.running}
        proposed = sum(len(r.spec_token_ids) for r in sched.running)
        out = schedule()
        drafts = sum(len(d) for d in out.spec_token_ids.values())
        steps.append((out.total_num_scheduled_tokens, drafts, proposed))
        if drafts:
            assert not sched.waiting, "a waiting request could have used the draft budget"
            for rid, n in owed.items():
                got = out.num_scheduled_tokens.get(rid, 0) - len(out.spec_token_ids.get(rid, ()))
                assert got == n, (rid, got, n)
        return out

    sched.schedule = recording
    assert _run(llm, prompts) == ref
    assert all(total <= budget for total, _, _ in steps)
    assert any(d for _, d, _ in steps), "drafts ran once the budget allowed"
    assert any(p and not d and total == budget for total, d, p in steps), "saturated steps drop drafts"
    _all_free(llm)


def test_adaptive_k_follows_acceptance():
    from runtime.request import Request
    from runtime.spec_decode.decoder import PROBE_EVERY, SpecDecoder
    dec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000, proposer=Echo())
    req = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=500), (), 500)
    req.append_output_token(4)
    assert dec._k(req) == 4
    ks = []
    for _ in range(6):          # nothing accepted: k shrinks to a pause
        dec._record("a", 4, 0)
        ks.append(dec._k(req))
    assert ks[0] == 3 and ks == sorted(ks, reverse=True) and ks[-1] == 0
    probes = []
    for _ in range(2 * PROBE_EVERY):
        dec.steps += 1
        probes.append(dec._k(req))
    # one single-draft probe per PROBE_EVERY steps, on the engine's multiples of PROBE_EVERY
    assert probes == ([0] * (PROBE_EVERY - 1) + [1]) * 2
    for _ in range(8):          # everything accepted again: back to full k
        dec._record("a", 1, 1)
    assert dec._k(req) == 4
    req.max_tokens = req.num_output_tokens + 2            # room for one draft and its bonus token
    assert dec._k(req) == 1
    dec.step(None, [req])
    assert req.spec_token_ids == [4]
    crowded = SpecDecoder(SpeculativeConfig(disable_by_batch_size=1), max_model_len=1000, proposer=Echo())
    crowded.step(None, [req])
    assert req.spec_token_ids == []


def test_threshold_caps_k_where_drafts_do_not_pay():
    """A request's k keeps only the drafts whose acceptance (rate^j for draft j) beats the
    cost model's threshold (tests/test_spec_cost_model.py fits it from step times)."""
    from runtime.request import Request
    from runtime.spec_decode.decoder import SpecDecoder
    dec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000, proposer=Echo())
    req = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=500), (), 500)
    req.append_output_token(4)
    dec.rate["a"] = 0.8                  # 0.8, 0.64, 0.51, 0.41 for drafts 1..4
    assert dec._k(req, 0.1 / 1.1) == 3        # k * rate rounds to 3
    assert dec._k(req, 3.2 / 4.2) == 1        # only 0.8 > 0.76
    assert all(dec._k(req, 0.9) == 0 for _ in range(20))   # none pays: paused, no probe that soon


def test_costly_drafts_start_from_the_measured_acceptance_and_probes_back_off():
    """Where drafts are cheap a new request starts optimistic (k = 4); where they cost it
    starts from the engine-wide acceptance, pauses, and probes after PROBE_COSTLY steps, then
    after twice as long for every failed probe; a good probe resets the wait. Probes fall on
    engine steps that are multiples of the wait."""
    from runtime.request import Request
    from runtime.spec_decode.decoder import PRIOR_EMA, PROBE_COSTLY, SpecDecoder
    dec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000, proposer=Echo())

    def new(rid):
        req = Request(rid, [1, 2, 3], SamplingParams(temperature=0, max_tokens=500), (), 500)
        req.append_output_token(4)
        return req

    a = new("a")
    assert dec._k(a, 0.05) == 4
    for _ in range(20):                   # nothing anyone drafts is accepted
        dec._record("a", 4, 0)
    assert dec.prior == pytest.approx((1 - PRIOR_EMA) ** 20)
    assert dec._k(new("cheap"), 0.05) == 4            # cheap: optimistic whatever was measured
    b = new("b")                                      # costly: rate = prior ~0.36, no draft pays 0.6

    def probe_steps(req, n):
        """The engine steps, of the next n, at which `req` probes."""
        got = []
        for _ in range(n):
            dec.steps += 1
            if dec._k(req, 0.6):
                got.append(dec.steps)
        return got
    assert probe_steps(b, PROBE_COSTLY) == [PROBE_COSTLY]
    dec._record("b", 1, 0)                            # the probe failed: the next waits twice as long
    assert probe_steps(b, 3 * PROBE_COSTLY) == [4 * PROBE_COSTLY]          # >= 64 on, on a multiple of 64
    dec._record("b", 1, 0)
    assert probe_steps(b, 4 * PROBE_COSTLY) == [8 * PROBE_COSTLY]          # >= 128 on, on a multiple of 128
    dec._record("b", 1, 1)                            # a good probe: back to the first wait
    assert probe_steps(b, PROBE_COSTLY) == [9 * PROBE_COSTLY]
    # Requests paused at different steps probe only on multiples of the wait: the whole batch
    # has at most one probing (verifying) step in every PROBE_COSTLY steps, not one per step.
    paused = [new(f"p{i}") for i in range(6)]
    probes = {}
    for t in range(4 * PROBE_COSTLY):
        dec.steps += 1
        for i, req in enumerate(paused[: t // 5 + 1]):       # request i pauses 5 * i steps in
            if dec._k(req, 0.6):
                probes.setdefault(req.request_id, []).append(dec.steps)
    assert len(probes) == len(paused)
    assert {s % PROBE_COSTLY for got in probes.values() for s in got} == {0}


def test_server_flag_errors_in_one_line(tiny_hf, capsys):
    """`--speculative-config` reaches the engine: a bad value stops start-up with one line
    naming the field, before any weights load."""
    from runtime.serve import main
    path, _ = tiny_hf("llama")
    capsys.readouterr()      # the fixture's save_pretrained progress bar
    assert main([str(path), "--port", "0", "--speculative-config", '{"method": "ngram", "k": 2}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: speculative.k: unknown field; known: adaptive, disable_by_batch_size, method, model, "
                   "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min"]
