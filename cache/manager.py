"""KV cache managers: per-kind managers under one coordinator facade.

`KVCacheManager` is what the scheduler talks to. It allocates for every KV cache group of a
request at once (all or nothing, so a request never holds half its pages) and frees them
together. Per-kind managers know how many blocks a kind needs for a token count; full
attention keeps one block per `block_size` tokens. Sliding-window and state managers plug in
beside `FullAttentionManager` in the hybrid issue.
"""
from __future__ import annotations

from cache.block_pool import BlockPool, KVCacheBlock
from cache.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec, StateSpec


class SingleTypeKVCacheManager:
    """Blocks of one KV cache group, per request, in logical order."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool):
        self.spec = spec
        self.pool = pool
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int) -> int:
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, self.spec.max_blocks_for(num_tokens) - held)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        need = self.spec.max_blocks_for(num_tokens) - len(blocks)
        if need <= 0:
            return []
        new = self.pool.get_new_blocks(need)
        blocks.extend(new)
        return new

    def free(self, request_id: str) -> None:
        # Tail first: when prefix caching keeps freed blocks, a prompt's last blocks are the
        # first evicted and its shared head survives longest.
        blocks = self.req_to_blocks.pop(request_id, [])
        self.pool.free_blocks(reversed(blocks))


    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Return blocks no future token of the request can read (none for full attention)."""

    def num_live_blocks(self, request_id: str) -> int:
        return sum(not b.is_null for b in self.req_to_blocks.get(request_id, ()))


class FullAttentionManager(SingleTypeKVCacheManager):
    pass


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Keeps only the blocks inside the window: once every query still to come starts at
    or after position p, keys before p - W + 1 are dead, and their blocks go back to the
    pool. Their logical slots hold the null block so block indices stay positional."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_needed = max(0, num_computed_tokens - self.spec.sliding_window + 1)
        dead = min(first_needed // self.spec.block_size, len(blocks))
        freed = []
        for i in range(dead - 1, -1, -1):   # newest dead block first: older ones evict first later
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i] = self.pool.null_block
        if freed:
            self.pool.free_blocks(freed)


class StateManager(SingleTypeKVCacheManager):
    """A request's state takes `spec.pages` pages once, at admission, whatever its length;
    they are updated in place every step and freed with the request."""


MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    StateSpec: StateManager,
}


class KVCacheManager:
    """Facade over the pool and one manager per KV cache group."""

    def __init__(self, config: KVCacheConfig):
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.managers = [MANAGER_FOR_SPEC[type(g.spec)](g.spec, self.pool) for g in config.groups]

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0
                       ) -> list[list[int]] | None:
        """Make the request's blocks cover `num_tokens` tokens in every group, after
        returning blocks that no token from `num_computed_tokens` on can read.

        Returns the new block ids per group (possibly empty lists), or None, allocating
        nothing, when the pool cannot cover every group.
        """
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)
        need = sum(m.num_blocks_to_allocate(request_id, num_tokens) for m in self.managers)
        if need > self.pool.get_num_free_blocks():
            return None
        return [[b.block_id for b in m.allocate_new_blocks(request_id, num_tokens)]
                for m in self.managers]

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.get_num_free_blocks()

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return sum(m.num_blocks_to_allocate(request_id, num_tokens) for m in self.managers)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers]

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def usage(self) -> float:
        return self.pool.get_usage()

    def stats(self) -> dict:
        pool = self.pool
        per_group = [
            {"group": gid, "layers": len(g.layer_ids), "kind": type(g.spec).__name__,
             "blocks_in_use": sum(m.num_live_blocks(r) for r in m.req_to_blocks)}
            for gid, (g, m) in enumerate(zip(self.config.groups, self.managers))]
        return {"num_blocks": pool.num_usable_blocks, "num_free_blocks": pool.get_num_free_blocks(),
                "block_size": self.block_size, "usage": pool.get_usage(), "groups": per_group}
