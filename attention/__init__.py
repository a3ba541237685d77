"""Attention backends behind one interface, called from models through a custom op.

`plan()` runs once per step per KV cache group on host-side batch facts; `forward()` runs
per layer with that plan. Models never see the plan: the runner installs it in the forward
context and the `zooinfer::paged_attention` op looks it up by layer index, so the compiled
graph only carries tensors (q, k, v, cache) and two constants.
"""
from attention.backend import AttentionBackend, BatchLayout, get_backend
from attention.context import ForwardContext, get_forward_context, set_forward_context
from attention.ops import paged_attention

__all__ = ["AttentionBackend", "BatchLayout", "get_backend", "ForwardContext",
           "get_forward_context", "set_forward_context", "paged_attention"]
