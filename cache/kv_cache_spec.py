"""What one layer needs per block, and how layers group into KV cache groups.

Layers with equal specs share one block table per request (a KV cache group). All groups
draw from one pool of equal-size pages: a group's layer j keeps its page b in shared buffer
j, so a block id belongs to one group at a time and memory flows to whichever layer kind
needs it (the buffers are sized by the largest page; smaller pages are padded).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_blocks_for(self, num_tokens: int) -> int:
        """Logical blocks a request of `num_tokens` tokens spans."""
        return -(-num_tokens // self.block_size)

    def max_live_blocks(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """Blocks a request of `num_tokens` tokens holds at most at once, when it computes
        at most `chunk_tokens` tokens per step (None: all at once)."""
        return self.max_blocks_for(num_tokens)


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block for one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over every earlier token: one block per `block_size` tokens, all kept."""


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Each token attends to the last `sliding_window` positions (itself included): blocks
    wholly older than that go back to the pool while the request runs."""
    sliding_window: int = 0

    def num_dead_blocks(self, num_computed_tokens):
        """Leading blocks no query still to come can see: with every future query at position
        >= p (p = computed tokens), keys before p - W + 1 are dead. Works on ints and numpy
        arrays; the cache manager frees by it and the runner nulls table slots by it."""
        return np.maximum(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size

    def max_live_blocks(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        # A decode needs positions (p - W, p]: at most ceil((W-1)/B) + 1 blocks; a chunk of
        # C new tokens needs its own blocks on top (one more if it straddles a boundary).
        window = -(-(self.sliding_window - 1) // self.block_size) + 1
        chunk = num_tokens if chunk_tokens is None else chunk_tokens
        return min(self.max_blocks_for(num_tokens), window + self.max_blocks_for(chunk))


@dataclass(frozen=True, slots=True)
class StateSpec(KVCacheSpec):
    """A fixed-size state per request (Mamba2, Gated DeltaNet), not per token: tensors of
    `shapes` (name, per-request shape) in `dtype`. It is stored in ordinary pool pages, as
    many as it takes (`pages`), so state and KV blocks share one pool at 16-token
    granularity instead of inflating attention blocks to the state's size."""
    shapes: tuple = ()
    dtype: torch.dtype = torch.float32
    pool_page_bytes: int = 0          # set by sizing to the pool's page size

    @property
    def state_bytes(self) -> int:
        return sum(math.prod(shape) for _, shape in self.shapes) * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.pool_page_bytes

    @property
    def pages(self) -> int:
        return -(-self.state_bytes // self.pool_page_bytes)

    def max_blocks_for(self, num_tokens: int) -> int:
        return self.pages


@dataclass(slots=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVCacheConfig:
    """The cache layout the runtime allocates.

    `num_buffers` buffers of `num_blocks` pages of `page_size_bytes` each; layer j of every
    group (j < num_buffers) lives in buffer j. Every group has exactly `num_buffers` layers.
    """
    num_blocks: int
    block_size: int
    groups: list[KVCacheGroup]
    page_size_bytes: int = 0
    num_buffers: int = 0

    @property
    def bytes_per_block(self) -> int:
        return self.page_size_bytes * self.num_buffers

    def layer_to_group(self) -> dict[int, int]:
        return {layer: gid for gid, g in enumerate(self.groups) for layer in g.layer_ids}

    def layer_to_buffer(self) -> dict[int, int]:
        return {layer: j for g in self.groups for j, layer in enumerate(g.layer_ids)}


def group_layers(layer_specs: dict[int, KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers by spec, then split every group into groups of the same size (the gcd
    of the per-spec layer counts), so that each can map its layers 1:1 onto the shared
    buffers. Gemma 3's 15 sliding + 3 full layers become 6 groups of 3."""
    # States live in pool pages: give them the pool's page size (the largest KV page, or the
    # state itself when no layer has KV) so they know how many pages they take.
    kv_pages = [s.page_size_bytes for s in layer_specs.values() if not isinstance(s, StateSpec)]
    page = max(kv_pages) if kv_pages else max(s.state_bytes for s in layer_specs.values())
    layer_specs = {i: dataclasses.replace(s, pool_page_bytes=page) if isinstance(s, StateSpec) else s
                   for i, s in layer_specs.items()}
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer_id in sorted(layer_specs):
        by_spec.setdefault(layer_specs[layer_id], []).append(layer_id)
    size = math.gcd(*(len(ids) for ids in by_spec.values()))
    return [KVCacheGroup(spec, ids[i: i + size]) for spec, ids in by_spec.items()
            for i in range(0, len(ids), size)]


@dataclass(frozen=True, slots=True)
class MLASpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi): per token only the compressed
    latent (`kv_lora_rank`, after its norm) and the shared roped key part (`rope_dim`), one
    `[kv_lora_rank + rope_dim]` row for all heads; keys and values are never expanded in the
    cache. Retention and prefix caching are those of full attention (all blocks kept)."""
    kv_lora_rank: int = 0
    rope_dim: int = 0
    dtype: torch.dtype = torch.float32

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.entry_dim * self.dtype.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int]:
        """The layer's view of its pool buffer: `[num_blocks, block_size, latent | k_pe]`."""
        return (num_blocks, self.block_size, self.entry_dim)
