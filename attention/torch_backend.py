"""The torch backend: paged, varlen attention in plain torch (reference and CPU default).

One call serves a batch mixing prefill chunks and decodes. The plan splits the batch once
per step into
- decodes (one query token): one batched SDPA over their gathered pages, query length 1;
- the rest (prefill chunks, or several tokens after a preemption): one batched SDPA with
  queries padded to the longest chunk and a causal-by-position mask,
so the only Python-level work per layer is two SDPA calls and the page gathers; nothing loops
over tokens or requests.
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
    block_table: torch.Tensor   # [n, num_pages] pages covering the longest context
    mask: torch.Tensor          # [n, 1, max_q, num_pages * block_size] bool, True = attend


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    parts: list[_Part]


def _make_part(layout: BatchLayout, rows: np.ndarray, device: torch.device) -> _Part:
    qsl, seq_lens, bs = layout.query_start_loc, layout.seq_lens, layout.block_size
    q_lens = (qsl[rows + 1] - qsl[rows]).astype(np.int64)
    max_q = int(q_lens.max())
    ctx = seq_lens[rows].astype(np.int64)
    num_pages = -(-int(ctx.max()) // bs)
    j = np.arange(max_q, dtype=np.int64)
    valid = j[None, :] < q_lens[:, None]
    token_index = np.where(valid, qsl[rows][:, None] + j[None, :], qsl[rows][:, None])
    q_pos = (ctx - q_lens)[:, None] + j[None, :]                      # [n, max_q]
    kv_pos = np.arange(num_pages * bs, dtype=np.int64)
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < ctx[:, None, None])
    rows_t = torch.from_numpy(rows).to(device)
    return _Part(
        token_index=torch.from_numpy(token_index).to(device),
        valid=None if valid.all() else torch.from_numpy(valid).to(device),
        block_table=layout.block_table[rows_t, :num_pages].to(device=device, dtype=torch.long),
        mask=torch.from_numpy(mask).to(device).unsqueeze(1),
    )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        q_lens = layout.query_lens
        decode = np.flatnonzero(q_lens == 1)
        rest = np.flatnonzero(q_lens > 1)
        parts = [_make_part(layout, rows, device) for rows in (decode, rest) if len(rows)]
        return TorchAttentionMetadata(slot_mapping=layout.slot_mapping.to(device), parts=parts)

    def forward(self, q, k, v, kv_cache, meta: TorchAttentionMetadata, scale: float):
        num_tokens, num_heads, head_dim = q.shape
        k_pages, v_pages = kv_cache[0], kv_cache[1]          # [blocks, block_size, kv_heads, dim]
        _, block_size, num_kv_heads, _ = k_pages.shape
        k_pages.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_pages.dtype))
        v_pages.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_pages.dtype))
        k_rows, v_rows = k_pages.view(k_pages.shape[0], -1), v_pages.view(v_pages.shape[0], -1)
        out = torch.empty_like(q)
        for part in meta.parts:
            n, max_q = part.token_index.shape
            ctx_len = part.block_table.shape[1] * block_size
            # Gather whole pages as rows of a 2-D view: a plain row copy, several times
            # faster on CPU than advanced indexing or index_select over the 4-D tensor.
            pages = part.block_table.view(-1)
            keys = k_rows.index_select(0, pages).view(n, ctx_len, num_kv_heads, head_dim).transpose(1, 2)
            values = v_rows.index_select(0, pages).view(n, ctx_len, num_kv_heads, head_dim).transpose(1, 2)
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
