"""Logprobs above the default 20 per token, up to the whole vocabulary (vLLM's -1).

vLLM's `logprobs` / `top_logprobs` / `prompt_logprobs` = -1 asks for every token's logprob at
each position, and vLLM checks any count against the server's `--max-logprobs` (default 20,
so -1 is a 400 unless the server raised it). Here the same: `resolve` turns -1 into the
vocabulary size and refuses a count above `EngineConfig.max_logprobs` with a 400 naming the
field. The rows come from the sampler's and the prompt pass's one `topk` over the logits (k =
the vocabulary is a sort of each row, on the device, no loop), so nothing new runs there.

What costs is the answer: each entry becomes a Python Logprob and a JSON member (about 0.2 KB
of memory and 60 bytes of JSON each), so a request may ask for at most MAX_LOGPROB_ENTRIES
entries (2^21: 42 positions of a 49k vocabulary, 13 of a 152k one) once its count is above
the default 20; beyond that it is a 400 naming the field and the limit. Counts up to 20 are
not capped (21 entries per position are at most a few MB even at a long context).

`VocabWords` spells every token once per engine, so a whole-vocabulary row is not 49k
tokenizer calls per position, and `gc_paused` keeps CPython's cyclic collector from running
over and over while a row's entries are built (measured: 29 positions x 49k entries took
16.6 s with it on, 6.3 s paused; the entries hold no cycles).
"""
from __future__ import annotations

import dataclasses
import gc
from contextlib import contextmanager

from runtime.limits import MAX_LOGPROBS, ParamError

WHOLE_VOCAB = -1                # the count that means "every token"
MAX_LOGPROB_ENTRIES = 1 << 21   # entries per request once a count is above MAX_LOGPROBS


def resolve(params, vocab_size: int, max_logprobs: int, num_prompt_tokens: int, max_tokens: int):
    """`params` with -1 counts replaced by the vocabulary size (and counts above it cut to it),
    checked against the server's max_logprobs and the entry cap. Raises ParamError naming
    `logprobs` or `prompt_logprobs`."""
    counts = {}
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is None:
            continue
        asked = k
        k = vocab_size if k == WHOLE_VOCAB else min(k, vocab_size)
        if k > max_logprobs:
            what = f"-1 (the whole vocabulary, {vocab_size} tokens)" if asked == WHOLE_VOCAB else str(asked)
            raise ParamError(f"{name}: {what} requested, more than this server's max_logprobs {max_logprobs} "
                             f"(--max-logprobs)", name)
        counts[name] = k
    if not counts:
        return params
    if max(counts.values()) > MAX_LOGPROBS:
        # The prompt's first token has no entry; each sample has its own output entries.
        entries = {"prompt_logprobs": (num_prompt_tokens - 1) * (counts.get("prompt_logprobs", -1) + 1),
                   "logprobs": max(params.n, 1) * max_tokens * (counts.get("logprobs", -1) + 1)}
        if sum(entries.values()) > MAX_LOGPROB_ENTRIES:
            name = max(entries, key=entries.get)
            raise ParamError(f"{name}: {counts[name]} logprobs per token over "
                             f"{num_prompt_tokens - 1 if name == 'prompt_logprobs' else max_tokens} tokens is "
                             f"{sum(entries.values())} entries, above the limit of {MAX_LOGPROB_ENTRIES} per request "
                             f"(ask for fewer tokens or a smaller count)", name)
    return dataclasses.replace(params, **counts)


def is_wide(*counts) -> bool:
    """Whether any logprob count asks for more than the default 20 (or -1, the vocabulary)."""
    return any(isinstance(k, int) and not isinstance(k, bool) and (k < 0 or k > MAX_LOGPROBS) for k in counts)


@contextmanager
def gc_paused(wide: bool):
    """Pause the cyclic GC while a wide row's millions of small acyclic objects are made
    (each allocation burst otherwise triggers a pass over every live object)."""
    if not wide or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class VocabWords:
    """Every token id's text, decoded once on first use (the engine thread's tokenizer)."""

    # Below this many ids a row is spelled token by token (the common top-k case).
    TABLE_FROM = 1024

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size, self._words = tokenizer, vocab_size, None

    def spell(self, ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(ids)
        if len(ids) < self.TABLE_FROM:
            return [self.tokenizer.decode([t]) for t in ids]
        if self._words is None:
            self._words = [self.tokenizer.decode([t]) for t in range(self.vocab_size)]
        words = self._words
        return [words[t] for t in ids]
