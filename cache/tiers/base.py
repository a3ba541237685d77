"""The tier interface below the KV pool, and what every tier shares.

A tier maps keys to page payloads. A key is `fingerprint (16 bytes) | group (2) | pool key`,
where the pool key is the block's chained sha256 hash (attention blocks) or that hash plus a
page index (the pages of a state checkpoint, `StateManager._keys`): the same keys the pool's
prefix cache uses, so a tier hit obeys exactly the pool's rules. The fingerprint covers the
model's weights, the KV layout (specs, dtypes, block size, page packing) and a user salt, so a
tier shared by several engines never serves KV another model or layout computed.

On storage that outlives the process (disk, a remote store) each value is framed
(`pack_entry`): magic, fingerprint, key, payload length and the payload's sha256. `unpack_entry`
checks all of them; a corrupt or truncated value is a miss (counted `corrupt`), a value
written under another fingerprint is refused (counted `refused`), never a wrong answer.
"""
from __future__ import annotations

import hashlib
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable

MAGIC = b"ZKVT\x01"
FINGERPRINT_BYTES = 16
_HEADER = struct.Struct("<5s16sHQ32s")      # magic, fingerprint, key length, payload length, sha256


def make_fingerprint(parts: Iterable[bytes | str]) -> bytes:
    """16 bytes identifying what a tier entry is valid for (model, layout, salt)."""
    h = hashlib.sha256(b"zooinfer-kv-tier-v1")
    for p in parts:
        b = p.encode() if isinstance(p, str) else bytes(p)
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()[:FINGERPRINT_BYTES]


def tier_key(fingerprint: bytes, group: int, pool_key: bytes) -> bytes:
    return fingerprint + group.to_bytes(2, "little") + pool_key


class EntryError(Exception):
    """A stored value that is not a valid entry for the key asked (`reason`: corrupt or refused)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def pack_entry(key: bytes, payload: bytes) -> bytes:
    header = _HEADER.pack(MAGIC, key[:FINGERPRINT_BYTES], len(key), len(payload), hashlib.sha256(payload).digest())
    return header + key + payload


def unpack_entry(blob: bytes, key: bytes) -> bytes:
    """The payload of a framed value stored under `key`; EntryError if it is not valid."""
    if len(blob) < _HEADER.size:
        raise EntryError("corrupt")
    magic, fp, key_len, n, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise EntryError("corrupt")
    if fp != key[:FINGERPRINT_BYTES]:
        raise EntryError("refused")
    start = _HEADER.size + key_len
    if blob[_HEADER.size:start] != key or len(blob) != start + n:
        raise EntryError("corrupt")
    payload = blob[start:]
    if hashlib.sha256(payload).digest() != digest:
        raise EntryError("corrupt")
    return bytes(payload)


class TierStats:
    """Counters of one tier (thread-safe: loads and stores run on I/O threads)."""

    FIELDS = ("lookups", "hits", "misses", "corrupt", "refused", "stores", "evictions",
              "bytes_loaded", "bytes_stored", "load_seconds", "store_seconds")

    def __init__(self):
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.FIELDS, 0)

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                self.values[k] += v

    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self.values)
        loads = out["hits"] + out["misses"] + out["corrupt"] + out["refused"]
        out["mean_load_ms"] = 1000 * out["load_seconds"] / loads if loads else 0.0
        return out


class Tier(ABC):
    """One level below the pool: lookup / load / store / touch / evict over tier keys.

    `store` returns the entries it evicted to make room (least recently used first), so
    the coordinator can write them back to the next tier down. Implementations are
    thread-safe: the coordinator loads and stores on I/O threads."""

    name = "tier"

    def __init__(self, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"{self.name} tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()

    @abstractmethod
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is (probably) held; a later `load` may still miss."""

    @abstractmethod
    def _load(self, key: bytes) -> bytes | None:
        """The verified payload, None if absent; EntryError if present but invalid."""

    @abstractmethod
    def store(self, key: bytes, payload: bytes) -> list[tuple[bytes, bytes]]:
        """Keep `payload` under `key` (most recently used); returns the evicted entries."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """Mark `key` most recently used."""

    @abstractmethod
    def evict(self, num_bytes: int) -> list[tuple[bytes, bytes]]:
        """Drop least recently used entries until `num_bytes` are freed; returns them."""

    @abstractmethod
    def used_bytes(self) -> int: ...

    def lookup(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def load(self, key: bytes) -> bytes | None:
        """`_load` with the counters: a hit, a miss, or an invalid entry (a miss, counted)."""
        start = time.perf_counter()
        try:
            payload = self._load(key)
        except EntryError as e:
            self.stats.add(lookups=1, load_seconds=time.perf_counter() - start, **{e.reason: 1})
            self.discard(key)
            return None
        dt = time.perf_counter() - start
        if payload is None:
            self.stats.add(lookups=1, misses=1, load_seconds=dt)
        else:
            self.stats.add(lookups=1, hits=1, bytes_loaded=len(payload), load_seconds=dt)
        return payload

    def discard(self, key: bytes) -> None:
        """Forget an invalid entry (default: nothing)."""

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {**self.stats.snapshot(), "capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes()}
