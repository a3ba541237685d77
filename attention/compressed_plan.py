"""Per-step plans of DeepSeek-V4's compressed attention caches, one per KV cache group.

A CSA / HCA layer owns several caches (models/kinds/compressed_attention.py), each in its own
group with its own block table, all in token coordinates at the one block size:

- K=V sliding rows (`SlidingRowsSpec`, compress rate 0): planned as an MLA group is
  (`MLAPlan`: write slots plus padded decode / prefill parts with the window mask);
- compressor source rows (`SlidingRowsSpec` with a compress rate): `RowsPlan`, where this
  step's rows go and, for every window this step closes, where its source rows are;
- compressed entries and indexer keys (`CompressedEntrySpec`): `EntryPlan`, where each new
  entry goes and, per part, the request's entry pages plus which entries each query sees.

Every plan enumerates this step's new entries the same way (`new_entries`: requests in batch
order, then entry index), so the op pairs the rows plan's sources with the entry plan's
destinations by position, and every plan splits the batch into the same parts (decodes,
then the rest), so the sliding part and the entry part of a request line up.
All index work is numpy on host facts, once per group per step; no host sync in the op.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention.backend import BatchLayout


def part_rows(layout: BatchLayout) -> list[np.ndarray]:
    """The batch rows of each part: decodes (one query), then the rest; empty parts dropped."""
    q_lens = layout.query_lens
    return [rows for rows in (np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1)) if len(rows)]


def new_entries(layout: BatchLayout, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(batch row, entry index w) of every entry this step closes: entry w closes with token
    (w+1)*m - 1, so a request computing positions [p0, p1) closes w in [p0 // m, p1 // m)."""
    p1 = layout.seq_lens.astype(np.int64)
    p0 = p1 - layout.query_lens
    first, counts = p0 // m, p1 // m - p0 // m
    req = np.repeat(np.arange(len(p1)), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    w = np.repeat(first, counts) + (np.arange(len(req)) - starts)
    return req, w


def _slots(layout: BatchLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    slots = layout.slot_mapping.to(device)
    return slots // layout.block_size, slots % layout.block_size


@dataclass(slots=True)
class RowsPlan:
    """Compressor source rows: where this step's rows go, and the rows of each new entry."""
    slot_block: torch.Tensor        # [num_tokens] block of each new token's row
    slot_offset: torch.Tensor       # [num_tokens] its row in that block
    src_block: torch.Tensor         # [E, S] block of each source row of each new entry
    src_offset: torch.Tensor        # [E, S]
    src_valid: torch.Tensor         # [E, S] False: a position before 0 (entry 0's Ca half)
    entry_pos: torch.Tensor         # [E] w * m, the position each entry is roped at
    num_new: int                    # E

    @staticmethod
    def build(layout: BatchLayout, m: int, overlap: bool, device: torch.device) -> RowsPlan:
        req, w = new_entries(layout, m)
        span = 2 * m if overlap else m
        first = (w - 1) * m if overlap else w * m
        pos = first[:, None] + np.arange(span)[None, :]                  # [E, S] source positions
        valid = pos >= 0
        pos = np.maximum(pos, 0)
        table = layout.block_table.numpy()
        block = table[req[:, None], pos // layout.block_size].astype(np.int64)
        slot_block, slot_offset = _slots(layout, device)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
        return RowsPlan(slot_block, slot_offset, t(block), t(pos % layout.block_size), t(valid), t(w * m), len(req))


@dataclass(slots=True)
class EntryPart:
    """One part's entries: the gathered pages put entry w of a request at index w."""
    pages: torch.Tensor             # [n * cols] entry-holding block ids, row-major
    seen: torch.Tensor              # [n, max_q] entries query t sees: (t+1) // m (w < seen)
    width: int                      # cols * entries_per_page, the gathered entries per request

    def visible(self, q0: int, q1: int) -> torch.Tensor:
        """[n, q1 - q0, width] bool: which gathered entries queries q0..q1 of each request see
        (built on the device, per query tile)."""
        entry = torch.arange(self.width, device=self.seen.device)
        return entry[None, None, :] < self.seen[:, q0:q1, None]


@dataclass(slots=True)
class EntryPlan:
    """Compressed entries (or indexer keys): where this step's new entries go, and per part
    the entries each query may see."""
    dst_block: torch.Tensor         # [E]
    dst_slot: torch.Tensor          # [E]
    parts: list[EntryPart]          # aligned with the sliding plan's parts
    num_new: int

    @staticmethod
    def build(layout: BatchLayout, m: int, entries_per_page: int, block_stride: int,
              device: torch.device) -> EntryPlan:
        bs, table = layout.block_size, layout.block_table.numpy()
        req, w = new_entries(layout, m)
        close = (w + 1) * m - 1
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
        dst_block = table[req, close // bs].astype(np.int64)
        parts = []
        for rows in part_rows(layout):
            ctx = layout.seq_lens[rows].astype(np.int64)
            q_lens = layout.query_lens[rows].astype(np.int64)
            cols = -(-ctx // bs) // block_stride                           # entry-holding blocks
            width = max(1, int(cols.max()))
            col_block = np.minimum(np.arange(width) * block_stride + block_stride - 1, table.shape[1] - 1)
            pages = table[rows[:, None], col_block[None, :]].astype(np.int64)
            q_pos = (ctx - q_lens)[:, None] + np.arange(int(q_lens.max()))[None, :]
            parts.append(EntryPart(t(pages.reshape(-1)), t((q_pos + 1) // m), width * entries_per_page))
        return EntryPlan(t(dst_block), t(w % entries_per_page), parts, len(req))


__all__ = ["EntryPart", "EntryPlan", "RowsPlan", "new_entries", "part_rows"]
