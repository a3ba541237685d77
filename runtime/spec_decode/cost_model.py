"""Does drafting pay at this batch size? A decode-local cost model of one step.

It is fitted online, from the engine's own step times, and has three parts:

- Verification: decode-only steps (every scheduled request computes its one next token plus
  its drafts) are fitted as seconds = a + b * N + e * D, per batch-size bucket (with the fit
  over all buckets as the prior). N is the number of tokens in the forward (rows + drafts) and
  D the number of drafts, so e is what a draft token costs beyond a plain row token (its
  logits, its verification, its share of the verifier's fixed cost). A separate fixed term per
  drafting step was tried and dropped: steps draft 3-4 tokens per row nearly always, so the
  two drafting terms could not be told apart, and under load the fit swung to +55 ms a draft
  and -150 ms a drafting step at batch 1 (measured). That switched off drafts that paid.
  The seconds are the engine's whole step (Engine.step: schedule, forward, sampling or
  verification, the scheduler's bookkeeping, the outputs; the proposer is timed apart),
  not the forward alone: the host work a verified step adds (lookahead slots, rejection,
  rollback, several tokens per request to hand out) is part of what a draft costs, and
  timing only the forward left it out (ngram at batch 32 on copy: 0.96x of off, issue 19).
- Prefill: steps that carry a prefill chunk are fitted apart, as a' + b' * tokens. Their
  tokens skip the LM head and come in long chunks, so they are cheaper than decode tokens, and
  mixing them in made drafts at batch 32 look almost free (issue 19). The prefill fit is only
  the prior of the decode fit: its slope decides b where decode steps never varied in size
  (batch 1, or 32 requests that finish together), and the intercept a takes the rest.
- The proposer's own time, measured around each proposal call: a per-call overhead (ngram's
  numpy search, the draft's bookkeeping) and the seconds per draft-model forward. These are
  the draft model's k forwards or an MTP head's k - 1 forwards, and the proposer says how many
  it runs for a given k (`Proposer.forwards`).

Every fit is a least-squares fit with older observations decayed, plus a ridge prior worth
`PRIOR_WEIGHT` observations. A coefficient the data cannot identify yet (e before any draft
ran) therefore sits at its prior (0) and does not jump to an arbitrary value.

Two decisions are taken from the model (`SpecDecoder.step`):
- `threshold(R)`: the acceptance a single draft needs before its marginal verification cost
  pays at R rows. R rows make R tokens in t(R) seconds, and a draft adds b + e seconds, so it
  pays when its acceptance is above (b + e) * R / t(R).
- `cap(R, alpha, ks)`: the largest k worth proposing this step, or 0 for a plain step.
  Request i with acceptance rate alpha_i and k_i drafts is expected to commit
  1 + sum_{j <= k_i} alpha_i^j tokens. Every cap K in 0..max(ks) is scored by expected
  tokens / predicted seconds (verification plus the proposer's overhead and forwards at K).
  The best score wins, and ties go to the smaller K; drafting (K > 0) must beat the plain
  step by `MARGIN`. At batch 32 on this CPU a draft token costs ~70% of a row token (8 ms
  against 11 ms, measured), so even acceptance 0.84 gains only ~5% a step, about the fit's
  error, and a closed batch then pays for the requests it let run ahead: they finish
  early and leave the rest to run at a smaller, less efficient batch (copy at batch 32 ran
  0.96x of off that way, issue 19). At batch 1 a paying draft gains far more than the
  margin. At a batch-size bucket where no drafting
  step was seen yet, the cap is at most 1. At batch 32 on a CPU a draft token costs about a
  row token, so an optimistic k = 4 round there costs several steps' time, and one draft
  per request is enough to measure the cost.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

DECAY = 0.97          # weight of an observation per later observation of the same fit
PRIOR_WEIGHT = 0.1    # the ridge prior counts as this many observations (it decides unseen directions)
EMA = 0.2             # weight of the latest proposal call in the proposer's timings
MIN_STEPS = 8         # steps (decode or prefill) seen before the model decides anything
BUCKETS = 10          # decode steps are kept per batch-size bucket floor(log2(rows)): 1, 2-3, 4-7, ...
BUCKET_PRIOR = 0.01   # the all-bucket fit, as a bucket's prior, counts as this many observations
MARGIN = 0.05         # a drafting cap must beat the plain step's expected tokens per second by this


def bucket(rows: int) -> int:
    return min(max(int(rows), 1).bit_length() - 1, BUCKETS - 1)


class DecayedFit:
    """Weighted least squares y ~ x @ theta (weights DECAY^age), solved with a ridge prior:
    coefficient i is pulled toward prior[i] as strongly as PRIOR_WEIGHT observations whose
    feature i has its typical magnitude. A PRIOR_WEIGHT of 0 on the intercept is fine, since
    its feature is always 1.

    Observations come in `regimes` (for the decode fit: plain steps and drafting steps), and
    each regime's statistics decay only with its own observations. Otherwise a long run of
    plain steps would wash out what drafting steps cost. The drafts would then look free
    again, and speculation would switch back on just to learn the same cost once more."""

    def __init__(self, n: int, regimes: int = 1):
        self.xx = np.zeros((regimes, n, n))
        self.xy = np.zeros((regimes, n))
        self.w = np.zeros(regimes)
        self.steps = 0
        self.counts = np.zeros(regimes, dtype=np.int64)   # observations per regime (bench output)

    def observe(self, x, y: float, regime: int = 0) -> None:
        x = np.asarray(x, dtype=np.float64)
        self.xx[regime] = DECAY * self.xx[regime] + np.outer(x, x)
        self.xy[regime] = DECAY * self.xy[regime] + x * y
        self.w[regime] = DECAY * self.w[regime] + 1.0
        self.steps += 1
        self.counts[regime] += 1

    def solve(self, prior: np.ndarray, weight: np.ndarray, regime_weights: np.ndarray | None = None) -> np.ndarray:
        """The coefficients, with each regime's statistics scaled by `regime_weights` (default 1)."""
        rw = np.ones(len(self.w)) if regime_weights is None else regime_weights
        xx, xy, w = np.tensordot(rw, self.xx, 1), rw @ self.xy, rw @ self.w
        ridge = weight * np.maximum(np.diag(xx) / max(w, 1e-12), 1.0)
        return np.linalg.solve(xx + np.diag(ridge), xy + ridge * prior)


class StepCost:
    def __init__(self):
        # [1, N, D] -> engine seconds of a decode-only step; regime 2 * bucket + (any draft)
        self.decode = DecayedFit(3, 2 * BUCKETS)
        self.prefill = DecayedFit(2)      # [1, tokens] -> engine seconds of a step with a prefill chunk
        self.overhead = 0.0               # seconds per proposal call beyond the draft's forwards
        self.per_forward = 0.0            # seconds per draft-model / MTP forward in a proposal
        self.calls = 0
        self._theta: dict[int, np.ndarray] = {}   # bucket (-1: all) -> decode fit coefficients, per observation

    # ------------------------------------------------------------------ observations
    def observe_step(self, rows: int, drafts: int, tokens: int, seconds: float) -> None:
        """One engine step of `seconds`: `rows` scheduled requests, `drafts` draft tokens among
        its `tokens` scheduled tokens. It is a decode-only step when tokens == rows + drafts."""
        if tokens == rows + drafts:
            self.decode.observe((1.0, tokens, drafts), seconds, 2 * bucket(rows) + (drafts > 0))
        else:
            self.prefill.observe((1.0, tokens), seconds)
        self._theta.clear()

    def observe_proposer(self, seconds: float, forwards: int, forward_seconds: float) -> None:
        """One proposal call: its seconds, and how many draft forwards it ran in how many of them."""
        per = forward_seconds / forwards if forwards else None
        rest = max(0.0, seconds - forward_seconds)
        if not self.calls:
            self.overhead, self.per_forward = rest, per or 0.0
        else:
            self.overhead = (1 - EMA) * self.overhead + EMA * rest
            if per is not None:
                self.per_forward = per if not self.per_forward else (1 - EMA) * self.per_forward + EMA * per
        self.calls += 1

    # ------------------------------------------------------------------ the model
    @property
    def ready(self) -> bool:
        return self.decode.steps + self.prefill.steps >= MIN_STEPS and self.decode.steps > 0

    def theta(self, rows: int) -> np.ndarray:
        """(a, b, e) of the decode fit at `rows` rows. It is fitted on the steps of its
        batch-size bucket only, with the fit over every bucket as its prior. A step's cost is
        not linear from batch 1 to batch 32: it is bound by streaming the weights first and by
        compute later, and the big batches' many drafts would otherwise set the slope of
        batch 1. The all-bucket fit has the prefill fit's slope b' as the prior of b, and its
        intercept is free: where the data cannot split a from b, a takes the rest."""
        key = bucket(rows)
        if key not in self._theta:
            if -1 not in self._theta:
                prior = np.zeros(3)
                if self.prefill.steps >= 2:
                    prior[1] = max(0.0, self.prefill.solve(np.zeros(2), np.array([0.0, PRIOR_WEIGHT]))[1])
                self._theta[-1] = self.decode.solve(prior, np.array([0.0, PRIOR_WEIGHT, PRIOR_WEIGHT]))
            mine = np.zeros(2 * BUCKETS)
            mine[2 * key: 2 * key + 2] = 1.0
            self._theta[key] = self.decode.solve(self._theta[-1], np.full(3, BUCKET_PRIOR), mine)
        return self._theta[key]

    def explored(self, rows: int) -> bool:
        """Whether drafting steps were seen at this batch-size bucket (until then what a draft
        costs here is extrapolated from other batch sizes)."""
        return self.decode.w[2 * bucket(rows) + 1] > 0

    def verify_seconds(self, rows: int, drafts: np.ndarray) -> np.ndarray:
        """Predicted engine seconds of a decode step of `rows` rows and `drafts` drafts (array)."""
        a, b, e = self.theta(rows)
        d = np.asarray(drafts, dtype=np.float64)
        return np.maximum(a + b * (rows + d) + max(e, -b) * d, 1e-9)

    def proposer_seconds(self, forwards: np.ndarray) -> np.ndarray:
        return self.overhead + self.per_forward * np.asarray(forwards, dtype=np.float64)

    def threshold(self, rows: int) -> float:
        """The acceptance a draft needs to pay its marginal verification at `rows` rows (0 until ready)."""
        if not self.ready or rows <= 0:
            return 0.0
        _, b, e = self.theta(rows)
        return max(0.0, b + e) * rows / float(self.verify_seconds(rows, 0))

    def cap(self, rows: int, alpha: np.ndarray, ks: np.ndarray, forwards: Callable[[int], int]) -> int:
        """The k cap (0: no drafts) that maximises expected tokens per second this step, for
        `rows` decoding rows, of which the drafting ones have acceptance `alpha` and want `ks`."""
        kmax = int(ks.max()) if len(ks) else 0
        if not self.explored(rows):     # one draft each measures the cost here, more could cost a lot
            kmax = min(kmax, 1)
        if not self.ready or kmax == 0:
            return kmax
        caps = np.arange(kmax + 1)
        a = np.clip(alpha, 0.0, 1.0)[:, None]
        gain = np.concatenate([np.zeros((len(ks), 1)), np.cumsum(a ** caps[None, 1:], axis=1)], axis=1)
        k = np.minimum(ks[:, None], caps[None, :])                       # [n, K+1] drafts at each cap
        tokens = rows + np.take_along_axis(gain, k, axis=1).sum(axis=0)
        drafts = k.sum(axis=0)
        fwd = np.array([forwards(int(c)) for c in caps])
        seconds = self.verify_seconds(rows, drafts) + np.where(drafts > 0, self.proposer_seconds(fwd), 0.0)
        score = tokens / seconds
        score[1:] /= 1.0 + MARGIN
        return int(np.argmax(score))

    def describe(self, rows: int) -> str:
        """One line for bench output: the fit at `rows` rows."""
        if not self.ready:
            return f"cost model not fitted yet ({self.decode.steps} decode steps)"
        _, b, e = self.theta(rows)
        return (f"step {self.verify_seconds(rows, 0).item() * 1e3:.1f} ms at {rows} rows; a draft token "
                f"+{max(b + e, 0) * 1e3:.2f} ms, proposer "
                f"{self.overhead * 1e3:.2f} ms + {self.per_forward * 1e3:.2f} ms/forward; "
                f"a draft pays above acceptance {self.threshold(rows):.2f}")
