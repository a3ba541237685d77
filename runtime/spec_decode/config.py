"""SpeculativeConfig: what `LLM(..., speculative={...})`, the zoo YAML's `speculative:` section
and the server's `--speculative-config '<json>'` describe (vLLM's field names).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

Parsing is strict: an unknown field, a wrong type or a bad value is one ValueError naming the
field, raised before any model is built.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft", "mtp")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4       # k: drafts proposed per request per step (at most)
    prompt_lookup_min: int = 2            # ngram: shortest suffix matched
    prompt_lookup_max: int = 4            # ngram: longest suffix matched (tried first)
    model: str | None = None              # draft: the draft model's zoo spec / checkpoint
    adaptive: bool = True                 # per-request k follows its measured acceptance
    # No drafts while this many requests or more run (vLLM's name): a large batch's forward is
    # compute-bound, and verifying k+1 positions per request then costs about k+1 steps.
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value, where: str = "speculative") -> SpeculativeConfig | None:
        """A config from a dict, a JSON string, a SpeculativeConfig or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(f"{where}.{key}: unknown field; known: {', '.join(sorted(known))}")
        cfg = cls(**value)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "speculative") -> None:
        if self.method not in METHODS:
            raise ValueError(f"{where}.method: must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}.{name}: must be a positive integer, got {v!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"{where}.num_speculative_tokens: at most 16, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{where}.prompt_lookup_min: {self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or isinstance(self.disable_by_batch_size, bool)
                or self.disable_by_batch_size < 1):
            raise ValueError(f"{where}.disable_by_batch_size: must be a positive integer or null, "
                             f"got {self.disable_by_batch_size!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"{where}.adaptive: must be true or false, got {self.adaptive!r}")
        if self.method == "draft" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"{where}.model: the 'draft' method needs the draft model's zoo spec or "
                             f"checkpoint path, got {self.model!r}")
        if self.model is not None and self.method != "draft":
            raise ValueError(f"{where}.model: only the 'draft' method takes a model")
