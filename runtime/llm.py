"""`LLM`: offline batch generation in vLLM's shape."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from runtime.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.outputs import RequestOutput
from runtime.parallel_sampling import ParentRequest
from runtime.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`LLM("zoo/smollm2-135m.yaml")` or `LLM("/path/to/hf_checkpoint_dir")`."""

    def __init__(self, model: str | Path, **kwargs: Any):
        fields = set(EngineConfig.__dataclass_fields__)
        unknown = set(kwargs) - fields
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(sorted(fields))}")
        self.engine = Engine(model, EngineConfig(**kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def kv_cache_stats(self) -> dict:
        """Pool blocks (total, free), usage, preemptions and blocks in use per KV cache group."""
        return self.engine.kv_cache_stats()

    def kv_cache_capacity(self, num_tokens: int) -> int:
        """How many requests of `num_tokens` tokens the KV pool serves at once."""
        return self.engine.kv_cache_capacity(num_tokens)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order. `priority`
        (one per prompt, lower first) needs scheduling_policy='priority'."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Only finished outputs are read here: ask the engine for nothing else (the caller's
        # objects stay untouched; shared params are replaced once).
        final: dict[int, SamplingParams] = {}
        params = [final.setdefault(id(sp), dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY))
                  if isinstance(sp, SamplingParams) else sp for sp in params]
        engine = self.engine
        # Validate everything before scheduling anything: one bad prompt leaves no work behind.
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        requests = [engine.make_request(p, sp, priority=0 if priority is None else priority[i])
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        parents: dict[str, tuple[int, ParentRequest]] = {}     # sample id -> (prompt index, its parent)
        for i, req in enumerate(requests):
            parent = ParentRequest(req.request_id, req.sampling_params.n, final_only=True)
            for sid in engine.add_request(req):
                parents[sid] = (i, parent)
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    i, parent = parents[out.request_id]
                    merged = parent.add(out)
                    if merged is not None:
                        results[i] = merged
                        bar.update(1)
        except BaseException:
            engine.abort(list(parents))
            raise
        finally:
            bar.close()
        return results

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (all searches batched together); each output holds
        the best `beam_width` sequences, best first. Beams are forked requests that share
        their common prefix's KV blocks (see runtime/beam_search.py)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        search = BeamSearch(self.engine)
        prepared = [search.prepare(p, params) for p in prompts]   # validate all first
        for req, group in prepared:
            search.add(req, group)
        bar = tqdm(total=len(prepared), desc="beam search", unit="req", disable=not use_tqdm)
        try:
            while not search.done:
                search.step()
                bar.n = sum(group.done for _, group in prepared)
                bar.refresh()
        except BaseException:
            search.cancel()
            raise
        finally:
            bar.close()
        return [search.output(req, group) for req, group in prepared]
