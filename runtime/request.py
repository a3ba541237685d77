"""Request: one prompt's token sequence from admission to finished output."""
from __future__ import annotations

import enum
import time

from runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6      # the request's own processing failed; the engine went on

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


class Request:
    """Scheduling state: the scheduler moves `num_computed_tokens` toward
    `num_tokens_with_spec` (prompt + output + draft tokens)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling_params", "output_token_ids",
                 "all_token_ids", "num_computed_tokens", "status", "stop_reason", "arrival_time",
                 "num_preemptions", "eos_token_ids", "max_tokens", "logprobs", "cumulative_logprob",
                 "cache_salt", "block_hashes", "external_tokens", "sample_index", "num_cached_tokens",
                 "priority", "prompt_logprobs", "spec_token_ids", "num_new_tokens", "scheduled_time")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int, prompt: str | None = None,
                 cache_salt: str | None = None, priority: int = 0):
        self.request_id = request_id
        self.priority = priority            # lower runs first under the priority policy
        self.prompt = prompt                # the text, when the user sent text
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None   # first scheduled (runtime/request_metrics.py)
        self.num_preemptions = 0
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens        # resolved: never past max_model_len
        # One {token_id: Logprob} per output token when logprobs were asked for.
        self.logprobs: list[dict] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # prompt_logprobs: entry j is prompt token j's {token_id: Logprob}; token 0 has none.
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None
        # Prefix caching: chained hashes of the full blocks of all_token_ids (extended as
        # tokens arrive); the salt keeps tenants' caches apart.
        self.cache_salt = (cache_salt or "").encode()
        self.block_hashes: list[bytes] = []
        # Set by a driver above the engine (beam search): each step's sample is reported
        # with its top logprobs and the driver feeds the next token (Scheduler.append_tokens).
        self.external_tokens = False
        self.sample_index = 0               # i of `<id>#i`, sample i of n (runtime/parallel_sampling.py)
        self.num_cached_tokens = 0          # prompt tokens served by the prefix cache at first admission
        # Speculative decoding (runtime/spec_decode): draft tokens proposed for the next step,
        # never part of all_token_ids until verified; and how many tokens the last step added.
        self.spec_token_ids: list[int] = []
        self.num_new_tokens = 0

    def clone(self, request_id: str, sampling_params: SamplingParams | None = None) -> Request:
        """A new request with this one's prompt, tokens so far and limits (a fork's child,
        a sample of n); it starts unscheduled, with no blocks of its own."""
        child = Request(request_id, self.prompt_token_ids, sampling_params or self.sampling_params,
                        self.eos_token_ids, self.max_tokens, prompt=self.prompt,
                        cache_salt=self.cache_salt.decode() or None, priority=self.priority)
        child.arrival_time = self.arrival_time
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.external_tokens = self.external_tokens
        return child

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Set a finished status if the last token ends the request."""
        params = self.sampling_params
        n = self.num_output_tokens
        last = self.output_token_ids[-1]
        if n >= params.min_tokens:
            if last in self.eos_token_ids and not params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if n >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
