"""Per-step metadata for state layers (Mamba2, Gated DeltaNet).

A state layer keeps a fixed-size state per request (a causal-conv tail and a recurrent
state) in slots of per-layer tensors, `[num_slots, ...]`, updated in place each step. The
runner plans this once per step per state group, like attention metadata, and every state
layer of the group reads it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


@dataclass(slots=True)
class StateMetadata:
    """Requests in batch order; request i owns tokens query_start_loc[i]:query_start_loc[i+1]."""
    query_start_loc: list[int]          # host-side, len num_reqs + 1
    slots: torch.Tensor                 # [num_reqs] int64: each request's state slot
    has_initial_state: torch.Tensor     # [num_reqs] bool: False on a request's first chunk
    all_decode: bool                    # every request has exactly one token this step

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc) - 1

    @staticmethod
    def build(query_lens: list[int], slots: list[int], has_initial_state: list[bool],
              device: torch.device | str = "cpu") -> "StateMetadata":
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        return StateMetadata(qsl, torch.tensor(slots, dtype=torch.long, device=device),
                             torch.tensor(has_initial_state, dtype=torch.bool, device=device),
                             all(n == 1 for n in query_lens))


@dataclass(slots=True)
class StatePlan:
    """A state group's step: the metadata its layers run with (request i in slot i of a
    gathered, contiguous state batch) and the pool pages those states live in."""
    meta: StateMetadata
    pages: torch.Tensor         # [num_reqs * pages_per_state] int64, request-major
    dtype: torch.dtype = torch.float32   # the states' dtype (the pages may be viewed in another)
    # Kernel-specific index plans derived from `meta` (e.g. Mamba2's chunk layout), built by
    # the first layer that needs one and reused by every other layer of the group this step.
    derived: dict = field(default_factory=dict)

    @staticmethod
    def build(query_lens: list[int], has_initial_state: list[bool], pages: torch.Tensor,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> "StatePlan":
        meta = StateMetadata.build(query_lens, list(range(len(query_lens))), has_initial_state, device)
        return StatePlan(meta, pages.reshape(-1).to(device=device, dtype=torch.long), dtype)

    def derive(self, key: Any, build: Callable[[StateMetadata], Any]) -> Any:
        """`build(meta)` once per step and key; later layers with the same key share it."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = build(self.meta)
        return value

    def gather(self, pages: torch.Tensor, shapes: Iterable[tuple[int, ...]]
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copy the step's requests' states out of their pool pages (a layer's view of the
        pool, `[num_blocks, page elements]`) into one contiguous batch, request i in slot i.
        Returns that buffer and one view into it per state shape; the mixer updates the
        views in place and `scatter` writes the buffer back. The pages may be typed as the KV
        cache that shares their buffer (bf16 KV, fp32 states): the states are reinterpreted."""
        n = self.meta.num_reqs
        rows = pages.index_select(0, self.pages).view(n, -1)
        typed = rows if rows.dtype == self.dtype else rows.view(self.dtype)
        states, offset = [], 0
        for shape in shapes:
            size = math.prod(shape)
            states.append(typed[:, offset: offset + size].view(n, *shape))
            offset += size
        return rows, states

    def scatter(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """Write a buffer from `gather` back to the same pool pages."""
        pages.index_copy_(0, self.pages, rows.view(-1, pages.shape[1]))


def run_by_request(meta: StateMetadata, make_out: Callable[[], torch.Tensor],
                   decode: Callable[[Any, Any], torch.Tensor],
                   prefill: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    """A state layer's step split the way its kernels want it:

    - an all-decode step is one vectorised `decode(tokens, requests)` with both slices whole;
    - otherwise, written into `make_out()` ([num_tokens, ...] zeros: padding tokens stay 0),
      the step's single-token requests still go in one `decode(token index, request index)`
      call (int64 tensors), and each multi-token request (a prefill chunk) in
      `prefill(start, end, request)` over its tokens start:end.

    Gated DeltaNet and lightning attention share this so only their math differs."""
    if meta.all_decode:
        return decode(slice(None), slice(None))
    out = make_out()
    qsl, device = meta.query_start_loc, out.device
    singles = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
    if singles:
        req = torch.tensor(singles, dtype=torch.long).to(device, non_blocking=True)
        tok = torch.tensor([qsl[i] for i in singles], dtype=torch.long).to(device, non_blocking=True)
        out[tok] = decode(tok, req)
    for i in range(meta.num_reqs):
        if qsl[i + 1] - qsl[i] > 1:
            out[qsl[i]:qsl[i + 1]] = prefill(qsl[i], qsl[i + 1], i)
    return out
