"""KV sizing: how many blocks a byte budget (or an explicit count) buys for a layer layout."""
from __future__ import annotations

from cache.kv_cache_spec import KVCacheConfig, KVCacheSpec
from cache.pool_layout import check_layout, plan_pool_layout


def make_kv_cache_config(layer_specs: dict[int, KVCacheSpec], block_size: int, *,
                         num_blocks: int | None = None, memory_bytes: int | None = None,
                         min_tokens: int = 0, max_num_seqs: int | None = None,
                         chunk_tokens: int | None = None, pack: bool = True) -> KVCacheConfig:
    """Size the cache from `num_blocks` or from `memory_bytes`.

    A block id covers a group's layers in every shared buffer (several per buffer where the
    group's pages are small enough to pack, cache/pool_layout.py), so a block costs the pool
    page times the number of buffers, and a request takes block ids in every group from the
    one pool. `pack=False`: one layer per pool page (small pages padded), for comparisons.
    `min_tokens` (usually max_model_len) sets the floor: one request of that length in every
    group; less is a configuration error, said up front. A byte budget
    never buys more blocks than `max_num_seqs` such requests can use. `chunk_tokens` (the
    scheduler's token budget) bounds what a window-limited group holds at once.
    """
    if not layer_specs:
        raise ValueError("model declares no KV cache layers")
    if num_blocks is None and memory_bytes is None:
        raise ValueError("give num_kv_blocks or a KV memory budget")
    layout = plan_pool_layout(layer_specs, pack)
    config = KVCacheConfig(num_blocks=0, block_size=block_size, groups=layout.groups,
                           page_size_bytes=layout.page_size_bytes, num_buffers=layout.num_buffers)
    check_layout(config)
    per_request = sum(g.spec.max_live_blocks(min_tokens, chunk_tokens) for g in config.groups)
    if num_blocks is None:
        num_blocks = memory_bytes // config.bytes_per_block
        if max_num_seqs is not None:
            num_blocks = min(num_blocks, max_num_seqs * per_request + 1)
    # +1: block 0 is the null block and holds nothing.
    need = per_request + 1
    if num_blocks < max(need, 2):
        raise ValueError(
            f"KV cache of {num_blocks} blocks x {block_size} tokens cannot hold one request of "
            f"{min_tokens} tokens (needs {need} blocks incl. the null block); raise num_kv_blocks "
            f"/ kv_cache_memory or lower max_model_len")
    config.num_blocks = int(num_blocks)
    return config


def requests_that_fit(config: KVCacheConfig, num_tokens: int, chunk_tokens: int | None = None) -> int:
    """How many requests of `num_tokens` tokens the pool holds at once, every group counted:
    window-limited groups only their window (plus a prefill chunk), state groups one state."""
    per_request = sum(g.spec.max_live_blocks(num_tokens, chunk_tokens) for g in config.groups)
    return (config.num_blocks - 1) // per_request
