"""DeepSeek-V4's compressed attention caches: entry placement in token coordinates, the
CompressedEntryManager (null blocks between HCA entries, hit ranges, forks, freeing) beside
the sliding row groups, and the per-step plans that pair new entries with their sources."""
import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from attention.backend import BatchLayout  # noqa: E402
from attention.compressed_plan import EntryPlan, RowsPlan, new_entries  # noqa: E402
from cache.kv_cache_spec import CompressedEntrySpec, SlidingRowsSpec  # noqa: E402
from cache.manager import CompressedEntryManager, KVCacheManager, SlidingWindowManager, manager_for  # noqa: E402
from cache.sizing import make_kv_cache_config  # noqa: E402

B = 16


def _hashes(n):
    return [bytes([i + 1]) * 8 for i in range(n)]


def test_entry_placement_in_token_coordinates():
    csa, hca32, hca128 = (CompressedEntrySpec(B, m, 8, torch.float32) for m in (4, 32, 128))
    assert (csa.entries_per_page, csa.block_stride) == (4, 1)
    assert (hca32.entries_per_page, hca32.block_stride) == (1, 2)
    assert (hca128.entries_per_page, hca128.block_stride) == (1, 8)
    # entry w lives in the block of token (w+1)*m - 1, at slot w % entries_per_page
    for spec in (csa, hca32, hca128):
        m = spec.compress_rate
        places = [(((w + 1) * m - 1) // B, w % spec.entries_per_page) for w in range(20)]
        assert all(spec.holds_entries(block) for block, _ in places)
        assert len(set(places)) == 20 and places == sorted(places)      # one slot each, in order
    assert [j for j in range(24) if hca128.holds_entries(j)] == [7, 15, 23]
    assert hca128.max_blocks_for(128) == 1 and hca128.max_blocks_for(112) == 0 and hca128.max_blocks_for(300) == 2
    assert hca128.page_size_bytes == 8 * 4 and csa.page_size_bytes == 4 * 8 * 4
    with pytest.raises(ValueError, match="compress rate 6"):
        CompressedEntrySpec(B, 6, 8, torch.float32).check()
    assert manager_for(hca32) is CompressedEntryManager
    assert manager_for(SlidingRowsSpec(B, 1, 8, torch.float32, 8, compress_rate=4, overlap=True)) \
        is SlidingWindowManager


def _mgr(num_blocks=64):
    specs = {0: CompressedEntrySpec(B, 32, 8, torch.float32),                      # HCA-like, m > B
             1: SlidingRowsSpec(B, 1, 16, torch.float32, 32, compress_rate=32),      # its source rows
             2: CompressedEntrySpec(B, 4, 8, torch.float32)}                         # CSA-like, m < B
    return KVCacheManager(make_kv_cache_config(specs, B, num_blocks=num_blocks))


def _group(mgr, spec_type, m):
    return next(gid for gid, g in enumerate(mgr.config.groups)
                if isinstance(g.spec, spec_type) and g.spec.compress_rate == m)


def test_entry_manager_allocates_only_entry_blocks_and_frees_all():
    mgr = _mgr()
    hca, csa, rows = _group(mgr, CompressedEntrySpec, 32), _group(mgr, CompressedEntrySpec, 4), \
        _group(mgr, SlidingRowsSpec, 32)
    free0 = mgr.num_free_blocks()
    assert mgr.num_blocks_needed("a", 70) == 2 + 5 + 5        # HCA blocks 1, 3; CSA 5; rows 5
    new = mgr.allocate_slots("a", 70)
    assert new[hca][0::2] == [0, 0, 0] and all(new[hca][1::2]) and len(new[csa]) == 5   # positional
    table = mgr.get_block_ids("a")[hca]
    assert [b == 0 for b in table] == [True, False, True, False, True]
    assert mgr.managers[hca].num_live_blocks("a") == 2
    # growing to 100 tokens: blocks 5 (entry) and 6 (null)
    assert mgr.num_blocks_needed("a", 100) == 1 + 2 + 2
    mgr.allocate_slots("a", 100, 70)
    assert [b == 0 for b in mgr.get_block_ids("a")[hca]] == [True, False, True, False, True, False, True]
    # the rows group is a sliding window of 32: computing from 64 frees blocks 0, 1 (keys < 33 dead)
    mgr.allocate_slots("a", 100, 64)
    assert mgr.get_block_ids("a")[rows][:2] == [0, 0] and mgr.get_block_ids("a")[rows][2] != 0
    mgr.free("a")
    assert mgr.num_free_blocks() == free0


def test_entry_hits_need_only_entry_blocks_and_forks_skip_null_partials():
    mgr = _mgr()
    hca, csa = _group(mgr, CompressedEntrySpec, 32), _group(mgr, CompressedEntrySpec, 4)
    hashes = _hashes(6)
    mgr.allocate_slots("a", 96)
    mgr.cache_blocks("a", hashes, 96)
    ids_a = mgr.get_block_ids("a")
    m = mgr.managers[hca]
    assert m.find_hit_blocks(hashes) == 6
    assert list(m.needed_hit_range(5)) == [1, 3]
    mgr.free("a")
    hit = mgr.reuse_prefix("b", hashes, 97)         # 96 tokens cached, one left to compute
    assert hit == 96
    ids_b = mgr.get_block_ids("b")
    assert ids_b[hca] == ids_a[hca] and ids_b[csa] == ids_a[csa]
    # an evicted entry block ends the hit at its block; null blocks never do: with every
    # block evicted the first block still "hits" (it holds no HCA entry)
    mgr.free("b")
    mgr.pool.get_new_blocks(mgr.num_free_blocks())
    assert m.find_hit_blocks(hashes) == 1 and mgr.managers[csa].find_hit_blocks(hashes) == 0
    # forks: a fork at 40 tokens (block 2, a null HCA block) copies the CSA partial block only
    mgr2 = _mgr()
    hca2, csa2 = _group(mgr2, CompressedEntrySpec, 32), _group(mgr2, CompressedEntrySpec, 4)
    free0 = mgr2.num_free_blocks()
    mgr2.allocate_slots("p", 40)
    assert mgr2.managers[hca2].num_fork_blocks("p", 40) == 0
    assert mgr2.managers[csa2].num_fork_blocks("p", 40) == 1
    assert mgr2.fork("p", "c", 40)
    child = mgr2.get_block_ids("c")
    assert child[hca2] == mgr2.get_block_ids("p")[hca2]               # [null, shared, null]
    assert child[csa2][:2] == mgr2.get_block_ids("p")[csa2][:2] and child[csa2][2] != mgr2.get_block_ids("p")[csa2][2]
    loads, _ = mgr2.take_copies()
    assert sorted(g for g, _, _ in loads) == sorted({csa2, _group(mgr2, SlidingRowsSpec, 32)})
    mgr2.finish_step()
    mgr2.free("c")
    mgr2.free("p")
    assert mgr2.num_free_blocks() == free0          # no block leaked


def _layout(q_lens, seq_lens, width=8):
    q_lens, seq_lens = np.array(q_lens), np.array(seq_lens)
    n = len(q_lens)
    table = torch.arange(1, n * width + 1, dtype=torch.int32).view(n, width)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    pos = np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
    req = np.repeat(np.arange(n), q_lens)
    slots = table.numpy()[req, pos // B].astype(np.int64) * B + pos % B
    return BatchLayout(qsl, seq_lens, table, torch.from_numpy(slots), B)


def test_plans_pair_new_entries_with_their_source_rows():
    # request 0 decodes position 11 (closes CSA entry 2), request 1 computes positions 5..22
    layout = _layout([1, 18], [12, 23])
    req, w = new_entries(layout, 4)
    assert req.tolist() == [0, 1, 1, 1, 1] and w.tolist() == [2, 1, 2, 3, 4]
    rows = RowsPlan.build(layout, 4, True, torch.device("cpu"))
    assert rows.num_new == 5 and rows.entry_pos.tolist() == [8, 4, 8, 12, 16]
    # entry 1 of request 1 pools positions 0..7 (windows 0 and 1): block 0 of its table (id 9)
    assert rows.src_block[1].tolist() == [9] * 8 and rows.src_offset[1].tolist() == list(range(8))
    assert rows.src_valid.all()
    entries = EntryPlan.build(layout, 4, 4, 1, torch.device("cpu"))
    # entry w of a request in its table's block ((w+1)*4-1)//16, slot w % 4
    assert entries.dst_block.tolist() == [1, 9, 9, 9, 10] and entries.dst_slot.tolist() == [2, 1, 2, 3, 0]
    decode, prefill = entries.parts
    assert decode.visible(0, 1).shape == (1, 1, 4) and decode.visible(0, 1)[0, 0].tolist() == [True] * 3 + [False]
    # query at position 5 sees entry 0 ((5+1)//4 = 1), position 22 sees entries 0..4
    visible = prefill.visible(0, 18)
    assert visible[0, 0].sum() == 1 and visible[0, 17].sum() == 5
    first = RowsPlan.build(_layout([5], [5]), 4, True, torch.device("cpu"))
    assert first.src_valid[0].tolist() == [False] * 4 + [True] * 4       # entry 0 has no Ca half
