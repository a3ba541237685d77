"""Result types in vLLM's shape: RequestOutput with one CompletionOutput per sample."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None      # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None   # set when the request failed on its own (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (usage.prompt_tokens_details)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # [None, {id: Logprob}, ...] (vLLM's)
