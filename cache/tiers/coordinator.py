"""The tier coordinator: moves pages between the KV pool and the tiers below it.

Policy:
- Write-back on eviction. Nothing moves while the pool has room: only when the pool hands
  out a page that still holds a cached block (`BlockPool.on_evict`) is that page read out,
  at the start of the step, and stored in the top tier. A tier that evicts (LRU) passes
  the entry down to the next one (host RAM -> disk -> remote). Requests free their blocks
  tail first, so a chain is evicted tail first in every tier too.
- Lookups extend the pool's prefix hit into the tiers only as far as every group is
  covered, by the pool's own rule (`prefix_coverage`): full-attention blocks from the
  start, sliding-window blocks inside the window before the hit, and for state groups
  (Mamba2, Gated DeltaNet, ...) a state checkpoint exactly at the hit, whose pages the tiers
  hold under the same keys as the pool (`StateManager._keys`).
- Loads are asynchronous. A request whose hit needs tier entries leaves the waiting queue
  (`waiting_for_kv`) while an I/O thread fetches them; the others' steps go on. When they
  have arrived (`poll`) the request re-enters the queue; at its admission they are
  promoted (written into new pool pages and published in the prefix cache under their
  keys), and the usual `reuse_prefix` takes them as a plain pool hit (so `cached_tokens`
  counts them).
- Optional write-through (`write_through`): every newly published block also goes to the
  tiers below host RAM at once, so other engines on a shared disk or Redis tier, and a
  restarted engine, hit it without waiting for an eviction.
- Swap (cache/tiers/swap.py) copies a preempted request's pages to host RAM instead of
  recomputing them, when it is long enough to be worth it.
"""
from __future__ import annotations

import logging
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait

import numpy as np

from cache.block_pool import KVCacheBlock
from cache.manager import KVCacheManager, StateManager
from cache.tiers.base import Tier, tier_key
from cache.tiers.host import HostTier
from cache.tiers.swap import SwapSpace
from cache.tiers.transfer import KVTransfers

log = logging.getLogger("zooinfer")


def prefix_coverage(kv: KVCacheManager, hashes: list[bytes], has) -> int:
    """The longest hit (in blocks) of `hashes` that every group covers, where `has(group,
    pool key)` says whether an entry is available: the rule `KVCacheManager.reuse_prefix`
    applies to the pool, over any set of entries."""
    n = len(hashes)
    if not n:
        return 0
    checks = []
    for m in kv.managers:
        if isinstance(m, StateManager):
            ok = [all(has(m.group_id, k) for k in m._keys(h)) for h in hashes]
            checks.append((m, None, ok))
        else:
            present = np.fromiter((has(m.group_id, h) for h in hashes), dtype=np.int64, count=n)
            checks.append((m, np.concatenate(([0], np.cumsum(present))), None))
    for k in range(n, 0, -1):
        good = True
        for m, cs, ok in checks:
            if ok is not None:
                good = ok[k - 1]
            else:
                r = m.needed_hit_range(k)
                good = cs[r.stop] - cs[r.start] == len(r)
            if not good:
                break
        if good:
            return k
    return 0


def needed_entries(kv: KVCacheManager, hashes: list[bytes], k: int) -> list[tuple[int, bytes]]:
    """(group, pool key) of every entry a hit of `k` blocks reads, in every group."""
    out = []
    for m in kv.managers:
        if isinstance(m, StateManager):
            out.extend((m.group_id, key) for key in m._keys(hashes[k - 1]))
        else:
            out.extend((m.group_id, hashes[i]) for i in m.needed_hit_range(k))
    return out


class TierCoordinator:
    def __init__(self, kv: KVCacheManager, tiers: list[Tier], fingerprint: bytes, payload_sizes: list[int],
                 *, preemption_mode: str = "auto", swap_min_tokens: int = 256, write_through: bool = False,
                 load_executor: Executor | None = None):
        """`payload_sizes`: bytes of one page's payload per group (a stored payload of another
        size is a miss); `load_executor` runs the tier loads (default: a thread of their own)."""
        if not tiers:
            raise ValueError("a tier coordinator needs at least one tier")
        self.kv, self.pool, self.tiers = kv, kv.pool, tiers
        self.fingerprint = fingerprint
        self.payload_sizes = payload_sizes          # bytes of one page's payload, per group
        self.host = tiers[0] if isinstance(tiers[0], HostTier) else None
        self.pool.on_evict = self._on_evict
        self.write_through = write_through and len(tiers) > (self.host is not None)
        if self.write_through:
            self.pool.on_cache = self._on_cache
        kv.on_free = self._on_free
        # This step's transfers, taken by the scheduler for the runner (`take_transfers`).
        self._reads: list[tuple[int, int, tuple]] = []    # (group, block id, destination)
        self._writes: list[tuple[int, int, bytes, str | None]] = []   # (group, block id, payload, owner)
        self._promoted: set[int] = set()           # pages whose promotion write is still queued
        self._in_flight: tuple[KVTransfers, list, list] | None = None
        self.waiting_for_kv: dict[str, tuple] = {}  # request id -> (request, future, hashes)
        self._tried: dict[str, int] = {}           # request id -> num_preemptions at its last tier lookup
        self._fetched: dict[str, tuple] = {}       # request id -> (hashes, loaded entries) not promoted yet
        self._loads = load_executor or ThreadPoolExecutor(1, thread_name_prefix="kv-tier-load")
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-store")
        self._store_futures: list[Future] = []
        self._storing: dict[bytes, bytes] = {}     # entries queued for a lower tier (loads see them)
        self.swap = SwapSpace(self, preemption_mode, swap_min_tokens)
        self.counters = dict.fromkeys(("written_back_blocks", "written_through_blocks", "tier_lookups", "tier_hit_requests",
                                       "tier_hit_tokens", "promoted_blocks", "promotions_deferred"), 0)

    def key(self, group: int, pool_key: bytes) -> bytes:
        return tier_key(self.fingerprint, group, pool_key)

    # ------------------------------------------------------------- write-back
    def _on_evict(self, block: KVCacheBlock) -> None:
        """The pool is about to reuse a page holding a cached block: read it out this step."""
        if block.block_id in self._promoted:      # promoted this step, never written: the tier still has it
            self._promoted.discard(block.block_id)
            self._writes = [w for w in self._writes if w[1] != block.block_id]
            return
        gid, pool_key = block.block_hash
        key = self.key(gid, pool_key)
        if self.host is not None and self.host.lookup(key):
            self.host.touch(key)
            return
        self._reads.append((gid, block.block_id, ("tier", key)))

    def _on_cache(self, block: KVCacheBlock) -> None:
        """Write-through: a newly published block (computed in the step that just ran) is
        read out next step and stored in the tiers below host RAM, where other engines and a
        restarted one find it without waiting for an eviction."""
        if block.block_id in self._promoted:     # a promoted page came from the tiers
            return
        gid, pool_key = block.block_hash
        self._reads.append((gid, block.block_id, ("through", self.key(gid, pool_key))))

    def _store_down(self, level: int, entries: list[tuple[bytes, bytes]]) -> None:
        """Store entries in tier `level`; what it evicts goes on down. The host tier stores
        on the calling thread (a memory copy); the others on the store thread."""
        if not entries or level >= len(self.tiers):
            return
        tier = self.tiers[level]
        if tier is self.host:
            evicted = []
            for k, p in entries:
                evicted.extend(tier.store(k, p))
            self._store_down(level + 1, evicted)
            return
        for k, p in entries:
            self._storing[k] = p
        self._store_futures = [f for f in self._store_futures if not f.done()]
        self._store_futures.append(self._stores.submit(self._store_job, level, entries))

    def _store_job(self, level: int, entries: list[tuple[bytes, bytes]]) -> None:
        while entries and level < len(self.tiers):
            evicted = []
            for k, p in entries:
                try:
                    evicted.extend(self.tiers[level].store(k, p))
                except Exception:  # noqa: BLE001 - a failed store is a later miss, not an engine failure
                    log.exception("kv tier %s: store failed", self.tiers[level].name)
            for k, _ in entries:
                self._storing.pop(k, None)
            entries, level = evicted, level + 1

    def persist(self, run, chunk: int = 1024) -> int:
        """Before shutdown: write every cached pool block and every host entry down to the
        tiers that outlive the process (disk, remote), so a restarted engine finds them.
        `run(transfers)` applies a transfer to the pool (the runner's copy); pages are read
        `chunk` at a time. Returns the entries written."""
        if self._in_flight is not None or self._reads or self._writes:
            raise RuntimeError("persist() runs between steps only")
        level = int(self.host is not None)
        cached = list(self.pool.cached.items())
        for start in range(0, len(cached), chunk):
            part = cached[start: start + chunk]
            t = KVTransfers(reads=[(gid, block.block_id) for (gid, _), block in part])
            run(t)
            self._store_down(level, [(self.key(gid, pool_key), p)
                                     for ((gid, pool_key), _), p in zip(part, t.read_payloads())])
        hosted = [(k, p) for k in self.host.keys() if (p := self.host._load(k)) is not None] if self.host else []
        self._store_down(level, hosted)
        self.flush()
        return len(cached) + len(hosted)

    def flush(self) -> None:
        """Wait until every queued store has reached its tier (tests, shutdown)."""
        wait(self._store_futures)
        self._store_futures = []

    # ------------------------------------------------------------- lookups and loads
    def _pool_has(self, group: int, pool_key: bytes) -> bool:
        return self.pool.get_cached_block(group, pool_key) is not None

    def start_load(self, request, hashes: list[bytes]) -> bool:
        """At admission: if the request's prefix reaches further with tier entries than with
        the pool alone, start fetching them and take the request out of the queue (True)."""
        rid = request.request_id
        if rid in self._fetched:        # its entries have arrived: promote them now, if the pool has room
            if self._promote(*self._fetched[rid]):
                del self._fetched[rid]
            return False
        if self._tried.get(rid) == request.num_preemptions or self.swap.has(rid):
            return False
        self._tried[rid] = request.num_preemptions
        usable = hashes[: (request.num_tokens - 1) // self.kv.block_size]
        if not usable:
            return False
        self.counters["tier_lookups"] += 1
        candidates = {(m.group_id, k) for m in self.kv.managers
                      for h in usable for k in (m._keys(h) if isinstance(m, StateManager) else (h,))
                      if not self._pool_has(m.group_id, k)}
        if not candidates:
            return False
        order = list(candidates)
        keys = [self.key(g, k) for g, k in order]
        where: dict[tuple[int, bytes], int] = {}
        for level, tier in enumerate(self.tiers):
            todo = [i for i, e in enumerate(order) if e not in where]
            if not todo:
                break
            try:
                found = tier.contains_many([keys[i] for i in todo])
            except Exception:  # noqa: BLE001 - an unreachable tier is a miss
                log.exception("kv tier %s: lookup failed", tier.name)
                continue
            where.update((order[i], level) for i, f in zip(todo, found) if f)
        k_pool = prefix_coverage(self.kv, usable, self._pool_has)
        k_all = prefix_coverage(self.kv, usable, lambda g, k: (g, k) in where or self._pool_has(g, k))
        if k_all <= k_pool:
            return False
        wanted = [(e, where[e]) for e in needed_entries(self.kv, usable, k_all) if e in where]
        future = self._loads.submit(self._fetch, [(e, self.key(*e), level) for e, level in wanted])
        self.waiting_for_kv[rid] = (request, future, usable)
        return True

    def _fetch(self, wanted) -> dict[tuple[int, bytes], bytes]:
        """I/O thread: each entry from the first tier that claimed it (or any below)."""
        out = {}
        for entry, key, level in wanted:
            payload = self._storing.get(key)
            for tier in self.tiers[level:] if payload is None else ():
                try:
                    payload = tier.load(key)
                except Exception:  # noqa: BLE001 - an unreachable tier is a miss
                    log.exception("kv tier %s: load failed", tier.name)
                if payload is not None:
                    break
            if payload is not None and len(payload) == self.payload_sizes[entry[0]]:
                out[entry] = payload
        return out

    def has_waiting(self) -> bool:
        return bool(self.waiting_for_kv)

    def poll(self, block: bool = False) -> list:
        """Requests whose tier entries have arrived (they go back to the queue; `start_load`
        promotes the entries when they come up for admission again, so they take pool pages
        exactly when the request can use them). With `block`, waits for the first load
        when nothing else could run."""
        if not self.waiting_for_kv:
            return []
        if block:
            wait([f for _, f, _ in self.waiting_for_kv.values()], timeout=30, return_when="FIRST_COMPLETED")
        ready = []
        for rid, (req, future, hashes) in list(self.waiting_for_kv.items()):
            if not future.done():
                continue
            del self.waiting_for_kv[rid]
            try:
                fetched = future.result()
            except Exception:  # noqa: BLE001
                log.exception("kv tier load failed; request %s computes its prefix", rid)
                fetched = {}
            self._fetched[rid] = (hashes, fetched)
            ready.append(req)
        return ready

    def _promote(self, hashes: list[bytes], fetched: dict) -> bool:
        """Publish the fetched entries of the longest hit they complete in new pool pages,
        at ref_cnt 0 like any cached block (most recently used): the request's
        `reuse_prefix`, right after, takes them as pool hits. Their writes run at the start
        of this step; one evicted before that is dropped with its write (`_on_evict`).
        False (nothing done) when the pool lacks the room the hit takes; entries are
        content-addressed, so they stay valid for a later try."""
        pool = self.pool
        k_pool = prefix_coverage(self.kv, hashes, self._pool_has)
        k = prefix_coverage(self.kv, hashes, lambda g, key: (g, key) in fetched or self._pool_has(g, key))
        if k <= k_pool:
            return True
        needed = needed_entries(self.kv, hashes, k)
        held = [pool.get_cached_block(g, key) for g, key in needed if self._pool_has(g, key)]
        new = [(g, key) for g, key in needed if not self._pool_has(g, key)]
        # The hit's pool blocks leave the free queue while the new pages are taken, so those
        # cannot evict them; all go back as the most recently used.
        if pool.get_num_free_blocks() - sum(b.ref_cnt == 0 for b in held) < len(new):
            self.counters["promotions_deferred"] += 1
            return False
        pool.touch(held)
        pages = pool.get_new_blocks(len(new))
        for block, (g, key) in zip(pages, new):
            self._promoted.add(block.block_id)
            pool.cache_block(block, g, key)
            self._writes.append((g, block.block_id, fetched[(g, key)], None))
        pool.free_blocks(held)
        pool.free_blocks(pages)
        self.counters["tier_hit_requests"] += 1
        self.counters["tier_hit_tokens"] += (k - k_pool) * self.kv.block_size
        self.counters["promoted_blocks"] += len(new)
        return True

    # ------------------------------------------------------------- the step
    def take_transfers(self) -> KVTransfers | None:
        """This step's page transfers for the runner (reads before writes)."""
        if not (self._reads or self._writes):
            return None
        t = KVTransfers(reads=[(g, b) for g, b, _ in self._reads], writes=[(g, b, p) for g, b, p, _ in self._writes])
        self._in_flight = (t, [d for _, _, d in self._reads], [o for *_, o in self._writes])
        self._reads, self._writes = [], []
        self._promoted = set()
        return t

    def finish_step(self) -> None:
        """After the runner ran this step's transfers: store what it read, free swap space."""
        if self._in_flight is not None:
            t, dests, owners = self._in_flight
            self._in_flight = None
            entries, through = [], []
            for dest, payload in zip(dests, t.read_payloads()):
                if dest[0] == "tier":
                    entries.append((dest[1], payload))
                elif dest[0] == "through":
                    through.append((dest[1], payload))
                else:
                    self.swap.saved(dest, payload)
            self.counters["written_back_blocks"] += len(entries)
            self.counters["written_through_blocks"] += len(through)
            self._store_down(0, entries)
            self._store_down(int(self.host is not None), through)
            self.swap.restored({o for o in owners if o is not None})

    def _on_free(self, request_id: str) -> None:
        """`KVCacheManager.free`: the request's pages may be someone else's at once, so no
        write queued for them may run."""
        if any(o == request_id for *_, o in self._writes):
            self._writes = [w for w in self._writes if w[3] != request_id]
            self.swap.unrestored(request_id)

    def forget(self, request_id: str) -> None:
        """The request is gone (finished, aborted): drop its load, swap space and marks."""
        entry = self.waiting_for_kv.pop(request_id, None)
        if entry is not None:
            entry[1].cancel()
        self._tried.pop(request_id, None)
        self._fetched.pop(request_id, None)
        self.swap.drop(request_id)

    def stats(self) -> dict:
        return {"tiers": {t.name: t.describe() for t in self.tiers}, **self.counters, **self.swap.counters,
                "num_waiting_for_kv": len(self.waiting_for_kv)}

    def close(self) -> None:
        self.flush()
        self._loads.shutdown(wait=True, cancel_futures=True)
        self._stores.shutdown(wait=True)
        for t in self.tiers:
            t.close()
