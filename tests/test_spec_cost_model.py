"""The decode-local cost model (runtime/spec_decode/cost_model.py) and the decisions taken
from it, on injected timings and never on timing asserts. Decode steps follow
seconds = A + B * tokens + E * drafts, and prefill steps follow a cheaper
line that must not leak into the decode fit. The decisions: the threshold a draft's
acceptance must beat, and the per-step cap on k (0: a plain step), which counts the
proposer's overhead and the draft model's forwards."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from runtime import SamplingParams
from runtime.request import Request
from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.cost_model import StepCost
from runtime.spec_decode.decoder import SpecDecoder
from runtime.spec_decode.proposer import Proposer

A, B, E = 0.030, 0.0005, 0.0002       # a CPU-like step: weights streamed, tokens compute-bound


def decode_seconds(rows: int, drafts: int) -> float:
    return A + B * (rows + drafts) + E * drafts


def fitted(prefill: bool = True) -> StepCost:
    cost = StepCost()
    if prefill:                            # long chunks of cheap tokens (no LM head): 0.005 + 0.0001 / token
        for n in (2048, 700, 1500, 64, 2048, 300):
            cost.observe_step(4, 0, n, 0.005 + 0.0001 * n)
    for rows in (1, 32, 8, 32, 16, 1, 32, 24):
        for drafts in (0, rows, 3 * rows, 0, 2, 4 * rows):
            cost.observe_step(rows, drafts, rows + drafts, decode_seconds(rows, drafts))
    cost.observe_proposer(0.001, 0, 0.0)      # ngram: 1 ms of numpy per call, no forwards
    return cost


GRID = [(rows, drafts) for rows in (1, 8, 16, 24, 32) for drafts in (0, 2, rows, 4 * rows)]


def test_decode_fit_predicts_decode_steps_whatever_the_prefill_steps_cost():
    with_prefill, without = fitted(True), fitted(False)
    for cost in (with_prefill, without):
        for rows, drafts in GRID:
            assert cost.verify_seconds(rows, drafts) == pytest.approx(decode_seconds(rows, drafts), rel=0.01)
    # the threshold: a draft costs B + E on a step of A + B * rows
    assert with_prefill.threshold(1) == pytest.approx((B + E) / (A + B), rel=0.03)
    assert with_prefill.threshold(32) == pytest.approx((B + E) * 32 / (A + 32 * B), rel=0.03)


def test_prefill_fit_is_the_prior_where_decode_steps_never_vary():
    """Batch 1 and no drafts yet: the decode fit cannot tell A from B. The prefill fit's
    slope stands in for B, and the intercept takes the rest of the measured time."""
    cost = StepCost()
    for n in (2048, 700, 1500, 64, 2048, 300):
        cost.observe_step(4, 0, n, 0.005 + 0.0001 * n)
    assert not cost.ready                                            # no decode step yet
    for _ in range(10):
        cost.observe_step(1, 0, 1, decode_seconds(1, 0))
    a, b, e = cost.theta(1)
    assert b == pytest.approx(0.0001, rel=0.05) and a + b == pytest.approx(A + B, rel=0.01)
    assert e == pytest.approx(0.0)                                  # never seen: at its prior


def test_drafting_cost_survives_a_long_run_of_plain_steps():
    """Plain steps decay only the plain regime's statistics: after 500 of them the fit still
    knows what a drafting step costs (otherwise drafts would look free again)."""
    cost = fitted()
    for _ in range(500):
        cost.observe_step(32, 0, 32, decode_seconds(32, 0))
    for drafts in (2, 32, 128):
        assert cost.verify_seconds(32, drafts) == pytest.approx(decode_seconds(32, drafts), rel=0.01)


def test_batch_1_steps_do_not_make_drafts_at_batch_32_look_cheap():
    """Weights-bound batch 1 (a draft costs 0.1 ms on a 30 ms step) and compute-bound batch 32
    (a draft costs 1.2 ms): each bucket's fit follows its own steps."""
    cost = StepCost()
    for drafts in (0, 1, 4, 0, 2, 3) * 4:
        cost.observe_step(1, drafts, 1 + drafts, 0.030 + 0.0001 * drafts)
    for drafts in (0, 32, 128, 0, 64, 96) * 4:
        cost.observe_step(32, drafts, 32 + drafts, 0.060 + 0.0012 * drafts)
    assert cost.threshold(1) == pytest.approx(0.0001 / 0.030, rel=0.1)           # a joint fit: ~0.04
    assert cost.threshold(32) == pytest.approx(0.0012 * 32 / 0.060, rel=0.05)       # 0.64
    assert cost.verify_seconds(32, 32) == pytest.approx(0.060 + 0.0012 * 32, rel=0.02)


def with_draft(per_forward: float) -> StepCost:
    """fitted(), with a draft model measured at `per_forward` seconds a forward (4 per call)."""
    cost = fitted()
    cost.observe_proposer(0.001 + 4 * per_forward, 4, 4 * per_forward)
    assert cost.overhead == pytest.approx(0.001) and cost.per_forward == pytest.approx(per_forward)
    return cost


def test_cap_switches_drafts_off_where_they_do_not_pay_and_counts_the_draft_models_forwards():
    ngram = fitted()
    none, k = (lambda c: 0), (lambda c: c)
    full = np.full(32, 4)
    # batch 32, acceptance 0.3, one draft each: 41.6 tokens in 69 ms < 32 tokens in 46 ms plain
    assert ngram.cap(32, np.full(32, 0.3), np.ones(32, dtype=np.int64), none) == 0
    # batch 32, acceptance 0.95, ngram: 145 tokens in 137 ms at k = 4 beats k = 3 (119 in 114 ms)
    assert ngram.cap(32, np.full(32, 0.95), full, none) == 4
    # the same acceptance from a draft model at 25 ms a forward: k = 1 already takes 94 ms for
    # 62 tokens, and every k loses to the plain step
    assert with_draft(0.025).cap(32, np.full(32, 0.95), full, k) == 0
    # batch 1 with a 10 ms draft: 4.1 tokens in 74 ms at k = 4 beats 1 token in 30.5 ms
    draft = with_draft(0.010)
    assert draft.cap(1, np.array([0.9]), np.array([4]), k) == 4
    # at acceptance 0.5 only one draft pays (1.5 tokens in 42 ms), at 0.3 none does
    assert draft.cap(1, np.array([0.5]), np.array([4]), k) == 1
    assert draft.cap(1, np.array([0.3]), np.array([4]), k) == 0
    # no drafting step seen at this batch size: one draft each, to measure what they cost
    assert StepCost().cap(32, np.full(32, 0.9), full, none) == 1
    assert with_draft(0.010).cap(64, np.full(64, 0.99), np.full(64, 4), none) == 1


def test_drafting_must_beat_the_plain_step_by_the_margin():
    """Batch 32, one draft each: 32 + 32 * alpha tokens in 69.4 ms (the ngram's 1 ms
    included) against 32 in 46 ms. The draft pays from alpha 0.51; with MARGIN (5%) it is
    chosen only from alpha 0.58."""
    from runtime.spec_decode.cost_model import MARGIN
    cost, one, none = fitted(), np.ones(32, dtype=np.int64), (lambda c: 0)
    plain, drafting = cost.verify_seconds(32, 0), cost.verify_seconds(32, 32) + cost.overhead
    even = float(drafting / plain) - 1                      # the break-even acceptance
    assert even == pytest.approx(0.509, abs=0.01)
    assert cost.cap(32, np.full(32, even + 0.01), one, none) == 0          # pays, by less than the margin
    assert cost.cap(32, np.full(32, (1 + even) * (1 + MARGIN) - 1 + 0.01), one, none) == 1


class Counting(Proposer):
    """Drafts the last k tokens again. It counts its calls, and every call 'runs' forwards
    of 10 ms each on a fake clock that it moves forward."""

    def __init__(self, clock, forwards_per_k: int = 0):
        self.clock, self.calls, self.fwd, self.fwd_s = clock, 0, 0, 0.0
        self.forwards_per_k = forwards_per_k

    def propose(self, token_ids, ks):
        self.calls += 1
        n = self.forwards_per_k * int(ks.max())
        self.fwd, self.fwd_s = self.fwd + n, self.fwd_s + 0.010 * n
        self.clock.t += 0.002 + 0.010 * n
        return [list(t[-k:]) for t, k in zip(token_ids, ks.tolist())]

    def forwards(self, k):
        return self.forwards_per_k * k

    def forward_stats(self):
        return self.fwd, self.fwd_s


def _requests(n: int) -> list[Request]:
    out = []
    for i in range(n):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=500), (), 500)
        r.append_output_token(4)
        out.append(r)
    return out


def _so(reqs, drafts: int = 0):
    """A decode step's SchedulerOutput as the cost model reads it."""
    spec = {r.request_id: [1] * drafts for r in reqs} if drafts else {}
    return SimpleNamespace(num_scheduled_tokens={r.request_id: 1 + drafts for r in reqs}, spec_token_ids=spec,
                           total_num_scheduled_tokens=len(reqs) * (1 + drafts))


@pytest.mark.parametrize("forwards_per_k", [0, 1])
def test_decoder_measures_the_proposer_and_turns_itself_off_at_batch_32(forwards_per_k):
    """SpecDecoder.step end to end on injected step times: the proposer's overhead and
    per-forward time are measured on its clock. With acceptance 0.5 at batch 32 the decoder
    stops calling the proposer and leaves every request without drafts, so the next step is
    a plain decode step. At batch 1 with acceptance 0.9, once steps there were measured, it
    drafts the full k."""
    clock = SimpleNamespace(t=0.0)
    prop = Counting(clock, forwards_per_k)
    dec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), 1000, proposer=prop, clock=lambda: clock.t)
    batch = _requests(32)
    for d in (0, 1, 0, 2, 0, 4) * 2:        # the model learns from drafting and plain steps alike
        dec.step(None, batch, _so(batch, d), decode_seconds(32, 32 * d))
    assert dec.cost.overhead == pytest.approx(0.002) and prop.calls > 0
    if forwards_per_k:
        assert dec.cost.per_forward == pytest.approx(0.010)
    for r in batch:                         # one draft each passes the threshold (0.49), the cap says no
        dec.rate[r.request_id] = 0.5
    calls = prop.calls
    for _ in range(5):                      # a wait shorter than any probe's
        dec.step(None, batch, _so(batch), decode_seconds(32, 0))
        assert dec.cap == 0 and all(r.spec_token_ids == [] for r in batch)
    assert prop.calls == calls
    one = _requests(1)
    dec.rate[one[0].request_id] = 0.9
    for d in (0, 2, 4, 0, 1, 3):            # batch 1 measured, drafting steps included
        dec.step(None, one, _so(one, d), decode_seconds(1, d))
    assert dec.cap == 4 and len(one[0].spec_token_ids) == 4 and prop.calls > calls


def test_engine_fits_the_whole_step_with_its_host_work(tiny_hf, monkeypatch):
    """Engine.step on a fake clock: the forward (executor.execute) takes A + B * tokens, and
    the scheduler's update after it H per verified draft (host work outside the forward).
    The decoder fits the whole step, so at the run's batch of 4 a draft costs B + H, not B:
    acceptance 0.5 then pays for no draft (it would with H left out), 0.95 still does."""
    from runtime import LLM
    from runtime.spec_decode import decoder as decoder_mod
    from tests.conftest import TINY_VOCAB
    from tests.test_parity import _prompts
    from tests.test_spec_decode import Echo, _all_free, _run
    H = 0.004
    path, _ = tiny_hf("llama")
    monkeypatch.setattr(decoder_mod, "make_proposer", lambda cfg: Echo())
    llm = LLM(path, speculative={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    eng, clock = llm.engine, SimpleNamespace(t=0.0)
    dec = eng.spec_decoder
    dec.clock = lambda: clock.t
    execute, update, k = eng.executor.execute, eng.scheduler.update, dec._k

    def timed_execute(so):
        clock.t += A + B * so.total_num_scheduled_tokens
        return execute(so)

    def timed_update(so, *args, **kwargs):
        clock.t += H * sum(map(len, so.spec_token_ids.values()))
        return update(so, *args, **kwargs)
    monkeypatch.setattr(eng.executor, "execute", timed_execute)
    monkeypatch.setattr(eng.scheduler, "update", timed_update)
    dec._k = lambda req, *a, **kw: min(k(req, *a, **kw), (0, 1, 2, 4)[dec.steps % 4])   # drafts vary
    prompt = _prompts(TINY_VOCAB)[5]
    _run(llm, [prompt] * 4, SamplingParams(temperature=0, max_tokens=60, min_tokens=60))
    assert dec.cost.decode.counts[2 * 2] > 5 and dec.cost.decode.counts[2 * 2 + 1] > 5   # batch 4: both regimes
    for d in (0, 4, 8, 16):
        assert dec.cost.verify_seconds(4, d) == pytest.approx(A + B * (4 + d) + H * d, rel=0.03)
    assert dec.cost.cap(4, np.full(4, 0.5), np.full(4, 4), lambda c: 0) == 0
    assert dec.cost.cap(4, np.full(4, 0.95), np.full(4, 4), lambda c: 0) > 0
    _all_free(llm)
