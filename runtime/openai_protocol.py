"""OpenAI API request schemas (pydantic) and their translation to SamplingParams.

Only what the engine supports is accepted; a parameter it cannot honour (penalties,
`echo`, `best_of`, tools) is a 400 naming the parameter, not a silent ignore.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None            # extension (vLLM)
    min_p: float | None = None          # extension
    min_tokens: int = 0                 # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None   # extension
    ignore_eos: bool = False            # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    def unsupported(self) -> str | None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=None if self.seed is None else self.seed + seed_offset,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):   # [{"type": "text", "text": ...}, ...]
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return super().unsupported()

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error JSON shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
