"""Page transfers between the pool's buffers and the tiers: the message the scheduler side
hands the runner each step, and the runner's vectorised copies.

`reads` are pages to copy out (blocks the pool just evicted, a preempted request's pages for
swap), `writes` pages to fill (tier hits promoted into the pool, a swapped-in request). The
runner applies them at the start of its step, reads before writes and both before the
forward and the step's page copies: a page evicted in this step's schedule may be refilled
by its new owner in this same step, and a promoted checkpoint is copied into a request's
state pages right after. A page's payload is the bytes its group's layers fill in every
buffer (`KVCacheConfig.group_spans`), concatenated, so a payload never carries another
group's memory.

On CUDA the copies run on their own stream through pinned memory. The forward waits for
them (an evicted page is rewritten by its new owner in this very step), but the host side
turns the read pages into payloads only after the forward was queued
(`KVTransfers.read_payloads`). Written, not run here (no GPU): unverified.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class KVTransfers:
    reads: list[tuple[int, int]] = field(default_factory=list)           # (group, block id)
    writes: list[tuple[int, int, bytes]] = field(default_factory=list)   # (group, block id, payload)
    _read_parts: list = field(default_factory=list)     # (positions, host tensor, event or None)
    _payloads: list[bytes] | None = None

    def __bool__(self) -> bool:
        return bool(self.reads or self.writes)

    def read_payloads(self) -> list[bytes]:
        """One payload per read, in order (waits for the device copies on CUDA)."""
        if self._payloads is None:
            out: list[bytes | None] = [None] * len(self.reads)
            for positions, host, event in self._read_parts:
                if event is not None:
                    event.synchronize()
                rows = host.numpy()
                for i, row in zip(positions, rows):
                    out[i] = row.tobytes()
            self._payloads = out
        return self._payloads


def _by_group(items, gid_of):
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(gid_of(item), []).append(i)
    return groups


def run_transfers(t: KVTransfers, spans: list[list[torch.Tensor]], device: torch.device) -> None:
    """Apply `t` to the pool: `spans[g]` are group g's `[num_blocks, bytes]` uint8 views.
    On CUDA every device op here runs on one side stream (made to wait for the work queued
    so far), and the current stream waits for it before the forward."""
    if not t:
        return
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))     # the last forward's writes land first
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for gid, positions in _by_group(t.reads, lambda r: r[0]).items():
            ids = torch.tensor([t.reads[i][1] for i in positions], dtype=torch.long).to(device)
            pages = torch.cat([s.index_select(0, ids) for s in spans[gid]], 1)
            if side is None:
                t._read_parts.append((positions, pages, None))
                continue
            host = torch.empty(pages.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(pages, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
            t._read_parts.append((positions, host, event))
        for gid, positions in _by_group(t.writes, lambda w: w[0]).items():
            ids = torch.tensor([t.writes[i][1] for i in positions], dtype=torch.long).to(device)
            rows = torch.from_numpy(np.frombuffer(b"".join(t.writes[i][2] for i in positions), dtype=np.uint8)
                                    .reshape(len(positions), -1).copy())
            if side is not None:
                rows = rows.pin_memory().to(device, non_blocking=True)
            col = 0
            for s in spans[gid]:
                width = s.shape[1]
                s.index_copy_(0, ids, rows[:, col: col + width])
                col += width
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)    # the forward reads the written pages


def payload_bytes(spans: list[torch.Tensor]) -> int:
    return sum(s.shape[1] for s in spans)
