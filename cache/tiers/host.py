"""Host RAM tier: page payloads in process memory, least recently used evicted first.

On CPU this is a second buffer beside the pool, so the whole mechanism (write-back on
eviction, promotion, swap) runs in the tests here; on GPU the coordinator's transfers move
pages through pinned memory on their own stream (cache/tiers/transfer.py). Swap-out of a
preempted request reserves part of the capacity (`reserve`), which LRU eviction never touches.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from cache.tiers.base import Tier


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()    # LRU first
        self._used = 0
        self.reserved = 0          # bytes held for swapped-out requests

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def _load(self, key: bytes) -> bytes | None:
        with self._lock:
            payload = self._entries.get(key)
            if payload is not None:
                self._entries.move_to_end(key)
            return payload

    def store(self, key: bytes, payload: bytes) -> list[tuple[bytes, bytes]]:
        n = len(payload)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return []
            if n > self.capacity_bytes - self.reserved:
                return [(key, payload)]        # cannot hold it at all: straight down
            evicted = self._evict_locked(self._used + n - (self.capacity_bytes - self.reserved))
            self._entries[key] = payload
            self._used += n
        self.stats.add(stores=1, bytes_stored=n)
        return evicted

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def evict(self, num_bytes: int) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return self._evict_locked(num_bytes)

    def _evict_locked(self, num_bytes: int) -> list[tuple[bytes, bytes]]:
        out, freed = [], 0
        while freed < num_bytes and self._entries:
            key, payload = self._entries.popitem(last=False)
            freed += len(payload)
            out.append((key, payload))
        self._used -= freed
        if out:
            self.stats.add(evictions=len(out))
        return out

    def reserve(self, num_bytes: int) -> list[tuple[bytes, bytes]] | None:
        """Set `num_bytes` aside (a swapped-out request); evicts LRU entries to make room and
        returns them, or None (nothing reserved) when even an empty tier is too small."""
        with self._lock:
            if self.reserved + num_bytes > self.capacity_bytes:
                return None
            self.reserved += num_bytes
            return self._evict_locked(self._used - (self.capacity_bytes - self.reserved))

    def release(self, num_bytes: int) -> None:
        with self._lock:
            self.reserved = max(0, self.reserved - num_bytes)

    def discard(self, key: bytes) -> None:
        with self._lock:
            payload = self._entries.pop(key, None)
            if payload is not None:
                self._used -= len(payload)

    def used_bytes(self) -> int:
        return self._used + self.reserved

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)
