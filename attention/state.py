"""Per-step metadata for state layers (Mamba2, Gated DeltaNet).

A state layer keeps a fixed-size state per request (a causal-conv tail and a recurrent
state) in slots of per-layer tensors, `[num_slots, ...]`, updated in place each step. The
runner plans this once per step per state group, like attention metadata, and every state
layer of the group reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    @staticmethod
    def build(query_lens: list[int], has_initial_state: list[bool], pages: torch.Tensor,
              device: torch.device | str = "cpu") -> "StatePlan":
        meta = StateMetadata.build(query_lens, list(range(len(query_lens))), has_initial_state, device)
        return StatePlan(meta, pages.reshape(-1).to(device=device, dtype=torch.long))
