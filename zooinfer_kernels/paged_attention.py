"""The paged attention kernels of zooinfer_kernels/cpu (paged_decode.cpp, paged_prefill.cpp, kv_write.cpp).

`paged_decode` is the CPU decode path of the torch backend (attention/torch_backend.py): it
reads each page of a request once, token-major, with the query heads of a GQA group sharing
each K/V row (see the .cpp header for why that beats the sparse `sampled_addmm` path).
`paged_prefill` is its path for everything else (prefill chunks, several tokens after a
preemption): varlen causal attention straight from the pages, no padding to the longest
chunk and no masked upper triangle (`python -m bench.cpu_attention --prefill` compares it
with the padded SDPA). `write_kv` stores a step's keys and values into their pages in one
pass. Callers check `cpu_build.available()` first (`write_kv` checks it itself).

All three read a layer's cache `[blocks, 2, block_size, kv_heads, head_dim]` through its block
stride: each page must be contiguous (`pages_contiguous`), but pages may lie further apart than
one page, as they do when the pool packs several small-page layers into one pool page
(cache/pool_layout.py; the layer's cache is then a strided view of the shared buffer).

Both attention kernels take optional attention sinks (gpt-oss): one float32 logit per query
head that joins the softmax denominator as a key with no value (the online softmax starts
from max = sink, sum = 1).

The cache may hold float32, bfloat16 or int8 pages (`KV_DTYPES`, cache/kv_dtype.py); the
kernels compute in fp32 either way. Int8 pages carry per-(token, kv head) float32 scales
after their data (attention/kv_quant.py), beyond the 5-D view: its block stride covers them.
"""
from __future__ import annotations

import weakref

import torch

from zooinfer_kernels import cpu_build

# Page dtypes the kernels read (float32 q and out; bf16 / int8 pages convert, zooinfer_kernels/cpu/kv_elem.h)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


_CONTIGUOUS: dict[int, tuple[weakref.ref, bool]] = {}   # id -> (the tensor, its answer): caches are long-lived


def pages_contiguous(kv_cache: torch.Tensor) -> bool:
    """Whether the kernels can read `kv_cache`: `[blocks, 2, block_size, kv_heads, head_dim]`
    with every page (dims 1-4) contiguous and pages at least a page apart (any block stride).
    Mirrors `pages_contiguous` in zooinfer_kernels/cpu/paged_checks.h. Asked twice per layer per
    step of the same cache views, so the answer is kept per tensor object (a tensor's shape and
    strides do not change; the entry is checked to be that live tensor, not a reused id)."""
    hit = _CONTIGUOUS.get(id(kv_cache))
    if hit is not None and hit[0]() is kv_cache:
        return hit[1]
    ok = _pages_contiguous(kv_cache)
    if len(_CONTIGUOUS) > 4096:
        _CONTIGUOUS.clear()
    _CONTIGUOUS[id(kv_cache)] = (weakref.ref(kv_cache), ok)
    return ok


def _pages_contiguous(kv_cache: torch.Tensor) -> bool:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        return False
    _, _, bs, heads, dim = kv_cache.shape
    s = kv_cache.stride()
    if kv_cache.dtype == torch.int8 and kv_cache.shape[0] > 1 and s[0] < -(-2 * bs * heads * dim // 4) * 4 + 8 * bs * heads:
        return False   # no room for the scales after each page's data
    return ((s[4] == 1 or dim == 1) and (s[3] == dim or heads == 1) and (s[2] == heads * dim or bs == 1)
            and s[1] == bs * heads * dim and (s[0] >= 2 * bs * heads * dim or kv_cache.shape[0] == 1))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                 token_index: torch.Tensor, seq_lens: torch.Tensor, window: int | None, scale: float,
                 out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
    """Decode attention written into `out[token_index]`.

    q, out: float32 `[num_tokens, heads, head_dim]` (any strides, last dim contiguous);
    kv_cache: one layer's `[blocks, 2, block_size, kv_heads, head_dim]` float32 with contiguous
    pages (any block stride);
    block_table: int32 `[num_reqs, max_blocks]`; rows, token_index, seq_lens: int64 `[n]`
    (block table row, query token and context length incl. the new token of each decode);
    window: sliding window (keys at positions > seq_len - 1 - window) or None;
    sinks: None or `[heads]` sink logits (any float dtype; used as float32).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    torch.ops.zooinfer_cpu.paged_decode.default(q, kv_cache, block_table, rows, token_index, seq_lens,
                                        0 if window is None else int(window), float(scale), _f32(sinks), out)


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                  query_start: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor, window: int | None,
                  scale: float, out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
    """Causal attention of several query tokens per request, written into `out` at their rows.

    q, out: float32 `[num_tokens, heads, head_dim]` (any strides, last dim contiguous; head_dim
    <= 256); kv_cache: one layer's `[blocks, 2, block_size, kv_heads, head_dim]` float32 with
    contiguous pages (any block stride) holding every key the queries see (this step's included); block_table: int32
    `[num_reqs, max_blocks]`; rows, query_start, query_lens, seq_lens: int64 `[n]` (block table
    row, first query token, number of query tokens and context length after this step of each
    request). Request i's queries sit at positions seq_len - query_len ... seq_len - 1 and see
    the keys at positions <= their own (and > their own - window when window is set); sinks
    as for `paged_decode`.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    torch.ops.zooinfer_cpu.paged_prefill.default(q, kv_cache, block_table, rows, query_start, query_lens, seq_lens,
                                         0 if window is None else int(window), float(scale), _f32(sinks), out)


def _f32(sinks: torch.Tensor | None) -> torch.Tensor | None:
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Store k[t], v[t] (`[tokens, kv_heads, head_dim]`, the cache's dtype, or float32 into a
    bf16 cache (rounded) or an int8 cache (quantized with scales, attention/kv_quant.py)) at cache slot
    slots[t] (int64, block * block_size + offset) of one layer's CPU cache
    `[blocks, 2, block_size, kv_heads, head_dim]` with contiguous pages (any block stride), in one pass. k and v may be strided views
    (e.g. of the qkv projection) as long as each token's row is contiguous. Returns False,
    writing nothing, when the kernel does not apply (library off or missing, other layouts);
    the caller then writes with torch."""
    def rows_ok(x: torch.Tensor) -> bool:
        dtype_ok = x.dtype == kv_cache.dtype != torch.int8 or (
            x.dtype == torch.float32 and kv_cache.dtype in (torch.bfloat16, torch.int8))   # converts on store
        return (x.dim() == 3 and dtype_ok and x.is_cpu and x.stride(2) == 1
                and (x.shape[1] == 1 or x.stride(1) == x.shape[2]))
    if not (kv_cache.is_cpu and pages_contiguous(kv_cache) and slots.dtype == torch.int64
            and rows_ok(k) and rows_ok(v) and cpu_build.available()):
        return False
    torch.ops.zooinfer_cpu.write_kv.default(kv_cache, k, v, slots)
    return True
