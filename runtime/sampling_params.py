"""SamplingParams: how one request samples and when it stops (vLLM's field names)."""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

from runtime.limits import (INT64_MAX, MAX_ALLOWED_TOKENS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N,
                            MAX_REPETITION_PENALTY, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                            ParamError, is_int, sample_seed, short_repr)
from runtime.structured_outputs import StructuredOutputsParams


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
    n: int = 1                      # samples per prompt; sample i uses seed + i (mod 2^63)
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
    # Return this many top logprobs per token (+ the sampled one), and per prompt token
    # (runtime/worker/prompt_logprobs.py); -1: every token's. At most the engine's max_logprobs.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # vLLM's logprob_token_ids: these ids' logprobs (with the sampled token's) replace the top
    # `logprobs`, which must be len(logprob_token_ids) (the sampler's Sampler._gather_logprobs).
    logprob_token_ids: list[int] | None = None
    # Logit edits before sampling (runtime/worker/logits_processors.py has the exact rules).
    presence_penalty: float = 0.0   # OpenAI: minus this once for each token already output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF: tokens seen in prompt or output, logit / p (or * p if < 0)
    logit_bias: dict[int, float] | None = None    # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None    # sample only among these
    bad_words: list[str] = field(default_factory=list)   # never completed: each word's last token is
                                                         # banned once the output ends with the rest
    bad_words_token_ids: list[list[int]] | None = None   # their tokenizations (the engine fills this)
    structured_outputs: StructuredOutputsParams | None = None   # JSON / regex / choice / grammar
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Every bound a value must meet before it goes near the engine (see runtime/limits.py).
        Raises ParamError naming the field."""
        def bad(name: str, why: str):
            raise ParamError(f"SamplingParams.{name}: {why}, got {short_repr(getattr(self, name))}", name, why)

        def number(v) -> bool:   # a real, finite number (NaN fails every range check anyway)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        if not number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}]")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            bad("top_k", "must be 0 (disabled), -1 (disabled) or a positive integer below 2^63")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= INT64_MAX):
            bad("seed", "must be an integer in [0, 2^63)")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX):
            bad("max_tokens", "must be an integer in [1, 2^63)")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            bad("min_tokens", "must be an integer in [0, 2^63)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings")
        if (len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or not all(is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids)):
            bad("stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} non-negative token ids")
        # A count's upper bound is the engine's max_logprobs (runtime/vocab_logprobs.py); -1: every token.
        if self.logprobs is not None and (not is_int(self.logprobs) or not -1 <= self.logprobs <= INT64_MAX):
            bad("logprobs", "must be -1 (the whole vocabulary) or an integer >= 0")
        if self.logprob_token_ids is not None and (
                not isinstance(self.logprob_token_ids, list) or not 0 < len(self.logprob_token_ids) <= MAX_LOGPROBS
                or not all(is_int(t) and 0 <= t <= INT64_MAX for t in self.logprob_token_ids)):
            bad("logprob_token_ids", f"must be 1 to {MAX_LOGPROBS} non-negative token ids")
        if self.logprob_token_ids is not None and self.logprobs != len(self.logprob_token_ids):
            bad("logprob_token_ids", "needs logprobs equal to its length")
        if self.prompt_logprobs is not None and (
                not is_int(self.prompt_logprobs) or not -1 <= self.prompt_logprobs <= INT64_MAX):
            bad("prompt_logprobs", "must be -1 (the whole vocabulary) or an integer >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if not number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for t, b in self.logit_bias.items():
                if not (is_int(t) and 0 <= t <= INT64_MAX) or not number(b) or not -100 <= b <= 100:
                    bad("logit_bias", "keys must be token ids and values numbers in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKENS
                or not all(is_int(t) and 0 <= t <= INT64_MAX for t in self.allowed_token_ids)):
            bad("allowed_token_ids", f"must be 1 to {MAX_ALLOWED_TOKENS} non-negative token ids")
        if len(self.bad_words) > MAX_STOP_STRINGS or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", f"must be at most {MAX_STOP_STRINGS} non-blank strings")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate("SamplingParams.structured_outputs")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be a RequestOutputKind")

    def validate_for_model(self, vocab_size: int) -> None:
        """The bounds that depend on the model: token ids must be in its vocabulary."""
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "logprob_token_ids"):
            for t in getattr(self, name) or ():
                if t >= vocab_size:
                    why = f"token id {t} is not in the vocabulary (size {vocab_size})"
                    raise ParamError(f"SamplingParams.{name}: {why}", name, why)

    def sample_params(self, i: int) -> SamplingParams:
        """The params of sample i of n: one sample, seeded with sample_seed(seed, i)."""
        return dataclasses.replace(self, n=1, seed=sample_seed(self.seed, i))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
