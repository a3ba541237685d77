"""Int8 KV pages in torch: the scales next to the data, quantize on store, dequantize on read.

The torch reference (and fallback) for what zooinfer_kernels/cpu/kv_write.cpp, paged_decode.cpp and
paged_prefill.cpp do with an int8 cache (cache/kv_dtype.py); both write identical bytes.

Why per-(token, kv head) scales, not per (block, head): a block fills one token at a time
(decode) or in any split (chunked prefill, prefix hits, preemption), and a per-block scale
would have to grow with the block's largest value, re-quantizing the tokens already there:
a block's bytes would then depend on how the scheduler split the work, and chunking, batching
or a prefix hit could change greedy output. A per-token scale makes every token's bytes a
function of its own K/V row only, so everything the engine proves for fp32 pages (chunking
never changes output; a hit reuses bytes equal to a recompute) holds for int8 too. It costs
4 bytes per token and head: 6% of a 64-dim int8 row (a page is 27% of fp32, not 25%).

Layout of one layer's int8 page (`AttentionSpec.page_size_bytes`): K data then V data
(`[2, block_size, kv_heads, head_dim]` int8, the layer's 5-D cache view), padded to 4 bytes,
then float32 scales `[2, block_size, kv_heads]`. The scales are inside the page bytes the pool
copies, so copy-on-write, state checkpoints, swap and the tiers move them with the data.
Quantization is symmetric: scale = max|x| / 127, q = round_half_even(x / scale) in
[-127, 127]; the dequantized value q * scale is within scale / 2 = max|x| / 254 of x.
"""
from __future__ import annotations

import torch


def scales_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The float32 scales `[num_blocks, 2 (K|V), block_size, kv_heads]` of a layer's int8 cache
    (its 5-D data view, block stride = its pool page), viewing the same storage."""
    n, _, bs, heads, dim = kv_cache.shape
    offset = -(-2 * bs * heads * dim // 4) * 4
    stride = kv_cache.stride(0) if n > 1 else offset + 8 * bs * heads
    raw = torch.as_strided(kv_cache, (n, 8 * bs * heads), (stride, 1), kv_cache.storage_offset() + offset)
    return raw.view(torch.float32).view(n, 2, bs, heads)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[tokens, kv_heads, head_dim]` -> (int8 values of the same shape, float32 scales
    `[tokens, kv_heads]`): one symmetric scale per (token, head) row (module docstring)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / div.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize this step's k / v `[tokens, kv_heads, head_dim]` into their slots
    (block * block_size + offset) of an int8 cache: data and scales."""
    bs = kv_cache.shape[2]
    blk, off = slots // bs, slots % bs
    scales = scales_view(kv_cache)
    for half, x in ((0, k), (1, v)):
        q, s = quantize(x)
        which = torch.full_like(blk, half)
        kv_cache.index_put_((blk, which, off), q)
        scales.index_put_((blk, which, off), s)


def dequantize_pages(kv_cache: torch.Tensor, pages: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered int8 K and V pages (`[len(pages), block_size * kv_heads * head_dim]` each, of
    block ids `pages`) as `dtype` values: data times their scales."""
    _, _, bs, heads, dim = kv_cache.shape
    s = scales_view(kv_cache).index_select(0, pages)               # [m, 2, bs, heads]
    out = []
    for half, x in ((0, keys), (1, values)):
        deq = x.view(-1, bs, heads, dim).float() * s[:, half, :, :, None]
        out.append(deq.view(x.shape).to(dtype))
    return out[0], out[1]
