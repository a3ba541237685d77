"""`zooinfer::mla_attention`: multi-head latent attention over a latent-only paged cache.

An MLA layer (models/kinds/mla.py) caches per token one row `[latent | k_pe]`
(`cache.kv_cache_spec.MLASpec`): the compressed KV latent and the roped key part shared by
all heads. It absorbs the key up-projection into its queries before calling this op, so
attention is multi-query over those rows: every head's query is `[q_latent | q_pe]`, the
keys are the cached rows themselves and the values their latent part. The layer maps the
latent output back through the value up-projection. Keys and values are never expanded,
neither in the cache nor here.

The plan (`MLAPlan`, built once per step per MLA group by `runtime.worker.step_plan`)
splits the batch into decodes (one query token) and the rest (prefill chunks), each one
padded gather of the requests' pages plus a causal-by-position mask, made by the torch
backend's `_make_part`. Per part the op runs two batched matmuls with all heads of a
request folded into its query rows (one kv head), and a float32 softmax: no loop over
requests or tokens, any device, any dtype. Like `zooinfer::paged_attention` the op is opaque
to torch.compile and finds its plan in the forward context by cache id.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention.backend import BatchLayout
from attention.context import get_forward_context
from attention.torch_backend import _make_part, _Part


SCORE_BYTES = 256 << 20     # the most float32 scores one batched product materialises


@dataclass(slots=True)
class MLAPlan:
    """One step of one MLA group: where each new token's row goes, and the padded parts."""
    slot_block: torch.Tensor        # [num_tokens] int64 block of each new token's row
    slot_offset: torch.Tensor       # [num_tokens] int64 its row in that block
    parts: list[_Part]              # decodes, then prefill chunks (each absent when empty)

    @staticmethod
    def build(layout: BatchLayout, device: torch.device) -> MLAPlan:
        q_lens = layout.query_lens
        parts = [_make_part(layout, rows, device)
                 for rows in (np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1)) if len(rows)]
        slots = layout.slot_mapping.to(device)
        return MLAPlan(slot_block=slots // layout.block_size, slot_offset=slots % layout.block_size, parts=parts)


def mla_attend(q: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor, layer_id: int,
               latent_dim: int, scale: float) -> torch.Tensor:
    """Write this step's rows into the layer's pages, then attend.

    q: [num_tokens, num_heads, latent_dim + rope_dim] (absorbed queries); entries:
    [num_tokens, latent_dim + rope_dim] (normed latent | roped k_pe); kv_cache:
    [num_blocks, block_size, latent_dim + rope_dim], blocks possibly further apart than a page
    (packed pool pages: only whole blocks are indexed). Returns [num_tokens, num_heads,
    latent_dim]: the attention-weighted latents of every head."""
    plan: MLAPlan = get_forward_context().layer_meta[layer_id]
    dim = kv_cache.shape[-1]
    kv_cache.index_put_((plan.slot_block, plan.slot_offset), entries.to(kv_cache.dtype))
    num_heads = q.shape[1]
    out = q.new_empty(q.shape[0], num_heads, latent_dim)
    for part in plan.parts:          # at most two: decodes, prefill chunks
        n, max_q = part.token_index.shape
        keys = kv_cache.index_select(0, part.pages).view(n, -1, dim).to(q.dtype)   # [n, K, dim]
        # Query positions in tiles whose float32 scores stay within SCORE_BYTES (one tile
        # for decodes and short chunks; long prefill chunks of wide models take several).
        tile = max(1, SCORE_BYTES // (4 * n * num_heads * keys.shape[1]))
        for q0 in range(0, max_q, tile):
            index = part.token_index[:, q0: q0 + tile]
            rows = index.shape[1]
            queries = q[index].view(n, rows * num_heads, dim)                     # heads folded into rows
            scores = torch.bmm(queries, keys.transpose(1, 2)).view(n, rows, num_heads, -1).float() * scale
            scores = scores.masked_fill(~part.mask[:, 0, q0: q0 + tile, None], float("-inf"))
            probs = scores.softmax(dim=-1).to(q.dtype).view(n, rows * num_heads, -1)
            o = torch.bmm(probs, keys[..., :latent_dim]).view(n, rows, num_heads, latent_dim)
            scatter_tile(out, o, index, part.valid, q0, tile)
    return out


def scatter_tile(out: torch.Tensor, o: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None,
                 q0: int, tile: int) -> None:
    """Write one query tile's outputs o [n, rows, heads, dim] to their tokens' rows of `out`
    (`index` [n, rows]); a part with padded rows (`valid` [n, all rows]) writes only the real ones."""
    if valid is None:
        out[index.reshape(-1)] = o.reshape(-1, *out.shape[1:])
    else:
        rows = valid[:, q0: q0 + tile]
        out[index[rows]] = o[rows]


@torch.library.custom_op("zooinfer::mla_attention", mutates_args=("kv_cache",))
def mla_attention(q: torch.Tensor, entries: torch.Tensor, kv_cache: torch.Tensor, layer_id: int,
                  latent_dim: int, scale: float) -> torch.Tensor:
    return mla_attend(q, entries, kv_cache, layer_id, latent_dim, scale)


@mla_attention.register_fake
def _(q, entries, kv_cache, layer_id, latent_dim, scale):
    return q.new_empty(q.shape[0], q.shape[1], latent_dim)


def mla_attention_op():
    """The custom op under torch.compile (opaque to the graph), the plain function in eager
    mode (no custom-op dispatch cost per layer)."""
    return torch.ops.zooinfer.mla_attention if torch.compiler.is_compiling() else mla_attend


__all__ = ["MLAPlan", "mla_attend", "mla_attention", "mla_attention_op"]
