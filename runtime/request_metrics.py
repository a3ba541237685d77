"""vLLM's per-request timing metrics (`--enable-per-request-metrics`): a `metrics` object on a
non-streaming response and on a stream's final usage chunk.

Fields, as vLLM defines them (vllm/entrypoints/generate/base/serving.py), in milliseconds:
queue_time_ms (arrival to first scheduled), time_to_first_token_ms (first scheduled to first
output token), generation_time_ms (first to last output token), mean_itl_ms (that over the
tokens after the first; absent for one token) and tokens_per_second (all output tokens over
first scheduled to last token). Arrival and first scheduling are the engine's timestamps
(`Request.arrival_time`, `Request.scheduled_time`); token times are taken where the server
receives each output, so they include the hop from the engine thread (well under a
millisecond). A field whose timestamps are missing is left out, as vLLM's None fields are.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenTimes:
    """When each choice's first and latest outputs with tokens reached the server."""
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)

    def saw(self, index: int, num_tokens: int) -> None:
        if num_tokens:
            now = time.monotonic()
            self.first.setdefault(index, now)
            self.last[index] = now


def timing_metrics(req, times: TokenTimes, index: int, num_tokens: int) -> dict:
    """The metrics object of choice `index`, whose request is `req` (its first sample's for
    n > 1: they are admitted and scheduled together)."""
    queued, scheduled = req.arrival_time, getattr(req, "scheduled_time", None)
    first, last = times.first.get(index), times.last.get(index)
    out = {}
    if scheduled is not None:
        out["queue_time_ms"] = max(scheduled - queued, 0.0) * 1000
    if scheduled is not None and first is not None:
        out["time_to_first_token_ms"] = max(first - scheduled, 0.0) * 1000
    if first is not None and last is not None:
        out["generation_time_ms"] = (last - first) * 1000
        if num_tokens > 1:
            out["mean_itl_ms"] = (last - first) / (num_tokens - 1) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        out["tokens_per_second"] = num_tokens / (last - scheduled)
    return out
