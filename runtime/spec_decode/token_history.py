"""The token histories the n-gram proposer searches, kept as numpy rows between steps.

Prompt lookup searches the last `window` tokens of every speculating request. Building that
matrix from the requests' Python token lists in every step costs about 1 ms at batch 32
(one list-to-array conversion per request). `TokenHistory` keeps one int32 row per request
instead (a slot of one [slots, 2 * window] matrix). Each call brings a row in step with its
request by the difference alone:

- tokens the request committed since the last call are appended (only those are
  converted);
- a request whose tokens got shorter (a stop string cut the tokens after it) is
  truncated to the same length. A request's tokens only ever grow at the end, but for
  that cut, which finishes the request, so the length alone keeps a row in step;
- when a row fills up, its last `window` tokens move to the front, so appends cost O(1)
  amortised.

Rejected drafts never enter a request's tokens (`Request.all_token_ids`), and preemption
keeps them, so neither needs anything here. A slot belongs to one Request object: a new
request under an old id starts from scratch. Slots of requests that stopped proposing are
reclaimed when they outnumber the callers' requests (`sync`).

`matrix` gathers the rows of a batch right-aligned into one [batch, width] matrix (-1 left
of each row's tokens) with one fancy-indexed read, which is the layout the search takes.
"""
from __future__ import annotations

import numpy as np

PAD = -1     # never a token id, so it never matches


class TokenHistory:
    def __init__(self, window: int, slots: int = 64):
        self.window = window
        self.buf = np.full((slots, 2 * window), PAD, dtype=np.int32)
        self.count = np.zeros(slots, dtype=np.int64)      # tokens held in each slot (the request's last)
        self.entries: dict[str, list] = {}                # request id -> [Request, slot, its tokens synced]
        self.free = list(range(slots - 1, -1, -1))

    def _slot(self) -> int:
        if not self.free:               # double the slots
            n = len(self.count)
            self.buf = np.concatenate([self.buf, np.full_like(self.buf, PAD)])
            self.count = np.concatenate([self.count, np.zeros(n, dtype=np.int64)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()

    def _append(self, slot: int, tokens: list[int]) -> None:
        new = np.asarray(tokens[-self.window:], dtype=np.int32)
        m, c = len(new), int(self.count[slot])
        if c + m > self.buf.shape[1]:   # full: keep the last window - m tokens, at the front
            keep = min(c, self.window - m)
            self.buf[slot, :keep] = self.buf[slot, c - keep: c]
            c = keep
        self.buf[slot, c: c + m] = new
        self.count[slot] = c + m

    def sync(self, reqs) -> tuple[np.ndarray, np.ndarray]:
        """Bring the rows of `reqs` in step with their tokens; returns (slots, lengths
        searched: min(tokens, window)) in the order of `reqs`."""
        if len(self.entries) > 2 * len(reqs) + 64:     # forget requests that stopped proposing
            keep = {r.request_id for r in reqs}
            for rid in [rid for rid in self.entries if rid not in keep]:
                self.free.append(self.entries.pop(rid)[1])
        slots = np.empty(len(reqs), dtype=np.int64)
        lens = np.empty(len(reqs), dtype=np.int64)
        w = self.window
        for i, req in enumerate(reqs):
            e = self.entries.get(req.request_id)
            if e is None or e[0] is not req:
                e = self.entries[req.request_id] = [req, e[1] if e is not None else self._slot(), 0]
                self.count[e[1]] = 0
            slot, have, n = e[1], e[2], len(req.all_token_ids)
            if n < have:                # truncated
                held = int(self.count[slot]) - (have - n)
                if held >= min(n, w):
                    self.count[slot] = held
                else:                   # what is left is too short to search: start the row again
                    self.count[slot] = 0
                    self._append(slot, req.all_token_ids)
            elif n > have:
                self._append(slot, req.all_token_ids[max(have, n - w):])
            e[2] = n
            slots[i], lens[i] = slot, min(n, w)
        return slots, lens

    def matrix(self, slots: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """[len(slots), max(lens)] int32: row i holds the last lens[i] tokens of slot i,
        right-aligned (its last token in the last column), PAD before them."""
        width = int(lens.max()) if len(lens) else 0
        c = self.count[slots]
        cols = c[:, None] - width + np.arange(width)[None, :]        # buffer column of each matrix column
        mat = self.buf[slots[:, None], np.maximum(cols, 0)]
        mat[cols < (c - lens)[:, None]] = PAD
        return mat
