"""Per-request logit edits applied before sampling, vectorised over the batch's rows.

Order (vLLM's): `allowed_token_ids` masks everything else, `logit_bias` adds its biases,
`bad_words` bans the last token of each bad word whose other tokens end the output so far
(a one-token word is always banned), then the penalties:
- repetition_penalty p (HF / CTRL): every token seen in the prompt or the output so far has
  its logit divided by p when positive, multiplied by p when negative;
- frequency_penalty f and presence_penalty r (OpenAI): logit -= f * count + r * (count > 0),
  counting output tokens only.
Stop tokens banned until `min_tokens` (the sampler's `banned`) come last. Logprobs are still
reported from the model's own logits.

Counts come from one scatter over a [rows, max tokens] gather of the persistent batch's token
ids, so nothing loops over tokens; only the rows that use an option pay for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class LogitsEdits:
    """What the step's sampled rows ask for, as tensors (rows = positions in the step)."""
    penalty_rows: torch.Tensor | None = None       # [m] rows with any penalty
    token_ids: torch.Tensor | None = None          # [m, L] prompt + output, padded with vocab
    output_mask: torch.Tensor | None = None        # [m, L] True where the token is an output
    repetition: torch.Tensor | None = None         # [m]
    frequency: torch.Tensor | None = None          # [m]
    presence: torch.Tensor | None = None           # [m]
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, ids, values)
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None    # (rows, ids): all else masked
    allowed_rows: torch.Tensor | None = None       # rows that have an allowed list
    banned: tuple[torch.Tensor, torch.Tensor] | None = None     # (rows, ids) of bad words' last tokens

    @staticmethod
    def build(batch, rows: np.ndarray, vocab: int, device) -> LogitsEdits | None:
        """From the persistent batch's rows `rows` (in step order); None when no row edits."""
        rep, freq, pres = batch.repetition_penalty[rows], batch.frequency_penalty[rows], batch.presence_penalty[rows]
        pen = np.flatnonzero((rep != 1) | (freq != 0) | (pres != 0))
        bias_rows = [i for i, r in enumerate(rows.tolist()) if batch.logit_bias[r] is not None]
        allow_rows = [i for i, r in enumerate(rows.tolist()) if batch.allowed_token_ids[r] is not None]
        banned = LogitsEdits._bad_words(batch, rows)
        if not len(pen) and not bias_rows and not allow_rows and not banned:
            return None
        edits = LogitsEdits()
        if banned:
            r, t = zip(*banned)
            edits.banned = (torch.tensor(r, device=device), torch.tensor(t, device=device))
        if len(pen):
            r = rows[pen]
            n_tok, n_prompt = batch.num_tokens[r], batch.num_prompt_tokens[r]
            width = int(n_tok.max())
            cols = np.arange(width)[None, :]
            ids = np.where(cols < n_tok[:, None], batch.token_ids[r, :width], vocab)
            edits.penalty_rows = torch.from_numpy(pen).to(device)
            edits.token_ids = torch.from_numpy(ids).to(device)
            edits.output_mask = torch.from_numpy((cols >= n_prompt[:, None]) & (cols < n_tok[:, None])).to(device)
            edits.repetition = torch.from_numpy(rep[pen]).to(device)
            edits.frequency = torch.from_numpy(freq[pen]).to(device)
            edits.presence = torch.from_numpy(pres[pen]).to(device)
        if bias_rows:
            parts = [batch.logit_bias[rows[i]] for i in bias_rows]
            edits.bias = (torch.tensor(np.repeat(bias_rows, [len(p[0]) for p in parts]), device=device),
                          torch.from_numpy(np.concatenate([p[0] for p in parts])).to(device),
                          torch.from_numpy(np.concatenate([p[1] for p in parts])).to(device))
        if allow_rows:
            parts = [batch.allowed_token_ids[rows[i]] for i in allow_rows]
            edits.allowed = (torch.tensor(np.repeat(allow_rows, [len(p) for p in parts]), device=device),
                             torch.from_numpy(np.concatenate(parts)).to(device))
            edits.allowed_rows = torch.tensor(allow_rows, device=device)
        return edits

    @staticmethod
    def _bad_words(batch, rows: np.ndarray) -> list[tuple[int, int]]:
        """(row, token) pairs to ban this step: a loop over the rows that have bad words and
        their words (host-side, a handful), comparing each word's head with the output's tail."""
        pairs = []
        for i, r in enumerate(rows.tolist()):
            words = batch.bad_words[r]
            if not words:
                continue
            n, start = int(batch.num_tokens[r]), int(batch.num_prompt_tokens[r])
            for seq in words:
                head = len(seq) - 1
                if head == 0 or (n - start >= head and batch.token_ids[r, n - head:n].tolist() == seq[:-1]):
                    pairs.append((i, seq[-1]))
        return pairs

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A new [n, vocab] float tensor with the edits applied (`logits` is left intact)."""
        logits = logits.clone()
        vocab = logits.shape[-1]
        if self.allowed is not None:
            rows, ids = self.allowed
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[rows, ids] = True
            block = torch.zeros_like(keep)
            block[self.allowed_rows] = True
            logits.masked_fill_(block & ~keep, float("-inf"))
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
        if self.banned is not None:
            logits[self.banned] = float("-inf")
        if self.penalty_rows is not None:
            m = len(self.penalty_rows)
            sub = logits[self.penalty_rows]
            ones = torch.ones(self.token_ids.shape, dtype=logits.dtype, device=logits.device)
            counts = torch.zeros(m, vocab + 1, dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(1, self.token_ids, ones * self.output_mask)
            seen = torch.zeros(m, vocab + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, self.token_ids, True)
            counts, seen = counts[:, :vocab], seen[:, :vocab]
            rep = self.repetition[:, None].to(logits.dtype)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            sub = sub - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0)
            logits[self.penalty_rows] = sub
        return logits
