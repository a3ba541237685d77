"""The engine's side of speculative decoding: who speculates, how far, and how well it went.

After every step `SpecDecoder.step` records each verified request's acceptance and asks the
proposer for the next drafts of the running requests that may speculate. A request may when
its drafts can be verified exactly as its tokens would be sampled one at a time:

- it samples its own tokens (not a beam, whose tokens come from the search above);
- no logit edit depends on the tokens before a draft position: no penalties, logit_bias,
  allowed_token_ids, bad_words or structured outputs (they would need per-position state);
- it has at least min_tokens outputs, if it has stop tokens (they are banned until then);
- it has room: a draft run plus its next token never passes max_tokens or max_model_len.

Per-request k adapts to the request's measured acceptance (an exponential moving average
of accepted / proposed): k * rate drafts, rounded. A request whose rate falls so low that
this rounds to zero pauses. It probes with one draft after a wait that doubles with every
probe that fails (`PROBE_EVERY` steps at first where drafts are cheap, `PROBE_COSTLY` where
the batch is compute-bound, at most `PROBE_MAX`), so a request that stops copying stops
paying for verification. Probes fall on engine steps that are multiples of the wait, so the
paused requests probe together in one verifying step, not one request in every step.

The decode-local cost model (runtime/spec_decode/cost_model.py) decides the rest, step by
step, from measured times. First, each request's k is cut to the drafts whose acceptance
(rate^j for draft j) beats their marginal verification cost at the current batch size
(`threshold`). Then one cap on k for the whole step is chosen by expected tokens per second
(`cap`). That choice counts the proposer's own time: its per-call overhead, and the draft
model's or MTP head's forwards. A cap of 0 makes the step a plain decode step: nothing is
proposed and nothing is verified. A request the cap leaves without drafts is paused like
one whose rate is too low, so it probes on the same schedule: probes are how acceptance is
learned again.

A new request starts from the engine's measured acceptance (`prior`, an EMA over every
verification) where drafts cost or their cost at this batch size is not measured yet, and
optimistic (rate 1) only where they are known to be cheap.
With `disable_by_batch_size`, no request speculates while that many run.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from runtime.request import Request
from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.cost_model import StepCost
from runtime.spec_decode.proposer import Proposer, make_proposer

EMA = 0.3            # weight of the latest step in a request's acceptance rate
PRIOR_EMA = 0.05     # weight of one verification in the engine-wide acceptance (`prior`)
CHEAP = 0.25         # a draft is cheap while the cost model's threshold is below this
PROBE_EVERY = 8      # a paused request's first probe (one draft) after this many steps if cheap,
PROBE_COSTLY = 32    # after this many if not; each failed probe doubles the wait
PROBE_MAX = 256


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or make_proposer(config)
        self.cost = StepCost()
        self.clock = clock                        # times the proposer (tests inject one)
        self.steps = 0                            # engine steps seen: probes fall on multiples of their wait
        self.cap = config.num_speculative_tokens  # the last step's k cap (0: a plain step)
        self.rate: dict[str, float] = {}          # request id -> acceptance rate (EMA)
        self.prior = 1.0                          # acceptance over all requests (EMA): a new one's rate
        self.paused: dict[str, int] = {}          # request id -> steps since its last probe
        self.wait: dict[str, int] = {}            # request id -> steps its next probe waits (backoff)
        self.probing: set[str] = set()            # requests whose drafts this step are a probe
        k = config.num_speculative_tokens
        self.num_drafts = 0                       # verifications (requests x steps with drafts)
        self.num_draft_tokens = 0                 # draft tokens verified
        self.num_accepted_tokens = 0
        self.accepted_per_pos = np.zeros(k, dtype=np.int64)   # position j accepted (j+1 drafts ran)
        self.proposed_per_pos = np.zeros(k, dtype=np.int64)

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.sampling_params
        bans = p.stop_token_ids or (req.eos_token_ids and not p.ignore_eos)   # what min_tokens masks
        return (not req.external_tokens and req.num_output_tokens >= (max(1, p.min_tokens) if bans else 1)
                and not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                         or p.logit_bias or p.allowed_token_ids is not None or p.bad_words_token_ids
                         or p.structured_outputs is not None))

    def _want(self, req: Request, threshold: float = 0.0, explored: bool = True) -> int:
        """The drafts a request's acceptance and room are worth at this `threshold` (`explored`:
        drafting steps were measured at this batch size)."""
        k = self.config.num_speculative_tokens
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        if self.config.adaptive:
            rid = req.request_id
            rate = self.rate.get(rid)
            if rate is None:     # optimistic where a wrong guess is known to be cheap, else what others measured
                rate = self.rate[rid] = 1.0 if threshold < CHEAP and explored else self.prior
            k = int(k * rate + 0.5)
            if threshold > 0:    # draft j is accepted with probability ~ rate^j: keep those that pay
                k = min(k, int(np.log(threshold) / np.log(rate)) if 0 < rate < 1 else (k if rate >= 1 else 0))
        return max(0, min(k, room))

    def _k(self, req: Request, threshold: float = 0.0, cap: int | None = None, want: int | None = None) -> int:
        """This step's drafts for `req`: what it wants (`_want`), under the step's `cap`. A
        request left with none is paused, and it probes with one draft when its wait is up."""
        k = self._want(req, threshold) if want is None else want
        if not self.config.adaptive:
            return k
        if cap is not None:
            k = min(k, cap)
        rid = req.request_id
        if k > 0:
            self.paused.pop(rid, None)
            return k
        waited = self.paused.get(rid, 0) + 1
        wait = self.wait.get(rid) or (PROBE_EVERY if threshold < CHEAP else PROBE_COSTLY)
        self.wait[rid] = wait
        k = int(waited >= wait and self.steps % wait == 0)
        self.paused[rid] = 0 if k else waited
        if k:
            self.probing.add(rid)
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        return min(k, max(0, room))

    def step(self, results: dict | None, running: list[Request], so=None, seconds: float = 0.0) -> None:
        """Record the last step (its verified drafts; `so`, its SchedulerOutput, and its
        engine `seconds`, the whole step but the proposer, for the cost model), then
        propose for the next one."""
        if so is not None and so.total_num_scheduled_tokens:
            drafts = sum(map(len, so.spec_token_ids.values()))
            self.cost.observe_step(len(so.num_scheduled_tokens), drafts, so.total_num_scheduled_tokens, seconds)
        if results:
            for rid, res in results.items():
                self._record(rid, res.num_drafts, res.num_accepted)
        self.steps += 1
        live = {r.request_id for r in running}
        if len(self.rate) > 2 * len(live) + 64:       # forget requests that left
            self.rate = {k: v for k, v in self.rate.items() if k in live}
            self.paused = {k: v for k, v in self.paused.items() if k in live}
            self.wait = {k: v for k, v in self.wait.items() if k in live}
        self.probing.clear()
        for req in running:
            if req.spec_token_ids:
                req.spec_token_ids = []
        off = self.config.disable_by_batch_size is not None and len(running) >= self.config.disable_by_batch_size
        cands = [] if off else [req for req in running if self.eligible(req)]
        if not cands:
            return
        threshold = self.cost.threshold(len(running)) if self.config.adaptive else 0.0
        explored = self.cost.explored(len(running))
        want = np.fromiter((self._want(r, threshold, explored) for r in cands), dtype=np.int64, count=len(cands))
        cap = None
        if self.config.adaptive and want.any():
            on = np.flatnonzero(want)
            alpha = np.fromiter((self.rate[cands[i].request_id] for i in on.tolist()), dtype=np.float64,
                                count=len(on))
            cap = self.cap = self.cost.cap(len(running), alpha, want[on], self.proposer.forwards)
        ks = np.fromiter((self._k(r, threshold, cap, w) for r, w in zip(cands, want.tolist())), dtype=np.int64,
                         count=len(cands))
        live_k = np.flatnonzero(ks)
        if not len(live_k):
            return
        reqs = [cands[i] for i in live_k.tolist()]
        forwards, fwd_seconds = self.proposer.forward_stats()
        started = self.clock()
        drafts = self.proposer.propose_requests(reqs, ks[live_k])
        seconds = self.clock() - started
        f1, s1 = self.proposer.forward_stats()
        self.cost.observe_proposer(seconds, f1 - forwards, s1 - fwd_seconds)
        for req, d in zip(reqs, drafts):
            req.spec_token_ids = d

    def _record(self, rid: str, nd: int, acc: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += nd
        self.num_accepted_tokens += acc
        self.proposed_per_pos[:nd] += 1
        self.accepted_per_pos[:acc] += 1
        self.rate[rid] = (1 - EMA) * self.rate.get(rid, self.prior) + EMA * acc / nd
        self.prior = (1 - PRIOR_EMA) * self.prior + PRIOR_EMA * acc / nd
        if rid in self.probing:      # a failed probe doubles the wait for the next, a good one resets it
            self.wait[rid] = min(PROBE_MAX, 2 * self.wait[rid]) if acc == 0 else 0

    def stats(self) -> dict:
        """Counters for kv_cache_stats() and /metrics (vLLM's spec_decode names)."""
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
                "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / max(1, self.num_drafts),
                "spec_decode_acceptance_per_position": (self.accepted_per_pos
                                                        / np.maximum(self.proposed_per_pos, 1)).tolist(),
                "spec_decode_num_accepted_tokens_per_pos": self.accepted_per_pos.tolist()}
