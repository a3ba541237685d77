"""Preemption by swap: a preempted request's pages go to host RAM and come back.

Recompute (free the blocks, start again; cached hashes make it cheap) is the default for
short requests. A request with at least `swap_min_tokens` computed tokens (mode "auto"), or
every request (mode "swap"), is swapped instead when the host tier can set its bytes aside:
every page it holds in every group (the partial last block, a sliding window's live blocks,
the state pages of Mamba2 / DeltaNet layers as of the preemption) is read out in the step
of the preemption, and on readmission copied into new pages, so the request resumes at
exactly the token it had reached, state included. Swap space is reserved in the host tier
and never LRU-evicted; it is released when the request is restored or finishes.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "recompute", "swap")


@dataclass(slots=True)
class SwapRecord:
    num_computed_tokens: int
    layout: list[list[bool]]                  # per group, per logical block: held (not null)
    groups: list[int]                         # group of each saved page, in order
    payloads: list[bytes | None]
    nbytes: int
    pending: int                              # pages not read out yet
    restoring: bool = False

    @property
    def complete(self) -> bool:
        return self.pending == 0


class SwapSpace:
    def __init__(self, coordinator, mode: str, min_tokens: int):
        if mode not in MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"swap_min_tokens must be a positive integer, got {min_tokens!r}")
        self.c = coordinator
        self.mode, self.min_tokens = mode, min_tokens
        self.records: dict[str, SwapRecord] = {}
        self.counters = dict.fromkeys(("swapped_out", "swapped_in", "swap_fallbacks", "swap_bytes",
                                       "swap_refused"), 0)

    def has(self, request_id: str) -> bool:
        return request_id in self.records

    def _busy(self, rid: str) -> bool:
        """Pages of the request that this step still fills (a checkpoint load, a fork copy, a
        restore): they do not hold its tokens yet, so they cannot be swapped out."""
        kv = self.c.kv
        return (rid in kv.fork_copies or any(rid in m.loads for m in kv.state_managers)
                or any(o == rid for *_, o in self.c._writes))

    def swap_out(self, request) -> bool:
        """Called before the scheduler frees a preempted request: queue reads of its pages
        (True), or leave it to recompute (False)."""
        c, rid, n = self.c, request.request_id, request.num_computed_tokens
        if c.host is None or self.mode == "recompute" or n == 0 or \
                (self.mode == "auto" and n < self.min_tokens) or self._busy(rid):
            return False
        layout, reads = [], []
        for m in c.kv.managers:
            blocks = m.req_to_blocks.get(rid, [])
            layout.append([not b.is_null for b in blocks])
            reads.extend((m.group_id, b.block_id) for b in blocks if not b.is_null)
        nbytes = sum(c.payload_sizes[g] for g, _ in reads)
        evicted = c.host.reserve(nbytes)
        if evicted is None:
            self.counters["swap_refused"] += 1
            return False
        c._store_down(1, evicted)
        self.drop(rid)
        self.records[rid] = SwapRecord(n, layout, [g for g, _ in reads], [None] * len(reads), nbytes, len(reads))
        c._reads.extend((g, b, ("swap", rid, i)) for i, (g, b) in enumerate(reads))
        self.counters["swapped_out"] += 1
        self.counters["swap_bytes"] += nbytes
        return True

    def saved(self, dest: tuple, payload: bytes) -> None:
        _, rid, i = dest
        rec = self.records.get(rid)
        if rec is not None and rec.payloads[i] is None:
            rec.payloads[i] = payload
            rec.pending -= 1

    def swap_in(self, request, can_wait: bool) -> bool | None:
        """At readmission: give the request new pages filled from its swapped pages and its
        computed tokens back (True). False if it was not swapped, or its pages never left the
        pool; then it recomputes. When the pool lacks room: None (wait for it) if `can_wait`
        (running requests will free pages), else False, giving the swap space up."""
        c, rid = self.c, request.request_id
        rec = self.records.get(rid)
        if rec is None:
            return False
        if not rec.complete:              # its pages were never read out: recompute
            self.counters["swap_fallbacks"] += 1
            self.drop(rid)
            return False
        if len(rec.payloads) > c.pool.get_num_free_blocks():
            if can_wait:
                return None
            self.counters["swap_fallbacks"] += 1
            self.drop(rid)
            return False
        new = iter(c.pool.get_new_blocks(len(rec.payloads)))
        payloads = iter(zip(rec.groups, rec.payloads))
        for m, held in zip(c.kv.managers, rec.layout):
            blocks = [next(new) if h else c.pool.null_block for h in held]
            for b in blocks:
                if not b.is_null:
                    g, p = next(payloads)
                    c._writes.append((g, b.block_id, p, rid))
            m.req_to_blocks[rid] = blocks
            m.num_cached[rid] = 0          # its full blocks are published again as usual
        rec.restoring = True
        request.num_computed_tokens = rec.num_computed_tokens
        return True

    def restored(self, owners: set[str]) -> None:
        """The writes of these requests' restores ran: their swap space is free."""
        for rid in owners:
            rec = self.records.get(rid)
            if rec is not None and rec.restoring:
                self.counters["swapped_in"] += 1
                self.drop(rid)

    def unrestored(self, request_id: str) -> None:
        rec = self.records.get(request_id)
        if rec is not None:
            rec.restoring = False

    def drop(self, request_id: str) -> None:
        rec = self.records.pop(request_id, None)
        if rec is not None:
            self.c.host.release(rec.nbytes)
