"""Local disk tier: one file per (group, block) entry, framed and checksummed.

`root/<fingerprint>/<2 hex>/<key hex>.kv`, written to a temporary file in the same folder and
renamed into place (atomic on POSIX), so a reader, in this process or another engine's,
sees a whole entry or none. A file that is truncated or corrupt fails its sha256 check and is
a miss (deleted); one under another fingerprint is refused. The tier's size is kept under
`capacity_bytes` by deleting the least recently used files this process knows of; the
index is rebuilt from the folder at start-up (oldest modification first), so entries
survive a restart. Files that other processes write are found by name (`contains_many`).
"""
from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from cache.tiers.base import EntryError, Tier, pack_entry, unpack_entry


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fingerprint: bytes):
        super().__init__(capacity_bytes)
        self.root = Path(root) / fingerprint.hex()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()     # key -> file bytes, LRU first
        self._used = 0
        found = []
        for path in self.root.glob("*/*.kv"):
            try:
                st = path.stat()
                found.append((st.st_mtime, bytes.fromhex(path.stem), st.st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[-2:] / f"{h}.kv"

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            known = [k in self._index for k in keys]
        return [True if hit else self._path(k).exists() for k, hit in zip(keys, known)]

    def _load(self, key: bytes) -> bytes | None:
        try:
            blob = self._path(key).read_bytes()
        except OSError:
            with self._lock:
                self._forget(key)
            return None
        payload = unpack_entry(blob, key)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:                              # written by another process: ours to track now
                self._index[key] = len(blob)
                self._used += len(blob)
        return payload

    def store(self, key: bytes, payload: bytes) -> list[tuple[bytes, bytes]]:
        blob = pack_entry(key, payload)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._lock:
            self._index[key] = len(blob)
            self._used += len(blob)
            victims = self._victims_locked(self._used - self.capacity_bytes)
        self.stats.add(stores=1, bytes_stored=len(payload))
        return self._remove(victims)

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

    def evict(self, num_bytes: int) -> list[tuple[bytes, bytes]]:
        with self._lock:
            victims = self._victims_locked(num_bytes)
        return self._remove(victims)

    def _victims_locked(self, num_bytes: int) -> list[bytes]:
        victims, freed = [], 0
        while freed < num_bytes and self._index:
            key, size = self._index.popitem(last=False)
            freed += size
            victims.append(key)
        self._used -= freed
        return victims

    def _remove(self, victims: list[bytes]) -> list[tuple[bytes, bytes]]:
        """Delete evicted files; returns their payloads (for a tier below, if any)."""
        out = []
        for key in victims:
            path = self._path(key)
            try:
                out.append((key, unpack_entry(path.read_bytes(), key)))
            except (OSError, EntryError):
                pass
            path.unlink(missing_ok=True)
        if victims:
            self.stats.add(evictions=len(victims))
        return out

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._forget(key)
        self._path(key).unlink(missing_ok=True)

    def used_bytes(self) -> int:
        return self._used

