"""The torch backend: paged, varlen attention in plain torch (reference and CPU default).

One call serves a batch mixing prefill chunks and decodes. The plan splits the batch once
per step into
- decodes (one query token): one batched SDPA over their gathered pages, query length 1;
- the rest (prefill chunks, or several tokens after a preemption): one batched SDPA with
  queries padded to the longest chunk and a causal-by-position mask,
so the only Python-level work per layer is two SDPA calls and the page gathers; nothing loops
over tokens or requests. Sliding-window groups gather only the pages inside the window.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from attention.backend import AttentionBackend, BatchLayout


@dataclass(slots=True)
class _Part:
    """One SDPA call's worth of requests."""
    token_index: torch.Tensor   # [n, max_q] flat token index of each query slot (pads: any valid)
    valid: torch.Tensor | None  # [n, max_q] bool, None when every slot is real (decode)
    pages: torch.Tensor         # [n * num_pages] block ids to gather, row-major
    mask: torch.Tensor          # [n, 1, max_q, num_pages * block_size] bool, True = attend


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    parts: list[_Part]


def _make_part(layout: BatchLayout, rows: np.ndarray, device: torch.device) -> _Part:
    qsl, seq_lens, bs, window = layout.query_start_loc, layout.seq_lens, layout.block_size, layout.sliding_window
    q_lens = (qsl[rows + 1] - qsl[rows]).astype(np.int64)
    max_q = int(q_lens.max())
    ctx = seq_lens[rows].astype(np.int64)
    first_q = ctx - q_lens                                              # position of the first query
    # First page each request needs: 0, or the one holding the window start of its first query.
    start_page = np.zeros_like(ctx) if window is None else np.maximum(first_q - window + 1, 0) // bs
    num_pages = int((-(-ctx // bs) - start_page).max())
    page_index = start_page[:, None] + np.arange(num_pages)[None, :]   # [n, num_pages] logical pages
    table = layout.block_table.numpy()
    page_index_clipped = np.minimum(page_index, table.shape[1] - 1)    # past-the-end pages are masked
    pages = table[rows[:, None], page_index_clipped].astype(np.int64)
    j = np.arange(max_q, dtype=np.int64)
    valid = j[None, :] < q_lens[:, None]
    token_index = np.where(valid, qsl[rows][:, None] + j[None, :], qsl[rows][:, None])
    q_pos = first_q[:, None] + j[None, :]                              # [n, max_q]
    kv_pos = (page_index[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(len(rows), -1)
    mask = (kv_pos[:, None, :] <= q_pos[:, :, None]) & (kv_pos[:, None, :] < ctx[:, None, None])
    if window is not None:
        mask &= kv_pos[:, None, :] > q_pos[:, :, None] - window
    return _Part(
        token_index=torch.from_numpy(token_index).to(device),
        valid=None if valid.all() else torch.from_numpy(valid).to(device),
        pages=torch.from_numpy(pages.reshape(-1)).to(device),
        mask=torch.from_numpy(mask).to(device).unsqueeze(1),
    )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        """`layout.block_table` rows must be in batch order (row i = request i)."""
        q_lens = layout.query_lens
        decode = np.flatnonzero(q_lens == 1)
        rest = np.flatnonzero(q_lens > 1)
        parts = [_make_part(layout, rows, device) for rows in (decode, rest) if len(rows)]
        return TorchAttentionMetadata(slot_mapping=layout.slot_mapping.to(device), parts=parts)

    def forward(self, q, k, v, kv_cache, meta: TorchAttentionMetadata, scale: float):
        num_tokens, num_heads, head_dim = q.shape
        num_blocks, _, block_size, num_kv_heads, _ = kv_cache.shape   # [blocks, K|V, block, heads, dim]
        # Write this step's keys and values: slot s is token s % B of block s // B.
        blk, off = meta.slot_mapping // block_size, meta.slot_mapping % block_size
        kv_cache[blk, 0, off] = k.to(kv_cache.dtype)
        kv_cache[blk, 1, off] = v.to(kv_cache.dtype)
        rows = kv_cache.view(num_blocks, -1)
        out = torch.empty_like(q)
        for part in meta.parts:
            n, max_q = part.token_index.shape
            # Gather whole pages (K and V together) as rows of a 2-D view: a plain row copy,
            # several times faster on CPU than advanced indexing over the 5-D tensor.
            gathered = rows.index_select(0, part.pages).view(n, -1, 2, block_size, num_kv_heads, head_dim)
            ctx_len = gathered.shape[1] * block_size
            keys = gathered[:, :, 0].reshape(n, ctx_len, num_kv_heads, head_dim).transpose(1, 2)
            values = gathered[:, :, 1].reshape(n, ctx_len, num_kv_heads, head_dim).transpose(1, 2)
            queries = q[part.token_index].transpose(1, 2)          # [n, heads, max_q, dim]
            o = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype),
                                               attn_mask=part.mask, scale=scale,
                                               enable_gqa=num_heads != num_kv_heads)
            o = o.transpose(1, 2)                                  # [n, max_q, heads, dim]
            if part.valid is None:
                out[part.token_index.view(-1)] = o.reshape(-1, num_heads, head_dim)
            else:
                out[part.token_index[part.valid]] = o[part.valid]
        return out
