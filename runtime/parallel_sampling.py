"""n > 1: one request's samples, fanned out as forked requests and merged back.

Sample 0 keeps the request's id; sample i is `<id>#i`, seeded with `sample_seed(seed, i)`.
The samples share the prompt's KV blocks through the scheduler's fork (see
`Scheduler.add_fork`): each computes only the last prompt token itself, so each draws its
first token from its own generator. `LLM.generate` and the server both go through here
(vLLM's ParentRequest plays this part there), so a sample's id, seed and index mean the
same thing offline and over HTTP.
"""
from __future__ import annotations

import dataclasses

from runtime.outputs import RequestOutput
from runtime.request import Request


def sample_id(request_id: str, i: int) -> str:
    return request_id if i == 0 else f"{request_id}#{i}"


def parent_id(sample: str) -> str:
    """The request id a sample id belongs to (request ids never contain '#')."""
    return sample.partition("#")[0]


def fan_out(request: Request) -> list[Request]:
    """The request's n samples (the request itself first, now with n = 1)."""
    p = request.sampling_params
    if p.n == 1:
        return [request]
    samples = [request]
    for i in range(1, p.n):
        # Prompt logprobs belong to the prompt: sample 0 computes them (the others fork from its
        # prefill) and every sample reports the same list, complete before any sample's first token.
        s = request.clone(sample_id(request.request_id, i), dataclasses.replace(p.sample_params(i), prompt_logprobs=None))
        s.prompt_logprobs = request.prompt_logprobs
        s.sample_index = i
        samples.append(s)
    request.sampling_params = p.sample_params(0)
    return samples


class ParentRequest:
    """Collects the outputs of one request's n samples; `add` returns the merged output
    (outputs[i] is sample i) once it has news for the caller: with `final_only`, when every
    sample has finished, otherwise whenever any sample has a new token."""

    __slots__ = ("request_id", "n", "latest", "num_finished", "final_only")

    def __init__(self, request_id: str, n: int, final_only: bool):
        self.request_id, self.n, self.final_only = request_id, n, final_only
        self.latest: dict[int, RequestOutput] = {}
        self.num_finished = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n

    def add(self, out: RequestOutput) -> RequestOutput | None:
        i = out.outputs[0].index
        if out.finished and not (i in self.latest and self.latest[i].finished):
            self.num_finished += 1
        self.latest[i] = out
        if self.final_only and not self.finished:
            return None
        first = self.latest[min(self.latest)]
        errors = [o.error for o in self.latest.values() if o.error is not None]
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids,
                             [self.latest[j].outputs[0] for j in sorted(self.latest)], self.finished,
                             error=errors[0] if errors else None, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=first.prompt_logprobs)
