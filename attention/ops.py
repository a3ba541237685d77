"""`zooinfer::paged_attention` and `zooinfer::state_update`: the cache-touching parts of a
layer as registered torch custom ops.

torch.compile treats each op as opaque (it mutates only the cache pages it is given), so the
whole model compiles with fullgraph=True while the code underneath stays free to plan on
the host, launch Triton or FlashInfer kernels, loop over requests or use varying
Python-side shapes. Both look their per-step plan up in the forward context by layer id,
so the graph carries only tensors and constants and never recompiles for a new batch.
"""
from __future__ import annotations

import torch

from attention.context import get_forward_context


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
           layer_id: int, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's k/v into the layer's pages and attend: what `zooinfer::paged_attention`
    runs. Eager callers use this directly (the custom-op dispatch costs ~35 us a call, a few
    ms per step on a 30-layer model); traced code must use the op (see `paged_attention_op`).
    `sinks` ([num_heads], optional): a learned logit per head in every query's softmax
    denominator, with no value (gpt-oss); backends that cannot honour it raise."""
    ctx = get_forward_context()
    return ctx.backend.forward(q, k, v, kv_cache, ctx.layer_meta[layer_id], scale, sinks)


@torch.library.custom_op("zooinfer::paged_attention", mutates_args=("kv_cache",))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    layer_id: int, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return attend(q, k, v, kv_cache, layer_id, scale, sinks)


def paged_attention_op():
    """The attention callable for this call site: the custom op under torch.compile (opaque to
    the graph), the plain function in eager mode."""
    return torch.ops.zooinfer.paged_attention if torch.compiler.is_compiling() else attend


@paged_attention.register_fake
def _(q, k, v, kv_cache, layer_id, scale, sinks=None):
    return torch.empty_like(q)


@torch.library.custom_op("zooinfer::state_update", mutates_args=("pages",))
def state_update(inputs: list[torch.Tensor], pages: torch.Tensor, layer_id: int,
                 out_shape: list[int]) -> torch.Tensor:
    """A state layer's (Mamba2, Gated DeltaNet) recurrent part on this step's requests.

    `inputs` are the layer's projected activations, `[num_tokens, ...]` first; `pages` is
    the layer's view of the pool. The requests' states are gathered from their pages per the
    group's `StatePlan`, updated by the mixer's `update_states(inputs, states, plan)`, and
    written back. Returns `[num_tokens, *out_shape]` float32 (state kernels compute in fp32).
    """
    ctx = get_forward_context()
    plan, mixer = ctx.layer_meta[layer_id], ctx.state_layers[layer_id]
    rows, states = plan.gather(pages, mixer.state_shapes().values())
    out = mixer.update_states(inputs, states, plan)
    plan.scatter(pages, rows)
    return out


@state_update.register_fake
def _(inputs, pages, layer_id, out_shape):
    return inputs[0].new_empty((inputs[0].shape[0], *out_shape), dtype=torch.float32)
