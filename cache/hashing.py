"""Block hashes for prefix caching.

A full block's hash chains its parent's hash, its token ids and extra keys (a per-request
`cache_salt`, ...), so equal hashes mean equal whole prefixes. sha256 over a fixed byte
encoding: stable across processes and runs, and not forgeable by crafted token sequences
the way Python's `hash()` of user data would be.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        extra: bytes = b"") -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start: start + block_size], extra))
