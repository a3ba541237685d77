"""Which layers share which pool pages: KV cache groups whose pages differ in bytes, one pool.

Every group keeps the engine's block size (16 tokens), so prefix-cache hashes have the same
granularity in every group, and every group draws block ids from the one BlockPool. What
varies is how many of a group's layers one block id covers:

- the pool page `P` is a small multiple `m` of the largest KV page (m = 1 unless a larger
  page packs the smaller pages with less padding, see `plan_pool_layout`);
- a KV group whose page is `p` packs `k = P // p` of its layers into each of the
  `num_buffers` (N) shared buffers: layer j of the group lives in buffer `j % N` at byte
  offset `(j // N) * p`, so one block id holds up to `N * k` of its layers; the rest of the
  page (`P - k * p` per buffer) is padding;
- a state group (StateSpec) takes `spec.pages` whole pool pages per request, one layer per
  buffer (its `pool_page_bytes` is set to `P` here).

vLLM instead raises the block size of the smaller kind until pages match, which coarsens
prefix caching for that kind; here only the number of layers per group changes.

Choosing N and m: a block of a group costs `N * P` bytes whatever it holds, so the KV bytes
per 16 tokens of a layout are `N * P * (number of KV groups)`. `plan_pool_layout` tries
every N up to the largest layer count and m = 1..4 and takes the layout with the fewest KV
bytes, then the fewest state bytes per request, then the fewest groups (fewer block tables
and attention plans per step), then the smaller pool page. With equal pages everywhere this
is exactly the old rule: N = gcd of the per-spec layer counts (Gemma 3's 15 sliding + 3 full
layers: 6 groups of 3). A group may hold fewer layers than it could (the last group of a
spec whose layer count does not fill whole groups): its unused slots are padding, counted
in the cost, so a layout with them is only chosen when it is cheaper than the alternatives.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cache.kv_cache_spec import KVCacheConfig, KVCacheGroup, KVCacheSpec, StateSpec

MAX_PAGE_MULTIPLE = 4    # pool page candidates: 1..4 times the largest KV page


@dataclass(frozen=True, slots=True)
class PoolLayout:
    groups: list[KVCacheGroup]
    page_size_bytes: int      # the pool page P
    num_buffers: int          # N


def _cost(kv: dict[KVCacheSpec, int], states: dict[StateSpec, int], page: int, n: int, pack: bool) -> tuple:
    """(KV bytes per block-token of all KV groups, state bytes per request, number of groups)
    of the layout with pool page `page` and `n` buffers."""
    kv_groups = sum(-(-count // (n * (page // s.page_size_bytes if pack else 1))) for s, count in kv.items())
    state_groups = [(-(-count // n), -(-s.state_bytes // page)) for s, count in states.items()]
    state_bytes = sum(g * pages for g, pages in state_groups) * n * page
    return kv_groups * n * page, state_bytes, kv_groups + sum(g for g, _ in state_groups)


def plan_pool_layout(layer_specs: dict[int, KVCacheSpec], pack: bool = True) -> PoolLayout:
    """Group layers by spec and place every group on the shared buffers (module docstring).

    `pack=False` gives each layer a whole pool page of its own (small pages padded to the
    largest): the plain "pad the smaller" layout, kept as a reference for tests and
    `bench.memory`."""
    if not layer_specs:
        raise ValueError("model declares no KV cache layers")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer_id in sorted(layer_specs):
        by_spec.setdefault(layer_specs[layer_id], []).append(layer_id)
    kv = {s: len(ids) for s, ids in by_spec.items() if not isinstance(s, StateSpec)}
    states = {s: len(ids) for s, ids in by_spec.items() if isinstance(s, StateSpec)}
    # States live in pool pages: with no KV layer the pool page is the largest state.
    base = max(s.page_size_bytes for s in kv) if kv else max(s.state_bytes for s in states)
    multiples = range(1, MAX_PAGE_MULTIPLE + 1) if pack and len({s.page_size_bytes for s in kv}) > 1 else (1,)
    max_count = max(len(ids) for ids in by_spec.values())
    best = min((*_cost(kv, states, m * base, n, pack), m, -n) for m in multiples for n in range(1, max_count + 1))
    page, n = best[3] * base, -best[4]
    groups = []
    for spec, ids in by_spec.items():
        if isinstance(spec, StateSpec):
            spec, size = dataclasses.replace(spec, pool_page_bytes=page), n
        else:
            size = n * (page // spec.page_size_bytes if pack else 1)
        groups.extend(KVCacheGroup(spec, ids[i: i + size]) for i in range(0, len(ids), size))
    return PoolLayout(groups, page, n)


def group_layers(layer_specs: dict[int, KVCacheSpec], pack: bool = True) -> list[KVCacheGroup]:
    """The KV cache groups of `plan_pool_layout` (state specs given the pool's page size)."""
    return plan_pool_layout(layer_specs, pack).groups


def check_layout(config: KVCacheConfig) -> None:
    """Raise ValueError unless every group maps its layers onto the shared buffers exactly:
    no two layers share bytes, every layer's page lies inside the pool page, offsets are
    aligned to the dtype, and state groups fit one layer per buffer in pool-sized pages."""
    P, n = config.page_size_bytes, config.num_buffers
    for gid, g in enumerate(config.groups):
        s, count = g.spec, len(g.layer_ids)
        if isinstance(s, StateSpec):
            ok = count <= n and s.pool_page_bytes == P
        else:
            k = P // s.page_size_bytes
            ok = 0 < count <= n * k and s.page_size_bytes % s.dtype.itemsize == 0
        if not ok:
            raise ValueError(f"KV cache group {gid} ({type(s).__name__}, {count} layers, page "
                             f"{s.page_size_bytes} B) does not fit {n} buffers of {P}-byte pool pages")
    slots = config.layer_slots()
    if len(slots) != sum(len(g.layer_ids) for g in config.groups):
        raise ValueError("a layer is in two KV cache groups")


def padding_fraction(config: KVCacheConfig, num_tokens: int, chunk_tokens: int | None = None) -> float:
    """Share of the pool bytes that requests of `num_tokens` tokens take which no layer uses
    (padding inside pool pages: unpacked remainders, unused slots of partial groups, the
    tail of a state's last page). Partially filled blocks (fewer than 16 tokens written)
    are not padding: they fill as the request grows."""
    alloc = used = 0
    for gid, g in enumerate(config.groups):
        pool_bytes, layer_bytes = config.page_use(gid)
        units = 1 if isinstance(g.spec, StateSpec) else g.spec.max_live_blocks(num_tokens, chunk_tokens)
        alloc += units * pool_bytes
        used += units * layer_bytes
    return 1.0 - used / alloc if alloc else 0.0


def pool_bytes_per_token(config: KVCacheConfig) -> float:
    """Pool bytes one token of context takes in all KV (non-state) groups, whole blocks: what
    each group's block costs over the tokens it covers (16; more for groups that allocate
    only some blocks, `tokens_per_block`)."""
    kv = [g for g in config.groups if not isinstance(g.spec, StateSpec)]
    return sum(config.bytes_per_block / g.spec.tokens_per_block for g in kv)


__all__ = ["MAX_PAGE_MULTIPLE", "PoolLayout", "check_layout", "group_layers", "padding_fraction",
           "plan_pool_layout", "pool_bytes_per_token"]
