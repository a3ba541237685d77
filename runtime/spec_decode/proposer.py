"""Draft proposers: given each speculating request's tokens so far, guess its next tokens.

A proposer only guesses; the target model verifies every guess in the next step
(runtime/spec_decode/rejection.py), so a bad guess costs compute, never correctness. Drafts
are point guesses (a proposal distribution that is one token with probability 1), which
is what rejection sampling is told.

`NgramProposer` is prompt lookup (vLLM's `ngram` method): the longest suffix of the
request's tokens, `prompt_lookup_max` down to `prompt_lookup_min` tokens, is searched for
earlier in the prompt + output, and the tokens that followed its latest earlier occurrence
are the draft. The search is one set of numpy comparisons over the whole batch (rows
right-aligned in a padded matrix), not a loop over requests or tokens.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from runtime.spec_decode.config import SpeculativeConfig

_PAD = -1     # never a token id, so it never matches


class Proposer:
    """One method: drafts for a batch of token sequences, at most `ks[i]` tokens for row i."""

    def propose(self, token_ids: list[list[int]], ks: np.ndarray) -> list[list[int]]:
        raise NotImplementedError

    def propose_requests(self, reqs, ks: np.ndarray) -> list[list[int]]:
        """The same from the requests themselves (a draft model needs their ids and slots)."""
        return self.propose([r.all_token_ids for r in reqs], ks)

    def forwards(self, k: int) -> int:
        """Model forwards a proposal of at most k drafts runs (the cost model's count): none here."""
        return 0

    def forward_stats(self) -> tuple[int, float]:
        """(forwards, seconds in them) run so far, for the cost model's per-forward time."""
        return 0, 0.0


class NgramProposer(Proposer):
    def __init__(self, k: int, n_min: int, n_max: int, search_window: int = 1024):
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.search_window = search_window     # only the last this-many tokens are searched

    def propose(self, token_ids: list[list[int]], ks: np.ndarray) -> list[list[int]]:
        b = len(token_ids)
        if not b:
            return []
        lens = np.fromiter((min(len(t), self.search_window) for t in token_ids), dtype=np.int64, count=b)
        width = int(lens.max())
        mat = np.full((b, width), _PAD, dtype=np.int64)
        for i, t in enumerate(token_ids):     # right-aligned: every row's suffix ends at column width-1
            mat[i, width - lens[i]:] = t[len(t) - lens[i]:]
        start = np.full(b, -1, dtype=np.int64)      # where the draft starts in mat, -1: no match yet
        for n in range(min(self.n_max, width - 1), self.n_min - 1, -1):
            todo = (start < 0) & (lens > n)
            if not todo.any():
                break
            rows = np.flatnonzero(todo)
            suffix = mat[rows, width - n:]                                   # [r, n]
            # windows starting at s = 0 .. width-n-1 (each has a token after it; the
            # suffix's own position s = width-n is excluded)
            windows = sliding_window_view(mat[rows, : width - 1], n, axis=1)  # [r, width-n, n]
            match = (windows == suffix[:, None, :]).all(axis=-1)
            found = match.any(axis=1)
            last = match.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)    # latest occurrence
            start[rows[found]] = last[found] + n
        kmax = int(ks.max()) if len(ks) else 0
        if kmax == 0:
            return [[] for _ in range(b)]
        cols = start[:, None] + np.arange(kmax)[None, :]
        valid = (start[:, None] >= 0) & (cols < width) & (np.arange(kmax)[None, :] < ks[:, None])
        drafts = mat[np.arange(b)[:, None], np.clip(cols, 0, width - 1)]
        counts = valid.sum(axis=1)
        return [d[:c].tolist() for d, c in zip(drafts, counts.tolist())]


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative.method: {config.method!r} is not implemented")
