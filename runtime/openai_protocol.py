"""OpenAI API request schemas (pydantic) and their translation to SamplingParams.

The schemas check types only; every bound on a value lives in SamplingParams.validate and
Engine.make_request (runtime/limits.py), which `LLM` uses too. Nothing a client sends is
silently dropped: an unknown field is a 400 (as OpenAI answers), and a known parameter the
engine cannot honour yet is a 400 naming it unless it holds its no-op value (e.g.
`response_format: {"type": "text"}`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.limits import INT64_MAX, ParamError, check_text
from runtime.beam_search import BeamSearchParams
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import StructuredOutputsParams


def _unset(v) -> bool:
    return v is None or v is False or v == "" or v == {} or v == []


def _is(*values) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


def _text_format(v) -> bool:
    return v is None or v == {"type": "text"}


# Parameters of OpenAI's and vLLM's APIs that this engine does not honour yet, each with the
# test for its no-op value. Set to anything else they are refused, never ignored.
_NOT_YET_COMMON: dict[str, Callable[[Any], bool]] = {
    "guided_decoding_backend": _unset, "logits_processors": _unset,
    "spaces_between_special_tokens": _is(True),
}
_NOT_YET_COMPLETION = {**_NOT_YET_COMMON, "suffix": _unset}
_NOT_YET_CHAT = {
    **_NOT_YET_COMMON, "functions": _unset, "function_call": _is("none", "auto"), "audio": _unset, "modalities": lambda v: v is None or v == ["text"],
    "prediction": _unset, "web_search_options": _unset, "reasoning_effort": _unset, "verbosity": _unset,
    "store": _unset, "service_tier": _is("auto", "default"),
}


class _Strict(BaseModel):
    # Unknown fields are an error (see the RequestValidationError handler in serve.py);
    # the not-yet-supported ones arrive as extras and are checked against the tables above.
    model_config = ConfigDict(extra="allow")
    NOT_YET: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    def check_extras(self) -> None:
        for name, value in (self.model_extra or {}).items():
            noop = self.NOT_YET.get(name)
            if noop is None:
                raise ParamError(f"unrecognized request argument supplied: {name}", name)
            if not noop(value):
                raise ParamError(f"{name}: not supported by this server yet; leave it unset", name)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM: usage so far on every chunk


class _Common(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None            # extension (vLLM)
    min_p: float | None = None          # extension
    min_tokens: int = 0                 # extension
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)   # int64, as vLLM's (then >= 0: limits)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None   # extension
    ignore_eos: bool = False            # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None   # extension
    logit_bias: dict[str, float] | None = None   # token id (as a JSON key) -> bias
    allowed_token_ids: list[int] | None = None   # extension
    return_token_ids: bool = False      # extension (vLLM): prompt_token_ids and token_ids in the response
    bad_words: list[str] | None = None  # extension
    priority: int = 0                   # extension: lower first, with --scheduling-policy priority
    return_tokens_as_token_ids: bool = False   # extension: logprob tokens spelled "token_id:<id>"
    prompt_logprobs: int | None = None  # extension (vLLM): top-k logprobs of every prompt token
    logprob_token_ids: list[int] | None = None   # extension (vLLM): these ids' logprobs in place of the top-k
    use_beam_search: bool = False       # extension: n beams (runtime/beam_search.py), best first
    length_penalty: float = 1.0         # extension: beam score = cum logprob / len ** length_penalty
    # vLLM: keep only this many prompt tokens (-1: max_model_len), the last ones by default
    # ("left" truncation) or the first ones ("right"); OpenAIServer.truncate.
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* spellings; at most one of them (runtime/structured_outputs.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    include_stop_str_in_output: bool = False  # extension
    skip_special_tokens: bool = True    # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Metadata with no effect on the output by definition (OpenAI's abuse-monitoring ids).
    user: str | None = None
    safety_identifier: str | None = None

    def check(self) -> None:
        """The parameter checks that are not bounds on one value (those are SamplingParams')."""
        self.check_extras()
        if self.stream_options is not None:
            self.stream_options.check_extras()
            if not self.stream:
                raise ParamError("stream_options: only allowed when stream is true", "stream_options")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ParamError("truncate_prompt_tokens: must be -1 (max_model_len) or a count >= 0",
                             "truncate_prompt_tokens")
        if self.prompt_logprobs is not None and self.stream:   # vLLM refuses it too
            raise ParamError("prompt_logprobs: not available when stream is true", "prompt_logprobs")

    def beam_params(self, max_tokens: int | None) -> BeamSearchParams:
        """With use_beam_search: n beams; every sampling option must be left unset (a beam is
        ranked by log-probability, so sampling knobs have no meaning)."""
        for name in ("top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
                     "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "prompt_logprobs", "logprob_token_ids"):
            if getattr(self, name) not in (None, [], {}, {"type": "text"}):
                raise ParamError(f"{name}: not supported with use_beam_search", name)
        if self.temperature not in (None, 0):
            raise ParamError("temperature: beam search ranks by log-probability; leave it unset or 0", "temperature")
        if self.stream:
            raise ParamError("stream: not supported with use_beam_search", "stream")
        if max_tokens is None:
            raise ParamError("max_tokens: beam search needs a limit", "max_tokens")
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                    length_penalty=self.length_penalty)
        except ValueError as e:
            name = "n" if "beam_width" in str(e) else "max_tokens" if "max_tokens" in str(e) else "length_penalty"
            raise ParamError(f"{name}: {str(e).split(': ', 1)[-1]}", name) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's params (with its n), validated; sample i runs `sample_params(i)`."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, prompt_logprobs=self.prompt_logprobs_k,
            logprobs=self._explicit_k(logprobs), logprob_token_ids=self.logprob_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or [],
            structured_outputs=self._structured())

    def _explicit_k(self, logprobs: int | None) -> int | None:
        """With logprob_token_ids the returned logprobs are those ids' (and the sampled
        token's), whatever top-k was asked; logprobs must be on."""
        if self.logprob_token_ids is None:
            return logprobs
        if logprobs is None:
            raise ParamError("logprob_token_ids: needs logprobs", "logprob_token_ids")
        return len(self.logprob_token_ids) if isinstance(self.logprob_token_ids, list) else logprobs

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Top-k of the prompt logprobs to compute: `prompt_logprobs`, or for a completion's
        `echo` with `logprobs` its k (vLLM: the echoed prompt carries its logprobs)."""
        if self.prompt_logprobs is None and getattr(self, "echo", False) and isinstance(self.logprobs, int) \
                and not isinstance(self.logprobs, bool):
            return self.logprobs
        return self.prompt_logprobs

    @property
    def structured_field(self) -> str:
        """The field that carries the request's structured-output constraint (for errors)."""
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            if getattr(self, name) not in (None, {}, {"type": "text"}):
                return name
        return "structured_outputs"

    def _structured(self) -> StructuredOutputsParams | None:
        """The one constraint the request names, as StructuredOutputsParams (validated)."""
        given = {name: v for name, v in (("response_format", self._response_format()),
                                         ("structured_outputs", self._structured_dict()),
                                         ("guided_json", self.guided_json and StructuredOutputsParams(json=self.guided_json)),
                                         ("guided_regex", self.guided_regex and StructuredOutputsParams(regex=self.guided_regex)),
                                         ("guided_choice", self.guided_choice and StructuredOutputsParams(choice=self.guided_choice)),
                                         ("guided_grammar", self.guided_grammar and StructuredOutputsParams(grammar=self.guided_grammar)))
                 if v}
        if len(given) > 1:
            raise ParamError(f"{', '.join(given)}: give at most one structured-output constraint", next(iter(given)))
        for name, params in given.items():
            params.validate(name)
            return params
        return None

    def _response_format(self) -> StructuredOutputsParams | None:
        rf = self.response_format
        if rf is None or rf == {"type": "text"}:
            return None
        kind = rf.get("type")
        if kind == "json_object" and set(rf) == {"type"}:
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema" and set(rf) == {"type", "json_schema"} and isinstance(rf["json_schema"], dict):
            js = rf["json_schema"]
            extra = set(js) - {"name", "schema", "strict", "description"}
            if extra or not isinstance(js.get("schema", {}), dict):
                raise ParamError(f"response_format.json_schema: unknown or bad fields {sorted(extra) or ['schema']}",
                                 "response_format")
            return StructuredOutputsParams(json=js.get("schema", {}))
        raise ParamError("response_format: must be {type: text}, {type: json_object} or "
                         "{type: json_schema, json_schema: {name, schema, strict}}", "response_format")

    def _structured_dict(self) -> StructuredOutputsParams | None:
        so = self.structured_outputs
        if not so:
            return None
        known = {"json", "json_object", "regex", "choice", "grammar"}
        if set(so) - known:
            raise ParamError(f"structured_outputs: unknown fields {sorted(set(so) - known)} (known: "
                             f"{', '.join(sorted(known))})", "structured_outputs")
        return StructuredOutputsParams(**so)

    def _logit_bias(self) -> dict[int, float] | None:
        """JSON object keys are strings: they must spell token ids."""
        if not self.logit_bias:
            return None
        bad = [key for key in self.logit_bias if not key.isascii() or not key.isdigit() or len(key) > 19]
        if bad:     # every bad key named (vLLM's), at most a few
            names = ", ".join(repr(k[:32]) for k in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            raise ParamError(f"logit_bias: {'keys' if len(bad) > 1 else 'key'} {names} "
                             f"{'are not token ids' if len(bad) > 1 else 'is not a token id'}", "logit_bias")
        return {int(key): bias for key, bias in self.logit_bias.items()}


class CompletionRequest(_Common):
    NOT_YET: ClassVar = _NOT_YET_COMPLETION
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    best_of: int | None = None
    add_special_tokens: bool = True     # extension
    echo: bool = False                  # the prompt's text before each choice's text

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of: only best_of == n is supported", "best_of")

    def prompts(self) -> list:
        """The prompts of this call: one string or token list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            p = [p]
        elif p and all(isinstance(t, int) for t in p):
            p = [p]
        if not p:
            raise ParamError("prompt must not be empty", "prompt")
        return [{"prompt": x, "add_special_tokens": self.add_special_tokens} if isinstance(x, str)
                else {"prompt_token_ids": x} for x in p]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str | None = None
    text: Any = None


class ChatMessage(BaseModel):
    # OpenAI's roles, or any other the chat template renders (vLLM passes custom roles on).
    # Keys beyond these reach the template as sent (vLLM's rule: `reasoning_content`, custom
    # keys a template reads); an unknown top-level request field is still a 400 (_Strict).
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def for_template(self, where: str) -> dict:
        """The message as the chat template takes it; text parts joined. Any other part is a
        400 (a text-only model would answer as if the image or audio were not there)."""
        if isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                at = f"{where}.content[{j}]"
                if part.type != "text":
                    what = "has no type" if part.type is None else f"type {part.type!r} is not supported (text only)"
                    raise ParamError(f"{at}: content part {what}", f"{at}.type")
                if not isinstance(part.text, str):
                    raise ParamError(f"{at}.text: a text part needs a string 'text'", f"{at}.text")
                unknown = sorted(part.model_extra or {})
                if unknown:
                    raise ParamError(f"{at}: unrecognized field in a text part: {unknown[0]}", f"{at}.{unknown[0]}")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = self.content or ""
        check_text(content, f"{where}.content")
        if not self.role.strip():
            raise ParamError(f"{where}.role: must not be empty", f"{where}.role")
        check_text(self.role, f"{where}.role")
        # OpenAI's `developer` role is the system prompt of newer models.
        msg: dict = {"role": "system" if self.role == "developer" else self.role, "content": content}
        extras = {k: v for k, v in (self.model_extra or {}).items() if k not in msg}
        for key, value in {"name": self.name, "tool_calls": self.tool_calls, "tool_call_id": self.tool_call_id,
                           **extras}.items():
            if value is not None:
                if isinstance(value, str):
                    check_text(value, f"{where}.{key}")
                msg[key] = value
        return msg


class ChatCompletionRequest(_Common):
    NOT_YET: ClassVar = _NOT_YET_CHAT
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False    # extension: the chat template holds the special tokens
    tools: list[dict[str, Any]] | None = None       # runtime/tool_calls.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None         # `required` may return several calls either way
    metadata: dict[str, str] | None = None     # only stored with `store`, which is refused
    prompt_cache_key: str | None = None        # prefix caching is automatic here
    # Chat-template controls (vLLM's): end on an open assistant turn (add_generation_prompt),
    # or continue the last message as written (continue_final_message, e.g. a prefilled
    # answer); chat_template replaces the model's, chat_template_kwargs reach the template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: with continue_final_message, the reply starts with the last (assistant) message's
    # content, so the client gets the whole message (OpenAIServer.chat_echo).
    echo: bool = False

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise ParamError("messages: at least one message is required", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs: requires logprobs to be true", "top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("continue_final_message: cannot be combined with add_generation_prompt "
                             "(set add_generation_prompt to false)", "continue_final_message")
        reserved = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template",
                    "tools", "documents", "return_dict", "messages"}
        for key in self.chat_template_kwargs or {}:
            if key in reserved:
                raise ParamError(f"chat_template_kwargs: {key!r} is set by its own field", "chat_template_kwargs")

    def template_messages(self) -> list[dict]:
        return [m.for_template(f"messages[{i}]") for i, m in enumerate(self.messages)]

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


class APIError(Exception):
    """An HTTP error answered in the OpenAI error shape (`error_body`); `param` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.err_type = status, message, param, code, err_type


def bad_param(e: ValueError) -> APIError:
    """A 400 for a refused value; SamplingParams' messages lose their class prefix here."""
    message = str(e).removeprefix("SamplingParams.")
    return APIError(400, message, getattr(e, "param", None), "invalid_request")
