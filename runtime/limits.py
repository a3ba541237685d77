"""Bounds on everything a client can send, in one place for `LLM` and the server alike.

Whatever reaches the engine thread ends up in numpy int64 buffers, torch generators, the
tokenizer (Rust, UTF-8 only) and per-token loops. A value one of those cannot hold must
be refused while the request is still only the caller's problem: here, as a `ParamError`
naming the field, never later as an exception inside `Engine.step()`.
"""
from __future__ import annotations

INT64_MAX = (1 << 63) - 1
MAX_N = 64                  # samples per prompt
MAX_LOGPROBS = 20           # top logprobs per token (OpenAI's cap)
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 64       # each is searched for after every token of the request
MAX_STOP_TOKEN_IDS = 1024   # banned as a whole row's list until min_tokens
MAX_LOGIT_BIAS = 300        # entries of logit_bias (OpenAI's cap)
MAX_ALLOWED_TOKENS = 1 << 20  # allowed_token_ids entries (a whole vocabulary fits)
MAX_REPETITION_PENALTY = 100.0


class ParamError(ValueError):
    """A bad request field: `param` names it (an OpenAI error's `param`), `reason` says
    what is wrong with it; str() is the full one-line message."""

    def __init__(self, message: str, param: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.param = param
        self.reason = reason or message


def short_repr(value, limit: int = 60) -> str:
    """repr() cut to `limit` characters, so a hostile megabyte value is not echoed back."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_text(text: str, where: str) -> None:
    """Text for the tokenizer must be valid Unicode: JSON's `\\ud800` escapes decode to lone
    surrogates, which no UTF-8 encoder (the tokenizer's included) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(f"{where}: contains a lone UTF-16 surrogate ({short_repr(text[e.start])}) at "
                         f"character {e.start}; text must be valid Unicode", where,
                         f"contains a lone UTF-16 surrogate at character {e.start}") from None


def sample_seed(seed: int | None, i: int) -> int | None:
    """The seed of sample i of a request seeded with `seed` (sample 0 keeps it). Wraps within
    [0, 2^63) so that any valid seed gives valid sample seeds, however large n is."""
    return None if seed is None else (seed + i) % (INT64_MAX + 1)
