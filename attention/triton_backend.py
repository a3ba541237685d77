"""The triton backend: the paged k/v write and varlen paged attention as Triton kernels.

`plan()` turns the step's host-side layout into the few int32 tensors the kernels read, in
one host-to-device copy for the per-request vectors plus the block table and slot mapping,
and splits the work into query tiles:
- decodes (one query token): one tile each, so a decode program carries no padded tokens;
- every other request: tiles of `PREFILL_BLOCK_Q` consecutive queries.
Each forward is then the write kernel and at most two attention launches (one per tile size)
with no host work and no host syncs. On CPU tensors the kernels run under Triton's
interpreter (slow, for checking), on CUDA tensors compiled.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention import triton_kernels as tk
from attention.backend import AttentionBackend, BatchLayout


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int64
    query_start_loc: torch.Tensor   # [num_reqs + 1] int32
    seq_lens: torch.Tensor          # [num_reqs] int32, context after this step
    block_table: torch.Tensor       # [num_reqs, max_blocks] int32
    decode_req: torch.Tensor        # [num_decodes] int32 request index of each decode tile
    decode_q: torch.Tensor          # [num_decodes] int32 zeros (first query of the tile)
    prefill_req: torch.Tensor       # [num_prefill_tiles] int32
    prefill_q: torch.Tensor         # [num_prefill_tiles] int32 first query of the tile
    sliding_window: int | None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def plan(self, layout: BatchLayout, device: torch.device) -> TritonAttentionMetadata:
        q_lens = layout.query_lens.astype(np.int64)
        decode = np.flatnonzero(q_lens == 1)
        rest = np.flatnonzero(q_lens > 1)
        n_tiles = -(-q_lens[rest] // tk.PREFILL_BLOCK_Q)
        prefill_req = np.repeat(rest, n_tiles)
        first_tile = np.cumsum(n_tiles) - n_tiles
        prefill_q = (np.arange(len(prefill_req)) - np.repeat(first_tile, n_tiles)) * tk.PREFILL_BLOCK_Q
        parts = [layout.query_start_loc, layout.seq_lens, decode, np.zeros_like(decode), prefill_req, prefill_q]
        packed = torch.from_numpy(np.concatenate(parts).astype(np.int32)).to(device)
        views = torch.split(packed, [len(p) for p in parts])
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping.to(device=device, dtype=torch.int64),
            query_start_loc=views[0], seq_lens=views[1],
            block_table=layout.block_table.to(device=device, dtype=torch.int32).contiguous(),
            decode_req=views[2], decode_q=views[3], prefill_req=views[4], prefill_q=views[5],
            sliding_window=layout.sliding_window)

    def forward(self, q, k, v, kv_cache, meta: TritonAttentionMetadata, scale: float, sinks=None):
        if q.shape[1] % kv_cache.shape[3]:
            raise ValueError(f"triton backend: {q.shape[1]} query heads do not divide into "
                             f"{kv_cache.shape[3]} kv heads")
        tk.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        common = (out, q, kv_cache, meta.block_table, meta.query_start_loc, meta.seq_lens)
        tk.paged_attention(*common, meta.decode_req, meta.decode_q, 1, scale, meta.sliding_window, sinks)
        tk.paged_attention(*common, meta.prefill_req, meta.prefill_q, tk.PREFILL_BLOCK_Q, scale,
                           meta.sliding_window, sinks)
        return out
