"""What one layer needs per block, and how layers group into KV cache groups.

Layers with equal specs share one block table per request (a KV cache group). Today every
group is full attention; sliding-window and state specs join in the hybrid issue and reuse
the same pool, which is why a group is described by its spec and not by its layer type.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block for one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def max_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    """Causal attention over every earlier token: one block per `block_size` tokens, all kept."""


@dataclass(slots=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVCacheConfig:
    """The cache layout the runtime allocates: `num_blocks` pages per layer, in groups."""
    num_blocks: int
    block_size: int
    groups: list[KVCacheGroup]

    @property
    def bytes_per_block(self) -> int:
        return sum(g.spec.page_size_bytes * len(g.layer_ids) for g in self.groups)

    def layer_to_group(self) -> dict[int, int]:
        return {layer: gid for gid, g in enumerate(self.groups) for layer in g.layer_ids}
