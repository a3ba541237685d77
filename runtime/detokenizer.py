"""Incremental detokenization and stop strings.

Decoding the whole output every step is quadratic; decoding token by token breaks
multi-byte characters and word-initial spaces. The usual window trick decodes only the
tokens since a recent anchor (starting a few tokens into the prompt for context) and emits
the text beyond what the anchor window already produced, holding back while the tail is an
incomplete UTF-8 sequence (U+FFFD).
"""
from __future__ import annotations

_CONTEXT = 5   # prompt tokens decoded ahead of the output, so the first word's space survives


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "prefix", "read", "text", "stop", "include_stop",
                 "skip_special", "max_stop_len")

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special: bool):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def update(self, token_id: int) -> str | None:
        """Add one token; returns the stop string if the text now contains one (the text is
        then cut at it), else None."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix: self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx >= 0:
                self.text = self.text[: idx + len(s) if self.include_stop else idx]
                return s
        return None
