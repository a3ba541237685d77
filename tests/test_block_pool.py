"""BlockPool, its O(1) free queue, and the KVCacheManager facade over them."""
import pytest
import torch

torch.set_num_threads(1)

from cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock  # noqa: E402
from cache.kv_cache_spec import FullAttentionSpec  # noqa: E402
from cache.manager import KVCacheManager  # noqa: E402
from cache.sizing import make_kv_cache_config  # noqa: E402


def _blocks(n, start=0):
    return [KVCacheBlock(i) for i in range(start, start + n)]


def _manager(num_blocks, block_size=4, num_groups=1):
    # Distinct specs -> distinct KV cache groups sharing one pool.
    specs = {layer: FullAttentionSpec(block_size, 1 + layer, 8, torch.float32)
             for layer in range(num_groups)}
    return KVCacheManager(make_kv_cache_config(specs, block_size, num_blocks=num_blocks))


# ----------------------------------------------------------------- FreeKVCacheBlockQueue
def test_queue_initial_order_and_popleft_fifo():
    blocks = _blocks(5)
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert [q.popleft().block_id for _ in range(5)] == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 0
    assert q.block_ids() == []
    with pytest.raises(IndexError):
        q.popleft()
    # Popped blocks are fully unlinked.
    assert all(b.prev_free is None and b.next_free is None for b in blocks)
    assert not any(q.contains(b) for b in blocks)


def test_queue_remove_from_middle_head_and_tail():
    blocks = _blocks(6)
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[3])
    assert q.block_ids() == [0, 1, 2, 4, 5]
    assert q.num_free_blocks == 5
    assert not q.contains(blocks[3])
    q.remove(blocks[0])    # head
    q.remove(blocks[5])    # tail
    assert q.block_ids() == [1, 2, 4]
    assert q.num_free_blocks == 3
    assert q.popleft() is blocks[1]
    assert q.block_ids() == [2, 4]


def test_queue_append_goes_to_tail():
    blocks = _blocks(4)
    q = FreeKVCacheBlockQueue(blocks[:2])
    q.append(blocks[3])
    q.append(blocks[2])
    assert q.block_ids() == [0, 1, 3, 2]
    assert q.num_free_blocks == 4
    assert q.contains(blocks[2]) and q.contains(blocks[3])
    # Re-appending a removed block puts it at the tail.
    q.remove(blocks[0])
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 2, 0]
    assert [q.popleft().block_id for _ in range(4)] == [1, 3, 2, 0]


def test_queue_double_append_and_double_remove_raise():
    blocks = _blocks(3)
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[1])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[2])       # the tail block too
    q.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])
    # The failed calls changed nothing.
    assert q.block_ids() == [0, 2]
    assert q.num_free_blocks == 2
    outsider = KVCacheBlock(99)
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(outsider)
    assert q.num_free_blocks == 2


def test_queue_ops_touch_only_neighbours():
    """O(1): a removal relinks only the two neighbours, whatever the queue length."""
    blocks = _blocks(1000)
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[500])
    assert blocks[499].next_free is blocks[501]
    assert blocks[501].prev_free is blocks[499]
    assert q.num_free_blocks == 999
    q.append(blocks[500])
    assert blocks[999].next_free is blocks[500]
    assert blocks[500].prev_free is blocks[999]
    assert q.block_ids()[-2:] == [999, 500]


# ----------------------------------------------------------------- BlockPool
def test_pool_rejects_too_small():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)
    BlockPool(2)


def test_pool_null_block_pinned_and_never_handed_out():
    pool = BlockPool(6)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null and pool.null_block.ref_cnt == 1
    assert pool.num_usable_blocks == 5
    assert pool.get_num_free_blocks() == 5
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5]
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5]
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError, match="cannot get 1 blocks, only 0 free"):
        pool.get_new_blocks(1)
    # Freeing the null block is a no-op: it never enters the queue, its ref_cnt stays 1.
    pool.free_blocks([pool.null_block, pool.null_block])
    assert pool.null_block.ref_cnt == 1
    assert not pool.free_block_queue.contains(pool.null_block)
    assert pool.get_num_free_blocks() == 0


def test_get_new_blocks_sets_ref_cnt_and_clears_hash():
    pool = BlockPool(5)
    for b in pool.blocks[1:]:
        pool.cache_block(b, 0, b"stale-%d" % b.block_id)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)
    assert all(not pool.free_block_queue.contains(b) for b in got)
    assert pool.num_evictions == 3 and pool.get_cached_block(0, b"stale-1") is None
    # The block left in the queue keeps its hash (cached until reused).
    assert pool.blocks[4].block_hash == (0, b"stale-4")
    assert pool.get_cached_block(0, b"stale-4") is pool.blocks[4]
    assert pool.get_num_free_blocks() == 1
    assert pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 1


def test_get_new_blocks_too_many_takes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="cannot get 4 blocks, only 3 free"):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    assert pool.free_block_queue.block_ids() == [1, 2, 3]
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_free_blocks_appends_in_given_order():
    pool = BlockPool(7)
    a = pool.get_new_blocks(4)          # 1 2 3 4; queue: 5 6
    pool.free_blocks([a[2], a[0], a[3], a[1]])
    assert pool.free_block_queue.block_ids() == [5, 6, 3, 1, 4, 2]
    assert all(b.ref_cnt == 0 for b in a)
    # Reuse follows the queue: the never-used blocks first, then in free order.
    assert [b.block_id for b in pool.get_new_blocks(4)] == [5, 6, 3, 1]


def test_free_blocks_only_at_ref_cnt_zero():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    a.ref_cnt += 1                      # shared by a second owner
    pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and not pool.free_block_queue.contains(a)
    assert b.ref_cnt == 0 and pool.free_block_queue.contains(b)
    assert pool.free_block_queue.block_ids() == [3, 2]
    pool.free_blocks([a])
    assert a.ref_cnt == 0
    assert pool.free_block_queue.block_ids() == [3, 2, 1]


def test_double_free_raises():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])
    assert a.ref_cnt == 0
    assert pool.free_block_queue.block_ids() == [2, 1]
    # A never-allocated free block is a double free too.
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([pool.blocks[2]])
    assert pool.get_num_free_blocks() == 2


def test_usage_numbers():
    pool = BlockPool(5)                 # 4 usable
    assert pool.get_usage() == 0.0
    got = pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.25)
    got += pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
    pool.free_blocks(got[:2])
    assert pool.get_usage() == pytest.approx(0.5)
    assert pool.get_num_free_blocks() == 2


# ----------------------------------------------------------------- KVCacheManager
@pytest.mark.parametrize("num_tokens, blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2),
                                                (9, 3), (16, 4), (17, 5)])
def test_allocate_block_count_is_ceil(num_tokens, blocks):
    kv = _manager(num_blocks=10, block_size=4)
    ids = kv.allocate_slots("r", num_tokens)
    assert ids is not None and len(ids) == 1
    assert len(ids[0]) == blocks
    assert ids[0] == list(range(1, blocks + 1))
    assert kv.get_block_ids("r") == ids
    assert kv.num_free_blocks() == 9 - blocks


def test_allocate_is_incremental():
    kv = _manager(num_blocks=10, block_size=4)
    assert kv.allocate_slots("r", 3) == [[1]]
    assert kv.allocate_slots("r", 4) == [[]]          # still fits in block 1
    assert kv.allocate_slots("r", 2) == [[]]          # never shrinks
    assert kv.allocate_slots("r", 9) == [[2, 3]]
    assert kv.get_block_ids("r") == [[1, 2, 3]]
    assert kv.num_blocks_needed("r", 13) == 1
    assert kv.num_blocks_needed("r", 12) == 0
    assert kv.num_blocks_needed("other", 5) == 2


def test_allocate_all_or_nothing():
    kv = _manager(num_blocks=6, block_size=4)         # 5 usable
    assert kv.allocate_slots("a", 12) == [[1, 2, 3]]
    before_queue = kv.pool.free_block_queue.block_ids()
    assert kv.allocate_slots("b", 9) is None          # needs 3, 2 free
    assert kv.get_block_ids("b") == [[]]
    assert "b" not in kv.managers[0].req_to_blocks
    assert kv.allocate_slots("a", 21) is None         # needs 3 more, 2 free
    assert kv.get_block_ids("a") == [[1, 2, 3]]
    assert kv.pool.free_block_queue.block_ids() == before_queue
    assert kv.num_free_blocks() == 2
    assert kv.can_fit(2) and not kv.can_fit(3)
    assert kv.allocate_slots("b", 8) == [[4, 5]]      # exactly what is left
    assert kv.num_free_blocks() == 0


def test_allocate_all_or_nothing_across_groups():
    kv = _manager(num_blocks=8, block_size=4, num_groups=2)   # 7 usable, shared
    assert kv.num_groups == 2
    assert kv.allocate_slots("a", 8) == [[1, 2], [3, 4]]
    assert kv.num_blocks_needed("b", 8) == 4
    assert kv.allocate_slots("b", 8) is None                  # 4 needed, 3 free
    assert kv.get_block_ids("b") == [[], []]
    assert kv.num_free_blocks() == 3
    assert kv.allocate_slots("b", 4) == [[5], [6]]
    kv.free("a")
    assert kv.get_block_ids("a") == [[], []]
    # Group order, each group tail first.
    assert kv.pool.free_block_queue.block_ids() == [7, 2, 1, 4, 3]


def test_free_returns_every_block_tail_first():
    kv = _manager(num_blocks=9, block_size=4)         # 8 usable
    kv.allocate_slots("a", 10)                        # 1 2 3
    kv.allocate_slots("b", 5)                         # 4 5
    kv.allocate_slots("a", 13)                        # + 6 (a: 1 2 3 6)
    assert kv.get_block_ids("a") == [[1, 2, 3, 6]]
    assert kv.pool.free_block_queue.block_ids() == [7, 8]
    kv.free("a")
    # The last logical block enters the queue first, so it is evicted first.
    assert kv.pool.free_block_queue.block_ids() == [7, 8, 6, 3, 2, 1]
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in (1, 2, 3, 6))
    assert kv.num_free_blocks() == 6
    kv.free("b")
    assert kv.pool.free_block_queue.block_ids() == [7, 8, 6, 3, 2, 1, 5, 4]
    assert kv.num_free_blocks() == 8
    assert kv.usage() == 0.0
    kv.free("b")                                      # unknown / already freed: no-op
    kv.free("never")
    assert kv.num_free_blocks() == 8
    assert kv.managers[0].req_to_blocks == {}


def test_stats():
    kv = _manager(num_blocks=11, block_size=4, num_groups=2)  # 10 usable
    s = kv.stats()
    assert s == {"num_blocks": 10, "num_free_blocks": 10, "block_size": 4, "usage": 0.0,
                 "groups": [{"group": 0, "layers": 1, "kind": "FullAttentionSpec", "blocks_in_use": 0,
                             "page_use": 0.5},      # 1 kv head: half the 2-head group's page
                            {"group": 1, "layers": 1, "kind": "FullAttentionSpec", "blocks_in_use": 0,
                             "page_use": 1.0}],
                 "padding_bytes_in_use": 0, "prefix_caching": True, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                 "prefix_cache_hit_rate": 0.0, "cached_blocks": 0, "evictions": 0,
                 "forks": 0, "fork_copied_blocks": 0}
    kv.allocate_slots("a", 5)    # 2 per group
    kv.allocate_slots("b", 1)    # 1 per group
    s = kv.stats()
    assert s["num_free_blocks"] == 4
    assert s["usage"] == pytest.approx(0.6)
    assert [g["blocks_in_use"] for g in s["groups"]] == [3, 3]
    # group 0's pages (1 kv head: 2 * 4 * 1 * 8 * 4 B) fill half of its 3 blocks' 512 B pool pages
    assert s["padding_bytes_in_use"] == 3 * (512 - 2 * 4 * 1 * 8 * 4)
    kv.free("a")
    s = kv.stats()
    assert s["num_free_blocks"] == 8
    assert s["usage"] == pytest.approx(0.2)
    assert [g["blocks_in_use"] for g in s["groups"]] == [1, 1]


def test_make_kv_cache_config_enforces_max_model_len():
    specs = {0: FullAttentionSpec(4, 1, 8, torch.float32)}
    make_kv_cache_config(specs, 4, num_blocks=17, min_tokens=64)      # 16 + null
    with pytest.raises(ValueError, match="cannot hold one request of 64 tokens"):
        make_kv_cache_config(specs, 4, num_blocks=16, min_tokens=64)
    cfg = make_kv_cache_config(specs, 4, memory_bytes=10 * specs[0].page_size_bytes + 5)
    assert cfg.num_blocks == 10
    # A budget buys no more than max_num_seqs full-length requests can use (+ the null block).
    cfg = make_kv_cache_config(specs, 4, memory_bytes=100 * specs[0].page_size_bytes,
                               min_tokens=8, max_num_seqs=3)
    assert cfg.num_blocks == 3 * 2 + 1


def test_state_hit_pins_every_checkpoint_before_allocating():
    """A hit in two state groups: the first group's new state pages must not evict the second
    group's checkpoint (both sit at the head of the free queue, the pool has room for exactly
    the hit's cost). Each group then loads its own checkpoint."""
    from cache.kv_cache_spec import StateSpec
    specs = {0: FullAttentionSpec(4, 1, 8, torch.float32),                  # 256-byte pages
             1: StateSpec(4, shapes=(("s", (128,)),)), 2: StateSpec(4, shapes=(("s", (96,)),))}
    kv = KVCacheManager(make_kv_cache_config(specs, 4, num_blocks=11))      # null + 2 + 2 * (2 + 2)
    states = kv.state_managers
    assert [m.spec.pages for m in states] == [2, 2] and kv.num_free_blocks() == 10
    hashes = [b"h0", b"h1"]
    assert kv.allocate_slots("a", 8) is not None
    assert all(m.plan_checkpoint("a", hashes[0]) for m in states)
    checkpoints = [kv.pool.blocks[i] for m in states for i in m.saves["a"][1]]
    kv.take_copies()
    kv.finish_step()
    kv.cache_blocks("a", hashes, 8)
    kv.free("a")
    assert kv.num_free_blocks() == 10
    assert kv.reuse_prefix("b", hashes[:1], 6) == 4
    loads, _ = kv.take_copies()
    assert sorted(i for _, src, _ in loads for i in src) == sorted(b.block_id for b in checkpoints)
