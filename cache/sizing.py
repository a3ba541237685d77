"""KV sizing: how many blocks a byte budget (or an explicit count) buys for a layer layout."""
from __future__ import annotations

from cache.kv_cache_spec import KVCacheConfig, KVCacheGroup, KVCacheSpec


def group_layers(layer_specs: dict[int, KVCacheSpec]) -> list[KVCacheGroup]:
    """One group per distinct spec, layers in index order, groups in first-seen order."""
    groups: dict[KVCacheSpec, KVCacheGroup] = {}
    for layer_id in sorted(layer_specs):
        spec = layer_specs[layer_id]
        groups.setdefault(spec, KVCacheGroup(spec)).layer_ids.append(layer_id)
    return list(groups.values())


def make_kv_cache_config(layer_specs: dict[int, KVCacheSpec], block_size: int, *,
                         num_blocks: int | None = None, memory_bytes: int | None = None,
                         min_tokens: int = 0, max_num_seqs: int | None = None) -> KVCacheConfig:
    """Size the cache from `num_blocks` or from `memory_bytes`.

    One block id covers every layer of a group, so a block costs the sum of its layers'
    pages, and a request takes block ids in every group from the one pool. `min_tokens`
    (usually max_model_len) sets the floor: one request of that length in every group; less
    is a configuration error, said up front. A byte budget never buys more blocks than
    `max_num_seqs` such requests can use.
    """
    if not layer_specs:
        raise ValueError("model declares no KV cache layers")
    groups = group_layers(layer_specs)
    config = KVCacheConfig(num_blocks=0, block_size=block_size, groups=groups)
    if num_blocks is None and memory_bytes is None:
        raise ValueError("give num_kv_blocks or a KV memory budget")
    per_request = sum(g.spec.max_blocks_for(min_tokens) for g in groups)
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
