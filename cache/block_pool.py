"""Physical KV cache blocks and the pool that hands them out.

The free queue is a doubly linked list threaded through the blocks themselves, so taking a
block from the head, returning one to the tail and pulling one out of the middle (a prefix
cache hit on a freed block, later) are all O(1) with no allocation.
"""
from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One page of KV memory. `block_hash` is set when the block is full and cacheable."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # (group id, chained hash) while the block is in the prefix cache, else None.
        self.block_hash: tuple[int, bytes] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is taken first (least recently freed)."""

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        # Sentinels keep every link operation branch-free.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def block_ids(self) -> list[int]:
        ids, node = [], self._head.next_free
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """All physical blocks of the cache. Block 0 is the null block: a placeholder id that
    block-table slots point at when they hold nothing (never allocated, never freed)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned: never enters the free queue
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # Prefix cache: (group, hash) -> block. Cached blocks stay here at ref_cnt 0, in the
        # free queue, until the queue hands them out again (lazy LRU eviction).
        self.cached: dict[tuple[int, bytes], KVCacheBlock] = {}
        self.num_evictions = 0
        # Called with each cached block about to be evicted, while it still holds its hash and
        # contents (the KV tiers write it back: cache/tiers/coordinator.py).
        self.on_evict = None
        self.on_cache = None     # called with each newly published block (tiers' write-through)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue with ref_cnt 1."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, only {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:   # evicted: its old contents are gone
                if self.on_evict is not None:
                    self.on_evict(block)
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, group: int, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get((group, block_hash))

    def cache_block(self, block: KVCacheBlock, group: int, block_hash: bytes) -> None:
        """Publish a full, computed block under its chained hash (first writer wins)."""
        key = (group, block_hash)
        if block.block_hash is None and key not in self.cached:
            block.block_hash = key
            self.cached[key] = block
            if self.on_cache is not None:
                self.on_cache(block)

    def touch(self, blocks) -> None:
        """Take a reference on cache hits; a block at ref_cnt 0 leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue tail in
        the order given (callers pass a request's tail blocks first, so they are evicted
        before its prefix)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
