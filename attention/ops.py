"""`zooinfer::paged_attention`: the attention call as a registered torch custom op.

torch.compile treats the op as opaque (it mutates only `kv_cache`), so the whole model
compiles with fullgraph=True while the backend underneath stays free to plan on the host,
launch Triton or FlashInfer kernels, or use varying Python-side shapes.
"""
from __future__ import annotations

import torch

from attention.context import get_forward_context


@torch.library.custom_op("zooinfer::paged_attention", mutates_args=("kv_cache",))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    layer_id: int, scale: float) -> torch.Tensor:
    ctx = get_forward_context()
    return ctx.backend.forward(q, k, v, kv_cache, ctx.layer_meta[layer_id], scale)


@paged_attention.register_fake
def _(q, k, v, kv_cache, layer_id, scale):
    return torch.empty_like(q)
