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
of accepted / proposed): k * rate drafts, rounded; a request whose rate falls so low that
this rounds to zero pauses and probes with one draft every `PROBE_EVERY` steps (only where
drafts are cheap: at a compute-bound batch the probes alone would cost), so a
request that stops copying stops paying for verification. k is also capped by what a draft
is worth at the current batch size (`StepCost`): on a compute-bound step only drafts likely
to be accepted pay for their verification. With `disable_by_batch_size`, no request
speculates while that many run.
"""
from __future__ import annotations

import numpy as np

from runtime.request import Request
from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.proposer import Proposer, make_proposer

EMA = 0.3            # weight of the latest step in a request's acceptance rate
PROBE_EVERY = 8      # a paused request proposes one draft this often (steps) ...
PROBE_BELOW = 0.5    # ... while a draft is cheap (StepCost threshold below this)


class StepCost:
    """An online fit of a step's seconds as alpha + beta * tokens (least squares over past
    steps, older ones decayed), from which a draft's worth follows: a step of B decodes makes
    B tokens in alpha + beta * B seconds, and a draft costs beta more; a draft accepted with
    probability P pays when P / beta > B / (alpha + beta * B), i.e. P > threshold(B). Where the
    forward streams weights (small batches) beta is small and every likely draft pays; where
    it is compute-bound (large batches on a CPU) only drafts that are nearly sure to be
    accepted do."""

    DECAY = 0.97
    MIN_STEPS = 8

    def __init__(self):
        self.w = self.n = self.nn = self.t = self.nt = 0.0
        self.steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.DECAY
        self.w, self.n, self.nn = d * self.w + 1, d * self.n + num_tokens, d * self.nn + num_tokens ** 2
        self.t, self.nt = d * self.t + seconds, d * self.nt + num_tokens * seconds
        self.steps += 1

    def threshold(self, num_decodes: int) -> float:
        """The acceptance probability a draft needs to pay in a step of `num_decodes`
        decodes (0 until enough steps of different sizes were seen)."""
        if self.steps < self.MIN_STEPS:
            return 0.0
        mean_n, mean_t = self.n / self.w, self.t / self.w
        var = self.nn / self.w - mean_n ** 2
        if var <= 1e-9:
            return 0.0
        beta = max(0.0, (self.nt / self.w - mean_n * mean_t) / var)
        alpha = max(mean_t - beta * mean_n, 1e-9)
        return beta * num_decodes / (alpha + beta * num_decodes)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or make_proposer(config)
        self.cost = StepCost()
        self.rate: dict[str, float] = {}          # request id -> acceptance rate (EMA)
        self.paused: dict[str, int] = {}          # request id -> steps since its last probe
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

    def _k(self, req: Request, threshold: float = 0.0) -> int:
        k = self.config.num_speculative_tokens
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        if self.config.adaptive:
            rid = req.request_id
            rate = self.rate.get(rid, 1.0)
            k = int(k * rate + 0.5)
            if threshold > 0:    # draft j is accepted with probability ~ rate^j: keep those that pay
                k = min(k, int(np.log(threshold) / np.log(rate)) if 0 < rate < 1 else (k if rate >= 1 else 0))
            if k == 0 and threshold < PROBE_BELOW:
                waited = self.paused.get(rid, 0) + 1
                self.paused[rid] = 0 if waited >= PROBE_EVERY else waited
                k = int(waited >= PROBE_EVERY)
        return max(0, min(k, room))

    def step(self, results: dict | None, running: list[Request], num_tokens: int = 0, seconds: float = 0.0) -> None:
        """Record the last step (its verified drafts; its size and time, for the cost fit),
        then propose for the next one."""
        if num_tokens:
            self.cost.observe(num_tokens, seconds)
        if results:
            for rid, res in results.items():
                self._record(rid, res.num_drafts, res.num_accepted)
        live = {r.request_id for r in running}
        if len(self.rate) > 2 * len(live) + 64:       # forget requests that left
            self.rate = {k: v for k, v in self.rate.items() if k in live}
            self.paused = {k: v for k, v in self.paused.items() if k in live}
        reqs, ks = [], []
        off = self.config.disable_by_batch_size is not None and len(running) >= self.config.disable_by_batch_size
        threshold = self.cost.threshold(len(running)) if self.config.adaptive else 0.0
        for req in running:
            k = self._k(req, threshold) if not off and self.eligible(req) else 0
            req.spec_token_ids = []
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if reqs:
            drafts = self.proposer.propose_requests(reqs, np.asarray(ks, dtype=np.int64))
            for req, d in zip(reqs, drafts):
                req.spec_token_ids = d

    def _record(self, rid: str, nd: int, acc: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += nd
        self.num_accepted_tokens += acc
        self.proposed_per_pos[:nd] += 1
        self.accepted_per_pos[:acc] += 1
        self.rate[rid] = (1 - EMA) * self.rate.get(rid, 1.0) + EMA * acc / nd

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
