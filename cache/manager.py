"""KV cache managers: per-kind managers under one coordinator facade.

`KVCacheManager` is what the scheduler talks to. It allocates for every KV cache group of a
request at once (all or nothing, so a request never holds half its pages) and frees them
together; it also finds prefix hits that hold for every group, forks a request's blocks
(copy-on-write) and plans state checkpoints. Per-kind managers know what a kind keeps: full
attention one block per `block_size` tokens, sliding windows only the blocks a future query
can see, state layers one fixed set of pages per request (plus checkpoint copies).
"""
from __future__ import annotations

from cache.block_pool import BlockPool, KVCacheBlock
from cache.kv_cache_spec import (CompressedEntrySpec, FullAttentionSpec, KVCacheConfig, KVCacheSpec, MLASpec,
                                 SlidingWindowSpec, StateSpec)


class SingleTypeKVCacheManager:
    """Blocks of one KV cache group, per request, in logical order."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int = 0):
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached: dict[str, int] = {}     # leading blocks already published per request

    # ------------------------------------------------------------- prefix caching
    def find_hit_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of this prefix the cache holds for this group."""
        n = 0
        for h in hashes:
            if self.pool.get_cached_block(self.group_id, h) is None:
                break
            n += 1
        return n

    def needed_hit_range(self, num_blocks: int) -> range:
        """Which of the first `num_blocks` hit blocks the request must hold (all of them)."""
        return range(num_blocks)

    def take_hits(self, request_id: str, hashes: list[bytes], num_blocks: int) -> None:
        """Start the request's blocks with the cached ones (null where not needed)."""
        needed = self.needed_hit_range(num_blocks)
        blocks = [self.pool.get_cached_block(self.group_id, hashes[i]) if i in needed else self.pool.null_block
                  for i in range(num_blocks)]
        self.pool.touch(b for b in blocks if not b.is_null)
        self.req_to_blocks[request_id] = blocks
        self.num_cached[request_id] = num_blocks

    def cache_blocks(self, request_id: str, hashes: list[bytes], num_full_blocks: int) -> None:
        """Publish the request's newly full, computed blocks under their hashes."""
        blocks = self.req_to_blocks.get(request_id, ())
        start = self.num_cached.get(request_id, 0)
        for i in range(start, min(num_full_blocks, len(blocks), len(hashes))):
            if not blocks[i].is_null:
                self.pool.cache_block(blocks[i], self.group_id, hashes[i])
        self.num_cached[request_id] = max(start, min(num_full_blocks, len(blocks), len(hashes)))

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

    # ------------------------------------------------------------- forks
    def num_fork_blocks(self, parent_id: str, num_tokens: int) -> int:
        """New blocks a fork at `num_tokens` needs: the partial last block, if any (a null
        one, which holds nothing, is not copied)."""
        blocks, full = self.req_to_blocks.get(parent_id, ()), num_tokens // self.spec.block_size
        return int(num_tokens % self.spec.block_size != 0 and len(blocks) > full and not blocks[full].is_null)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Start `child_id` with the parent's cache for its first `num_tokens` tokens.

        Full blocks are shared by reference: no token of either request is ever written to
        them again. The partial last block is where both write their next tokens, so the
        child gets its own copy now (copy-on-write, done at the fork because the write
        follows in the next step anyway). Returns the (source, destination) pages to copy."""
        bs = self.spec.block_size
        blocks = self.req_to_blocks.get(parent_id, [])[: -(-num_tokens // bs)]
        full = num_tokens // bs
        child = list(blocks[:full])
        self.pool.touch(b for b in child if not b.is_null)
        copies = []
        if len(blocks) > full and blocks[full].is_null:
            child.append(blocks[full])
        elif len(blocks) > full:
            dst = self.pool.get_new_blocks(1)[0]
            copies.append((blocks[full], dst))
            child.append(dst)
        self.req_to_blocks[child_id] = child
        self.num_cached[child_id] = min(self.num_cached.get(parent_id, 0), full)
        return copies

    def free(self, request_id: str) -> None:
        # Tail first: when prefix caching keeps freed blocks, a prompt's last blocks are the
        # first evicted and its shared head survives longest.
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached.pop(request_id, None)
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
    pool. Their logical slots hold the null block so block indices stay positional. A
    prefix hit likewise only takes the cached blocks inside the window before the hit."""

    def needed_hit_range(self, num_blocks: int) -> range:
        first_needed = max(0, num_blocks * self.spec.block_size - self.spec.sliding_window + 1)
        return range(first_needed // self.spec.block_size, num_blocks)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        dead = min(int(self.spec.num_dead_blocks(num_computed_tokens)), len(blocks))
        freed = []
        for i in range(dead - 1, -1, -1):   # newest dead block first: older ones evict first later
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i] = self.pool.null_block
        if freed:
            self.pool.free_blocks(freed)


class CompressedEntryManager(SingleTypeKVCacheManager):
    """Compressed entries (`CompressedEntrySpec`): entry w lives in the block of the token
    that closes it, so the table stays in token coordinates. With a compress rate above the
    block size only every `block_stride`-th block holds entries; the others are the null
    block from the start, need no hash to count as a prefix hit (they hold nothing) and are
    never copied on a fork. All entry blocks are kept while the request runs."""

    def _new_slots(self, held: int, num_tokens: int) -> range:
        return range(held, -(-num_tokens // self.spec.block_size))

    def find_hit_blocks(self, hashes: list[bytes]) -> int:
        for j, h in enumerate(hashes):
            if self.spec.holds_entries(j) and self.pool.get_cached_block(self.group_id, h) is None:
                return j
        return len(hashes)

    def needed_hit_range(self, num_blocks: int) -> range:
        stride = self.spec.block_stride
        return range(stride - 1, num_blocks, stride)

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int) -> int:
        held = len(self.req_to_blocks.get(request_id, ()))
        return sum(1 for j in self._new_slots(held, num_tokens) if self.spec.holds_entries(j))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """The new table slots in order, null ones included: the runner appends them to the
        request's row, which must stay positional."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        holds = [self.spec.holds_entries(j) for j in self._new_slots(len(blocks), num_tokens)]
        new = iter(self.pool.get_new_blocks(sum(holds)))
        added = [next(new) if h else self.pool.null_block for h in holds]
        blocks.extend(added)
        return added


class StateManager(SingleTypeKVCacheManager):
    """A request's state takes `spec.pages` pages once, at admission, whatever its length;
    they are updated in place every step and freed with the request.

    Prefix caching keeps state checkpoints: copies of a request's state right after a
    block boundary (the last full block of its prompt), in pool pages published under that
    block's hash and evicted like any cached block. A hit at block k starts the request
    from a copy of checkpoint k. The copies themselves are tensor work: they are queued
    here as (src pages, dst pages) and run by the model runner, loads before the forward,
    saves after it."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int = 0):
        super().__init__(spec, pool, group_id)
        # Pending copies of this step, by request (dropped if the request is freed first).
        self.loads: dict[str, tuple[list[int], list[int]]] = {}
        self.saves: dict[str, tuple[list[int], list[int], bytes]] = {}
        self.pinned: list[KVCacheBlock] = []     # checkpoint pages in flight this step

    def _keys(self, block_hash: bytes) -> list[bytes]:
        return [block_hash + j.to_bytes(4, "little") for j in range(self.spec.pages)]

    def has_checkpoint(self, block_hash: bytes) -> bool:
        return all(self.pool.get_cached_block(self.group_id, k) is not None for k in self._keys(block_hash))

    def find_hit_blocks(self, hashes: list[bytes]) -> int:
        for k in range(len(hashes), 0, -1):
            if self.has_checkpoint(hashes[k - 1]):
                return k
        return 0

    def pin_checkpoint(self, block_hash: bytes) -> list[KVCacheBlock]:
        """Take the checkpoint's pages out of the free queue (pinned until the load has run),
        so that no allocation evicts them first; returns them."""
        src = [self.pool.get_cached_block(self.group_id, k) for k in self._keys(block_hash)]
        self.pool.touch(src)
        self.pinned.extend(src)
        return src

    def take_hits(self, request_id: str, hashes: list[bytes], num_blocks: int,
                  src: list[KVCacheBlock] | None = None) -> None:
        """Start the request from a copy of checkpoint `num_blocks`: its own new pages, loaded
        from `src` (the checkpoint's pages, pinned here unless `pin_checkpoint` did)."""
        src = src or self.pin_checkpoint(hashes[num_blocks - 1])
        dst = self.pool.get_new_blocks(self.spec.pages)
        self.req_to_blocks[request_id] = dst
        self.loads[request_id] = ([b.block_id for b in src], [b.block_id for b in dst])

    def plan_checkpoint(self, request_id: str, block_hash: bytes) -> bool:
        """Queue a save of the request's state (as of the end of this step) under
        `block_hash`, if there is room and no checkpoint exists yet."""
        state = self.req_to_blocks.get(request_id)
        if not state or request_id in self.saves or self.has_checkpoint(block_hash) \
                or self.pool.get_num_free_blocks() < self.spec.pages:
            return False
        dst = self.pool.get_new_blocks(self.spec.pages)
        self.pinned.extend(dst)
        self.saves[request_id] = ([b.block_id for b in state], [b.block_id for b in dst], block_hash)
        return True

    def finish_step(self) -> None:
        """After the runner copied: publish saved checkpoints, release every pin (the pages
        stay cached at ref_cnt 0 until evicted)."""
        for _, dst, block_hash in self.saves.values():
            for block_id, key in zip(dst, self._keys(block_hash)):
                self.pool.cache_block(self.pool.blocks[block_id], self.group_id, key)
        self.pool.free_blocks(self.pinned)
        self.loads, self.saves, self.pinned = {}, {}, []

    def cache_blocks(self, request_id: str, hashes: list[bytes], num_full_blocks: int) -> None:
        pass

    def num_fork_blocks(self, parent_id: str, num_tokens: int) -> int:
        return self.spec.pages if self.req_to_blocks.get(parent_id) else 0

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """A state is updated in place every step, so it is never shared: the child gets
        its own pages holding a copy of the parent's state as of the fork."""
        src = self.req_to_blocks.get(parent_id)
        if not src:
            return []
        dst = self.pool.get_new_blocks(self.spec.pages)
        self.req_to_blocks[child_id] = dst
        return list(zip(src, dst))

    def free(self, request_id: str) -> None:
        # A request freed before its copies ran (preempted, aborted) must not copy into or
        # out of pages that may be someone else's by then.
        self.loads.pop(request_id, None)
        self.saves.pop(request_id, None)
        super().free(request_id)


MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLASpec: FullAttentionManager,        # the latent of every token, all blocks kept
    SlidingWindowSpec: SlidingWindowManager,   # and SlidingRowsSpec (K=V rows, compressor source rows)
    CompressedEntrySpec: CompressedEntryManager,
    StateSpec: StateManager,
}


def manager_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager of the nearest registered class in the spec's MRO: a new spec that keeps
    every block (an MLA latent cache, a K-only cache) subclasses FullAttentionSpec, or one of
    its own registers here."""
    for cls in type(spec).__mro__:
        if cls in MANAGER_FOR_SPEC:
            return MANAGER_FOR_SPEC[cls]
    raise TypeError(f"no KV cache manager for {type(spec).__name__}; add it to cache.manager.MANAGER_FOR_SPEC")


class KVCacheManager:
    """Facade over the pool and one manager per KV cache group."""

    def __init__(self, config: KVCacheConfig, enable_caching: bool = True):
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.managers = [manager_for(g.spec)(g.spec, self.pool, gid)
                         for gid, g in enumerate(config.groups)]
        self.enable_caching = enable_caching
        self.state_managers = [m for m in self.managers if isinstance(m, StateManager)]
        self.prefix_cache_queries = 0      # tokens looked up (cumulative)
        self.prefix_cache_hits = 0         # tokens found (cumulative)
        # Fork copies for the runner, by child: [(group, src ids, dst ids)]. Their source
        # pages are pinned (one extra reference) until the step that copies them is over.
        self.fork_copies: dict[str, list[tuple[int, list[int], list[int]]]] = {}
        self._pins_pending: dict[str, list[KVCacheBlock]] = {}
        self._pins_in_flight: list[KVCacheBlock] = []
        self.num_forks = 0
        # Branch points (tokens) by request: where a state hybrid's prefix hit in the
        # attention groups outran the state checkpoints. The request saves a checkpoint
        # there, so the next prompt that shares this prefix hits all of it.
        self.branch_points: dict[str, int] = {}
        self.num_fork_copies = 0            # pages copied for forks (cumulative)
        self.on_free = None                 # KV tiers: called with each freed request id

    # ------------------------------------------------------------- prefix caching
    def reuse_prefix(self, request_id: str, hashes: list[bytes], num_tokens: int) -> int:
        """Give a new request the longest cached prefix that every group holds; returns the
        hit length in tokens. At least one token is always left to compute (its logits
        are needed), so a hit stops one token short of `num_tokens`."""
        if not self.enable_caching:
            return 0
        usable = hashes[: (num_tokens - 1) // self.block_size]
        kv_managers = [m for m in self.managers if not isinstance(m, StateManager)]
        hit = kv_hit = min((m.find_hit_blocks(usable) for m in kv_managers), default=len(usable))
        # State groups need a checkpoint exactly at the hit: the largest one at or below it.
        while hit and not all(m.has_checkpoint(usable[hit - 1]) for m in self.state_managers):
            hit -= 1
        if kv_managers and kv_hit > hit:
            self.branch_points[request_id] = kv_hit * self.block_size
        if hit and self.pool.get_num_free_blocks() < self._hit_cost(usable, hit, kv_managers):
            hit = 0          # no room for the request's own state pages: start uncached
        if hit:
            # Every cached block of the hit leaves the free queue before any group allocates
            # (a state group's new pages would otherwise evict another group's checkpoint).
            for m in kv_managers:
                m.take_hits(request_id, usable, hit)
            srcs = [m.pin_checkpoint(usable[hit - 1]) for m in self.state_managers]
            for m, src in zip(self.state_managers, srcs):
                m.take_hits(request_id, usable, hit, src)
        return hit * self.block_size

    def _hit_cost(self, hashes: list[bytes], hit: int, kv_managers) -> int:
        """Free blocks a hit of `hit` blocks takes: cached blocks it revives from the free
        queue (ref_cnt 0) and, for state groups, the request's own state pages."""
        pool, cost = self.pool, 0
        for m in kv_managers:
            cost += sum(pool.get_cached_block(m.group_id, hashes[i]).ref_cnt == 0 for i in m.needed_hit_range(hit))
        for m in self.state_managers:
            cost += m.spec.pages + sum(pool.get_cached_block(m.group_id, k).ref_cnt == 0
                                       for k in m._keys(hashes[hit - 1]))
        return cost

    def checkpoint_positions(self, request_id: str, num_prompt_tokens: int) -> tuple[int, ...]:
        """Where a prompt's state checkpoints go (token counts, each a block boundary): its
        branch point from the cached prefixes, if any, and its last block boundary before
        the final prompt token. The scheduler ends prefill chunks exactly there."""
        if not (self.enable_caching and self.state_managers):
            return ()
        last = (num_prompt_tokens - 1) // self.block_size * self.block_size
        branch = self.branch_points.get(request_id, 0)
        return (branch, last) if 0 < branch < last else (last,) if last else ()

    def plan_checkpoints(self, request_id: str, block_hash: bytes) -> None:
        for m in self.state_managers:
            m.plan_checkpoint(request_id, block_hash)

    def take_copies(self) -> tuple[list, list]:
        """Page copies for the runner as [(group, src ids, dst ids)]: (before the forward:
        state checkpoint loads, then fork copies; after it: state checkpoint saves)."""
        loads = [(m.group_id, src, dst) for m in self.state_managers for src, dst in m.loads.values()]
        for copies in self.fork_copies.values():
            loads.extend(copies)
        saves = [(m.group_id, src, dst) for m in self.state_managers for src, dst, _ in m.saves.values()]
        self.fork_copies = {}
        for pins in self._pins_pending.values():
            self._pins_in_flight.extend(pins)
        self._pins_pending = {}
        return loads, saves

    def finish_step(self) -> None:
        """After the runner ran the copies taken this step: release their pins."""
        for m in self.state_managers:
            m.finish_step()
        self.pool.free_blocks(self._pins_in_flight)
        self._pins_in_flight = []

    # ------------------------------------------------------------- forks
    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> bool:
        """Start `child_id` from the parent's first `num_computed_tokens` computed tokens in
        every group: full blocks shared (ref_cnt + 1), the partial block and state pages
        copied by the runner before the next forward. All or nothing: False, allocating
        nothing, when the pool cannot hold the copies (the child then computes from scratch)."""
        if num_computed_tokens == 0:
            return True
        need = sum(m.num_fork_blocks(parent_id, num_computed_tokens) for m in self.managers)
        if not self.can_fit(need):
            return False
        for m in self.managers:
            pairs = m.fork(parent_id, child_id, num_computed_tokens)
            if not pairs:
                continue
            src = [s for s, _ in pairs]
            self.pool.touch(src)
            self._pins_pending.setdefault(child_id, []).extend(src)
            self.fork_copies.setdefault(child_id, []).append(
                (m.group_id, [b.block_id for b in src], [d.block_id for _, d in pairs]))
            self.num_fork_copies += len(pairs)
        self.num_forks += 1
        return True

    def record_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += hit_tokens

    def cache_blocks(self, request_id: str, hashes: list[bytes], num_computed_tokens: int) -> None:
        if self.enable_caching:
            for m in self.managers:
                m.cache_blocks(request_id, hashes, num_computed_tokens // self.block_size)

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
        need = self.num_blocks_needed(request_id, num_tokens)
        if not need:   # the held blocks cover the tokens (most decode steps)
            return [[] for _ in self.managers]
        if not self.can_fit(need):
            return None
        return [[b.block_id for b in m.allocate_new_blocks(request_id, num_tokens)]
                for m in self.managers]

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.get_num_free_blocks()

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return sum(m.num_blocks_to_allocate(request_id, num_tokens) for m in self.managers)

    def free(self, request_id: str) -> None:
        if self.on_free is not None:
            self.on_free(request_id)
        self.branch_points.pop(request_id, None)
        # A fork freed before its copies ran: drop them (their destination pages go back to
        # the pool) and unpin their sources.
        self.fork_copies.pop(request_id, None)
        self.pool.free_blocks(self._pins_pending.pop(request_id, ()))
        for m in self.managers:
            m.free(request_id)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers]

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def usage(self) -> float:
        return self.pool.get_usage()

    def stats(self) -> dict:
        """Pool and per-group counters. Per group: its layers, kind, the blocks its requests
        hold and `page_use`, the share of each of its blocks' pool bytes its layers use (below
        1 where its pages are smaller than the pool page and pack with padding). Pool-wide
        `padding_bytes_in_use`: bytes of the blocks in use (held by a request) that no layer
        uses; cached blocks at ref_cnt 0 and state checkpoints are free for this count."""
        pool, cfg = self.pool, self.config
        per_group, padding = [], 0
        for gid, (g, m) in enumerate(zip(cfg.groups, self.managers)):
            blocks = sum(m.num_live_blocks(r) for r in m.req_to_blocks)
            pool_bytes, layer_bytes = cfg.page_use(gid)
            units = blocks // g.spec.pages if isinstance(g.spec, StateSpec) else blocks
            padding += units * (pool_bytes - layer_bytes)
            per_group.append({"group": gid, "layers": len(g.layer_ids), "kind": type(g.spec).__name__,
                              "blocks_in_use": blocks, "page_use": layer_bytes / pool_bytes})
        return {"num_blocks": pool.num_usable_blocks, "num_free_blocks": pool.get_num_free_blocks(),
                "block_size": self.block_size, "usage": pool.get_usage(), "groups": per_group,
                "padding_bytes_in_use": padding,
                "prefix_caching": self.enable_caching,
                "prefix_cache_queries": self.prefix_cache_queries, "prefix_cache_hits": self.prefix_cache_hits,
                "prefix_cache_hit_rate": self.prefix_cache_hits / max(1, self.prefix_cache_queries),
                "cached_blocks": len(pool.cached), "evictions": pool.num_evictions,
                "forks": self.num_forks, "fork_copied_blocks": self.num_fork_copies}
