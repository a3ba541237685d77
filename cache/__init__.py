"""Paged KV cache: blocks, the pool, per-kind managers and sizing (the block tables the
model reads are the worker's: runtime/worker/block_table.py).

Imports neither `models` nor `runtime`: layers describe what they need with the spec types
here, and the runtime drives the manager.
"""
from cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from cache.kv_cache_spec import (FullAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheSpec,
                                 SlidingWindowSpec, StateSpec)
from cache.manager import KVCacheManager
from cache.sizing import make_kv_cache_config

__all__ = [
    "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock",
    "FullAttentionSpec", "SlidingWindowSpec", "StateSpec", "KVCacheConfig", "KVCacheGroup", "KVCacheSpec", "KVCacheManager",
    "make_kv_cache_config",
]
