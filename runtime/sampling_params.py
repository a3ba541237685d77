"""SamplingParams: how one request samples and when it stops (vLLM's field names)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.IntEnum):
    """Which outputs `Engine.step` returns for a request (vLLM's names and values).

    CUMULATIVE: one after every step that gave the request a token, holding everything so far
    (streaming). FINAL_ONLY: one when the request finishes; offline `LLM.generate` uses it,
    because building a cumulative output for every running request every step copies each
    request's tokens once per step (quadratic in the output length) for nobody to read."""
    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                      # samples per prompt; sample i uses seed + i (when seeded)
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None         # per-request generator: same seed, same sample
    max_tokens: int | None = 16     # None: up to max_model_len
    min_tokens: int = 0             # stop tokens are masked until this many are generated
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None     # return this many top logprobs per token (+ the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or not 1 <= self.n <= 64:
            bad("n", "must be an integer in [1, 64]")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", "must be in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be 0 (disabled), -1 (disabled) or a positive integer")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", "must be a non-negative integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be a RequestOutputKind")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
