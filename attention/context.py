"""The forward context: per-step attention plans, visible to the attention op.

Set by the runner around one model forward. Keeping plans out of the op's arguments keeps
the compiled graph's inputs to tensors, so new batch shapes do not trigger recompiles.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from attention.backend import AttentionBackend


@dataclass(slots=True)
class ForwardContext:
    backend: AttentionBackend
    layer_meta: list[Any]     # indexed by layer id: the plan of that layer's group
    # layer id -> the state mixer module whose state update runs inside `zooinfer::state_update`
    # (an op can take only tensors and scalars, so it finds its module here, as it finds its plan).
    state_layers: Mapping[int, Any] = field(default_factory=dict)


_current: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext):
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside set_forward_context(); the runner sets it per step")
    return _current
