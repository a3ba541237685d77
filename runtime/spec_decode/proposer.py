"""Draft proposers: given each speculating request's tokens so far, guess its next tokens.

A proposer only guesses; the target model verifies every guess in the next step
(runtime/spec_decode/rejection.py), so a bad guess costs compute, never correctness. Drafts
are point guesses (a proposal distribution that is one token with probability 1), which
is what rejection sampling is told.

`NgramProposer` is prompt lookup (vLLM's `ngram` method): the longest suffix of the
request's tokens, `prompt_lookup_max` down to `prompt_lookup_min` tokens, is searched for
earlier in the prompt + output, and the tokens that followed its latest earlier occurrence
are the draft. The search is one numpy comparison of the whole batch per suffix length
(rows right-aligned in a padded matrix), not a loop over requests or tokens, and the matrix
comes from per-request numpy rows kept between steps (token_history.py), not from the
requests' token lists.
"""
from __future__ import annotations

import numpy as np

from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.token_history import PAD, TokenHistory


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
        self.history = TokenHistory(search_window)

    def propose(self, token_ids: list[list[int]], ks: np.ndarray) -> list[list[int]]:
        """Drafts from token lists (the matrix is built from them: for callers without requests)."""
        b = len(token_ids)
        if not b:
            return []
        lens = np.fromiter((min(len(t), self.search_window) for t in token_ids), dtype=np.int64, count=b)
        width = int(lens.max())
        mat = np.full((b, width), PAD, dtype=np.int32)
        for i, t in enumerate(token_ids):     # right-aligned: every row's suffix ends at column width-1
            mat[i, width - lens[i]:] = t[len(t) - lens[i]:]
        return self.search(mat, lens, ks)

    def propose_requests(self, reqs, ks: np.ndarray) -> list[list[int]]:
        """Drafts from the requests' rows in the token history (kept between steps)."""
        if not len(reqs):
            return []
        slots, lens = self.history.sync(reqs)
        return self.search(self.history.matrix(slots, lens), lens, ks)

    def search(self, mat: np.ndarray, lens: np.ndarray, ks: np.ndarray) -> list[list[int]]:
        """Prompt lookup over `mat` (rows right-aligned, PAD-filled, row i's last lens[i]
        columns its tokens): at most ks[i] drafts for row i.

        Windows are aligned by their last token e (e <= width - 2: a token follows). After
        pass j, match[:, e] says the j + 1 tokens ending at e equal the row's last j + 1
        tokens, so every suffix length costs one comparison of the matrix, and the longest
        length with a match wins, at its latest occurrence."""
        b, width = mat.shape
        kmax = int(ks.max()) if len(ks) else 0
        if kmax == 0 or width < 2:
            return [[] for _ in range(b)]
        start = np.full(b, -1, dtype=np.int64)       # where each draft starts in mat, -1: no match
        match = np.ones((b, width - 1), dtype=bool)
        last = width - 2 - np.arange(width - 1)      # e of each column of match[:, ::-1]
        for j in range(min(self.n_max, width - 1)):
            match[:, j:] &= mat[:, : width - 1 - j] == mat[:, width - 1 - j, None]
            match[:, :j] = False
            n = j + 1
            if n < self.n_min:
                continue
            found = match.any(axis=1) & (lens > n)    # a suffix of n tokens needs n + 1 tokens
            e = last[np.argmax(match[:, ::-1], axis=1)]           # the latest window
            start = np.where(found, e + 1, start)    # longer suffixes come later and win
        cols = start[:, None] + np.arange(kmax)[None, :]
        valid = (start[:, None] >= 0) & (cols < width) & (np.arange(kmax)[None, :] < ks[:, None])
        drafts = mat[np.arange(b)[:, None], np.clip(cols, 0, width - 1)]
        counts = valid.sum(axis=1)
        return [d[:c].tolist() for d, c in zip(drafts, counts.tolist())]


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative.method: {config.method!r} is not implemented")
