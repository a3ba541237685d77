"""Structured outputs: JSON (a schema, or any JSON object), a regex, a choice of strings or an
EBNF grammar constrain what a request may sample, through xgrammar.

Why xgrammar: it compiles a grammar against the tokenizer's vocabulary once (an adaptive
token-mask cache), so the per-token cost is a bitmask fill of a few microseconds, it has a
CPU kernel to apply the mask, matchers can fork (n > 1, beams) and roll back (speculative
tokens), and vLLM and SGLang use it by default. llguidance is as fast but its Python API
is thinner around forking; outlines-core builds a full automaton per schema up front.

JSON is compact (no free whitespace between tokens: `any_whitespace=False`), so a model
cannot spend its token budget on blank space inside a structure.

Flow: the engine compiles (or finds in the cache) each request's grammar when it is made;
a server compiles it first on a worker thread (`GrammarCache.compile`), so a slow schema
never stalls the engine thread. Each sample gets a matcher. Before a step, the engine fills
one bitmask row per request that samples this step (`StructuredOutputs.bitmask`); the runner
applies the rows to those requests' logits before sampling (so they leave the fused greedy
head); after the step each matcher accepts its request's token, and a matcher that has
terminated finishes its request. A grammar error is a ParamError naming the field.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from runtime.limits import ParamError

CACHE_SIZE = 256          # compiled grammars kept (least recently used evicted)
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's `structured_outputs` fields)."""
    json: dict | str | None = None      # a JSON schema (a dict, or its JSON text)
    json_object: bool = False           # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None     # one of these strings, exactly
    grammar: str | None = None          # EBNF (xgrammar's / GBNF dialect)

    def validate(self, field: str = "structured_outputs") -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ParamError(f"{field}: give exactly one of json, json_object, regex, choice, grammar "
                             f"(got {', '.join(set_) or 'none'})", field)
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ParamError(f"{field}: choice must be a non-empty list of strings", field)
        for name in ("regex", "grammar"):       # e.g. {"regex": {1: "a"}} is a 400, not a crash
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ParamError(f"{field}: {name} must be a string", field)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParamError(f"{field}: json must be a JSON schema (an object or its text)", field)
        if len(self.key()[1]) > MAX_SPEC_CHARS:
            raise ParamError(f"{field}: longer than {MAX_SPEC_CHARS} characters", field)

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what the compiled-grammar cache is keyed by."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar or ""


def _choice_grammar(choices: list[str]) -> str:
    """EBNF for one of `choices` exactly (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCache:
    """Compiled grammars for one tokenizer, LRU-cached by (kind, text); thread-safe, so the
    server compiles on worker threads while the engine thread reads."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams, field: str = "structured_outputs"):
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind, text = key
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":     # OpenAI's json_object: an object, not any JSON value
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(_choice_grammar(params.choice))
            else:
                compiled = self.compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar says what is wrong with the user's grammar
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ParamError(f"{field}: {kind} is not supported or invalid: {first[:300]}", field) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, params: StructuredOutputsParams):
        return self._xgr.GrammarMatcher(self.compile(params), override_stop_tokens=self.stop_token_ids)


class StructuredOutputs:
    """The engine's matchers, one per constrained request (sample), by request id."""

    def __init__(self, grammars: GrammarCache):
        self.grammars = grammars
        self.matchers: dict[str, Any] = {}
        self._bitmask = None          # reused [rows, words] int32 buffer, grown on demand

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        self.matchers[request_id] = self.grammars.matcher(params)

    def fork(self, parent_id: str, child_id: str) -> None:
        if parent_id in self.matchers:
            self.matchers[child_id] = self.matchers[parent_id].fork()

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def bitmask(self, request_ids: list[str]) -> tuple[list[str], torch.Tensor] | None:
        """Rows of allowed tokens for those of `request_ids` that are constrained."""
        ids = [r for r in request_ids if r in self.matchers]
        if not ids:
            return None
        xgr = self.grammars._xgr
        if self._bitmask is None or self._bitmask.shape[0] < len(ids):
            self._bitmask = xgr.allocate_token_bitmask(max(len(ids), 8), self.grammars.vocab_size)
        mask = self._bitmask[: len(ids)]
        for i, rid in enumerate(ids):
            self.matchers[rid].fill_next_token_bitmask(mask, i)
        return ids, mask.clone()

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher by its sampled token; True when the grammar has
        terminated (the request is complete). A token the grammar refuses is an error."""
        m = self.matchers.get(request_id)
        if m is None:
            return False
        if not m.accept_token(token):
            raise RuntimeError(f"token {token} is outside the request's grammar")
        return m.is_terminated()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every token a row's bitmask excludes to -inf, in place (bit t of word t // 32 of
    a row is 1 when token t is allowed)."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~allowed.to(logits.device), float("-inf"))
