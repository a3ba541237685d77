"""What one layer needs per block, and the cache layout the runtime allocates.

Layers with equal specs share one block table per request (a KV cache group). All groups
draw from one pool of equal-size pool pages in `num_buffers` shared buffers, so a block id
belongs to one group at a time and memory flows to whichever layer kind needs it. The pool
page is at least the largest page; a group whose pages are smaller packs several of its
layers into one pool page (cache/pool_layout.py decides the grouping and packing).
"""
from __future__ import annotations

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

    @property
    def tokens_per_block(self) -> int:
        """Tokens of context one allocated block covers (more than `block_size` where only
        some blocks are allocated: compressed entries with a rate above the block size)."""
        return self.block_size

    def max_live_blocks(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """Blocks a request of `num_tokens` tokens holds at most at once, when it computes
        at most `chunk_tokens` tokens per step (None: all at once)."""
        return self.max_blocks_for(num_tokens)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """How a layer of this spec sees its pages: `num_blocks` first, then one page of
        `page_size_bytes // dtype.itemsize` elements in the spec's `dtype` (every KV spec has
        a `dtype` field). The runner views each layer's slice of the shared buffers in this
        shape, so a new KV spec plugs in by defining `page_size_bytes`, `dtype` and this;
        the block stride of that view may exceed the page (packed pool pages)."""
        raise NotImplementedError(f"{type(self).__name__} must define cache_shape(num_blocks)")

    def view_bytes(self) -> int:
        """Leading bytes of the page that `cache_shape` views (the rest: int8 scales)."""
        return self.page_size_bytes


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def data_bytes(self) -> int:
        """Bytes of one block's K and V elements (the `cache_shape` view)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block for one layer: K and V, and for int8 pages their float32 scales
        (`[2, block_size, num_kv_heads]`, one per token and kv head) right after the data,
        aligned to 4 bytes (cache/kv_dtype.py, attention/kv_quant.py)."""
        if self.dtype != torch.int8:
            return self.data_bytes
        return self.scales_offset + 2 * self.block_size * self.num_kv_heads * 4

    @property
    def scales_offset(self) -> int:
        """Byte offset of an int8 page's scales inside the page."""
        return -(-self.data_bytes // 4) * 4

    def view_bytes(self) -> int:
        return self.data_bytes if self.dtype == torch.int8 else self.page_size_bytes

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Block-major, K page then V page, token-major inside: every attention backend's
        layout (FlashInfer's "NHD" single-tensor cache). Int8 pages are viewed without their
        scales: the block stride then exceeds the data, as for packed pages."""
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)


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

    `num_buffers` buffers of `num_blocks` pool pages of `page_size_bytes` each; block id b is
    page b of every buffer and belongs to one group at a time. Layer j of a group sits in
    buffer `j % num_buffers` at byte offset `(j // num_buffers) * spec.page_size_bytes` of the
    pool page (`group_slots`): a group of pages at most half the pool page packs several of
    its layers into each buffer, the rest of the page is padding (`page_use`). State groups
    take whole pool pages (`spec.pages` per request), one layer per buffer.
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

    def group_slots(self, group: KVCacheGroup) -> list[tuple[int, int]]:
        """(buffer, byte offset in the pool page) of each of the group's layers, in order."""
        n, page = self.num_buffers, group.spec.page_size_bytes
        return [(j % n, (j // n) * page) for j in range(len(group.layer_ids))]

    def layer_slots(self) -> dict[int, tuple[int, int]]:
        """layer -> (buffer, byte offset in the pool page)."""
        return {layer: slot for g in self.groups for layer, slot in zip(g.layer_ids, self.group_slots(g))}

    def layer_to_buffer(self) -> dict[int, int]:
        return {layer: buf for layer, (buf, _) in self.layer_slots().items()}

    def group_spans(self, gid: int) -> list[tuple[int, int]]:
        """(buffer, bytes) for each buffer group `gid` uses: its layers there fill the first
        `bytes` of the pool page (whole pages for states). A page copy of the group moves
        exactly these bytes, so it never touches another group's memory."""
        group = self.groups[gid]
        used: dict[int, int] = {}
        for buf, off in self.group_slots(group):
            end = self.page_size_bytes if isinstance(group.spec, StateSpec) else off + group.spec.page_size_bytes
            used[buf] = max(used.get(buf, 0), end)
        return sorted(used.items())

    def page_use(self, gid: int) -> tuple[int, int]:
        """(pool bytes, bytes its layers use) of one unit group `gid` allocates: a block for KV
        groups, a request's state (`spec.pages` blocks) for state groups. The difference is
        padding: pool page bytes no layer uses."""
        group = self.groups[gid]
        if isinstance(group.spec, StateSpec):
            return group.spec.pages * self.bytes_per_block, len(group.layer_ids) * group.spec.state_bytes
        return self.bytes_per_block, len(group.layer_ids) * group.spec.page_size_bytes


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


@dataclass(frozen=True, slots=True)
class SlidingRowsSpec(SlidingWindowSpec):
    """One `[head_dim]` row per token kept for the last `sliding_window` positions, K only
    (DeepSeek-V4's shared K=V sliding branch, MQA: the key row is also the value), or the
    per-token source rows of a compressor (`compress_rate` > 0: DeepSeek-V4's projected
    kv | gate rows, the unclosed-window buffer). Retention is the sliding window's: a window
    of 2m (overlapping CSA windows, `overlap`) or m (HCA) source rows is exactly what any
    window still to close can read, so a prefix hit at a block boundary restores the buffer
    from cached blocks with no per-request state. `num_kv_heads` is 1."""
    compress_rate: int = 0          # > 0: compressor source rows for windows of this many tokens
    overlap: bool = False           # CSA: entry w pools windows w-1 (Ca half) and w (Cb half)

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.head_dim * self.dtype.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int]:
        """`[num_blocks, block_size, head_dim]`: token-major rows."""
        return (num_blocks, self.block_size, self.head_dim)


@dataclass(frozen=True, slots=True)
class CompressedEntrySpec(KVCacheSpec):
    """Compressed KV entries (DeepSeek-V4 CSA / HCA, or their indexer keys), in token
    coordinates: entry w is closed when token (w+1)*m - 1 is computed and lives in the block
    of that token, `((w+1)*m - 1) // block_size`, at slot `w % entries_per_page`. A page holds
    `max(1, block_size // m)` entries of `entry_dim`. With m > block_size only every
    (m / block_size)-th block holds an entry; the blocks in between are never allocated (null
    in the table) and count as present for prefix hits, so an entry costs its own bytes only
    (HCA m' = 128: entry bytes / 128 per token). Every entry block is kept (like full
    attention): queries attend to (or select among) all earlier entries."""
    compress_rate: int = 4
    entry_dim: int = 0
    dtype: torch.dtype = torch.float32

    @property
    def entries_per_page(self) -> int:
        return max(1, self.block_size // self.compress_rate)

    @property
    def block_stride(self) -> int:
        """Every `block_stride`-th block (the last of each run) holds entries."""
        return max(1, self.compress_rate // self.block_size)

    @property
    def page_size_bytes(self) -> int:
        return self.entries_per_page * self.entry_dim * self.dtype.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int]:
        """`[num_blocks, entries_per_page, entry_dim]`."""
        return (num_blocks, self.entries_per_page, self.entry_dim)

    def holds_entries(self, block_index):
        """Whether logical block `block_index` (int or numpy array) holds entries."""
        return (block_index + 1) % self.block_stride == 0

    def max_blocks_for(self, num_tokens: int) -> int:
        """Real (non-null) blocks `num_tokens` tokens need."""
        return -(-num_tokens // self.block_size) // self.block_stride

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.block_stride

    def check(self) -> None:
        m, bs = self.compress_rate, self.block_size
        if m <= 0 or (bs % m and m % bs):
            raise ValueError(f"compress rate {m} must divide the block size {bs} or be a multiple of it")
