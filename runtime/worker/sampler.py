"""The Sampler: one vectorised pass over the batch's logits.

Greedy rows take the argmax; the others are scaled by temperature, filtered by top-k,
top-p and min-p, and sampled with the exponential-race trick (argmax of p / q with
q ~ Exp(1)), which needs no cumulative search and lets seeded rows draw their q from their
own generator while the rest share one draw. Only the seeded rows are looped over, to
fill their q; nothing loops over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zooinfer_kernels import lm_head
from zooinfer_kernels.lm_head import GreedyHead
from runtime.structured_outputs import apply_bitmask
from runtime.worker.logits_processors import LogitsEdits


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor          # [n] float32, 0 = greedy
    top_k: torch.Tensor | None         # [n] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None         # [n] float32
    min_p: torch.Tensor | None         # [n] float32
    generators: dict[int, torch.Generator]   # row -> per-request generator (seeded rows)
    all_greedy: bool
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    edits: LogitsEdits | None = None   # penalties, logit_bias, allowed_token_ids (None: no row has any)
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None   # (rows, int32 bitmask rows): structured outputs
    max_logprobs: int | None = None    # top-k logprobs to return (None: none requested)
    # (rows, ids [m, max_logprobs]): these rows report these ids' logprobs instead of their top-k
    logprob_ids: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor                    # [n] int64
    logprobs: torch.Tensor | None = None       # [n, 1 + k] sampled first, then top-k
    logprob_token_ids: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None  # [n] rank of the sampled token (1 = best)


# Top-p looks at this many best tokens first; a full-vocabulary sort is the fallback.
_CANDIDATES = 1024


def _top_p_mask(sorted_logits: torch.Tensor, drop: torch.Tensor, top_p: torch.Tensor,
                log_norm: torch.Tensor | None = None) -> torch.Tensor:
    """Extend `drop` (over descending-sorted logits) with each row's nucleus cut.

    Probabilities are normalised over the kept tokens, or by `log_norm` (a row's full
    logsumexp) when the sorted logits are only the head of the vocabulary."""
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    if log_norm is None:
        log_norm = masked.logsumexp(dim=-1)
    probs = (masked - log_norm[:, None]).exp()
    before = probs.cumsum(dim=-1) - probs      # mass strictly ahead of each token
    return drop | (before >= top_p[:, None])   # top_p > 0: the first token is always kept


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k / nucleus with -inf.

    A full-vocabulary sort is what makes naive top-p slow, so it is the last resort:
    top-k alone is a threshold at the k-th largest logit (one `topk`); top-p works on the
    best `_CANDIDATES` tokens (or the top-k, if larger), which is exact for a row whenever
    they hold at least `top_p` of its mass (SmolLM2 at temperature 1: median 0.998). Only
    the rows whose nucleus reaches past them are sorted in full.
    """
    vocab = logits.shape[-1]
    has_k = None if top_k is None else top_k > 0
    k = None if top_k is None else torch.where(has_k, top_k, vocab).clamp(max=vocab)
    if top_p is None:
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, float("-inf"))
    n_cand = min(vocab, max(_CANDIDATES, int(top_k.max()) if top_k is not None else 0))
    vals, idx = logits.topk(n_cand, dim=-1)            # sorted, descending
    ranks = torch.arange(n_cand, device=logits.device)
    drop = torch.zeros_like(vals, dtype=torch.bool) if k is None else ranks[None, :] >= k[:, None]
    # Rows with top-k normalise over their k tokens (all among the candidates).
    kept_lse = vals.masked_fill(drop, float("-inf")).logsumexp(dim=-1)
    log_norm = logits.logsumexp(dim=-1)
    if has_k is not None:
        log_norm = torch.where(has_k, kept_lse, log_norm)
    drop = _top_p_mask(vals, drop, top_p, log_norm)
    out = torch.full_like(logits, float("-inf")).scatter_(-1, idx, vals.masked_fill(drop, float("-inf")))
    if n_cand < vocab:
        spill = torch.nonzero((kept_lse - log_norm).exp() < top_p).flatten()
        if len(spill):   # these rows' nucleus reaches past the candidates: sort them fully
            sorted_logits, order = logits[spill].sort(dim=-1, descending=True)
            full_drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
            if k is not None:
                full_drop = torch.arange(vocab, device=logits.device)[None, :] >= k[spill, None]
            full_drop = _top_p_mask(sorted_logits, full_drop, top_p[spill])
            out[spill] = torch.empty_like(sorted_logits).scatter_(
                -1, order, sorted_logits.masked_fill(full_drop, float("-inf")))
    return out


def _exponential(shape, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Exp(1) noise as -log(U): same distribution as `exponential_`, several times faster on CPU.
    A per-request generator lives on the CPU: its draws are made there and moved, so a seed
    gives the same noise on every device."""
    if generator is not None and torch.device(device or "cpu") != generator.device:
        return torch.rand(shape, generator=generator).clamp_(min=1e-20).log_().neg_().to(device)
    return torch.rand(shape, generator=generator, device=device).clamp_(min=1e-20).log_().neg_()


class Sampler:
    def __init__(self, greedy_head: GreedyHead | None = None):
        # picks the argmax path for greedy rows (no LM head here: the sampler sees logits)
        self.greedy_head = greedy_head or GreedyHead()

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw, logits = self.prepare(logits, meta)
        if meta.all_greedy:
            sampled = self.greedy_head.argmax(logits)
        else:
            sampled = self._sample(logits, meta)
        out = SamplerOutput(token_ids=sampled)
        if meta.max_logprobs is not None:
            self._gather_logprobs(raw, sampled, meta.max_logprobs, out, meta.logprob_ids)
        return out

    def prepare(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw float logits, kept for logprobs; the logits after edits, bans and grammar)."""
        raw = logits.float()
        logits = raw if meta.edits is None else meta.edits.apply(raw)   # raw stays intact for logprobs
        if meta.banned is not None:
            if logits is raw:
                logits = raw.clone()
            rows, tokens = meta.banned
            logits[rows, tokens] = float("-inf")
        if meta.grammar is not None:
            if logits is raw:
                logits = raw.clone()
            apply_bitmask(logits, *meta.grammar)
        return raw, logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_rows = meta.temperature == 0
        greedy = self.greedy_head.argmax(logits)
        probs = self.probs(logits, meta)
        q = _exponential(probs.shape, device=probs.device)
        for row, gen in meta.generators.items():
            q[row] = _exponential(probs.shape[-1:], generator=gen, device=probs.device)
        sampled = lm_head.argmax(probs / q)   # the exponential race: the same exact argmax
        return torch.where(greedy_rows, greedy, sampled)

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Each row's sampling distribution: temperature (1 for greedy rows), top-k, top-p,
        min-p (speculative verification draws from the same one)."""
        greedy_rows = meta.temperature == 0
        temp = torch.where(greedy_rows, 1.0, meta.temperature)
        logits = logits / temp[:, None]
        if meta.top_k is not None or meta.top_p is not None:
            logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        if meta.min_p is not None:
            floor = meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    @staticmethod
    def _gather_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int, out: SamplerOutput,
                         explicit: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(-1, sampled[:, None])
        out.sampled_ranks = (logprobs > chosen).sum(dim=-1) + 1
        if k > 0:
            top_vals, top_ids = logprobs.topk(k, dim=-1)
            if explicit is not None:      # logprob_token_ids rows: their ids in place of the top-k
                rows, ids = explicit
                top_ids[rows] = ids
                top_vals = logprobs.gather(-1, top_ids)
            out.logprobs = torch.cat([chosen, top_vals], dim=-1)
            out.logprob_token_ids = torch.cat([sampled[:, None], top_ids], dim=-1)
        else:
            out.logprobs, out.logprob_token_ids = chosen, sampled[:, None]
