"""The torch backend: paged, varlen attention in plain torch (reference and CPU default).

One call serves a batch mixing prefill chunks and decodes. The plan splits the batch once
per step into
- decodes (one query token): on CPU, attention straight from the pages with no gather and
  no padding. float32 decodes run in the C++ kernel `zooinfer_kernels.paged_attention.paged_decode`
  when the library built (one token-major pass over each request's pages;
  `ZOOINFER_CPU_KERNELS=0` turns it off); otherwise the sparse path: every key of
  every request is a row of the cache seen as `[rows, head_dim]`, so the scores are a
  sampled dense-dense product (`torch.sparse.sampled_addmm`) over a CSR pattern with one row
  per (head, request) and the request's key rows as columns, and the value sum is a
  weighted `embedding_bag` over the matching value rows. Each byte of K and V in context is
  read once; the gather + padded-SDPA path read it three times plus padding.
- the rest (prefill chunks, several tokens after a preemption): on CPU, float32, when the
  C++ library built, `zooinfer_kernels.paged_attention.paged_prefill`: varlen causal attention
  straight from the pages, bottom-right aligned (earlier chunks and prefix hits live only in
  the pages), each query tile reading only the keys it can see: no padding to the longest
  chunk, no masked upper triangle (`python -m bench.cpu_attention` measures both against
  the padded path).
  Otherwise (other devices and dtypes, and decodes where the sparse kernels do not apply:
  half precision) the padded path: K and V pages gathered once each, then one batched SDPA
  with queries padded to the longest chunk and a causal-by-position mask; it is planned
  only when a layer needs it.
The only Python-level work per layer is a handful of kernel calls; nothing loops over tokens
or requests. Sliding-window groups read only the keys inside the window.
A layer's cache may be a strided view (pages a pool page apart, cache/pool_layout.py): the C++
kernels and the padded path read it in place; the sparse decode path, which sees the whole
cache as one row matrix, needs a contiguous cache and otherwise hands over to the padded path.

Pages may be float32, bf16 or int8 (cache/kv_dtype.py) under a float32 model: the C++ kernels
read all three; without them the padded path converts (int8: times the per-token scales,
attention/kv_quant.py) and the torch write rounds or quantizes on store.

Attention sinks (a per-head logit in the softmax denominator, with no value) are honoured by
every path: the C++ kernels start their online softmax from the sink, the sparse decode adds
a sink column to its padded score grid, and the padded SDPA gets one extra key whose vector
and value are zero, its score set to the sink through a float mask.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build, paged_attention
from attention import kv_quant
from attention.backend import AttentionBackend, BatchLayout

# dtypes the CPU sampled_addmm kernel dispatches on
_SPARSE_DTYPES = (torch.float32, torch.float64)


@dataclass(slots=True)
class _Part:
    """One padded SDPA call's worth of requests."""
    token_index: torch.Tensor   # [n, max_q] flat token index of each query slot (pads: any valid)
    valid: torch.Tensor | None  # [n, max_q] bool, None when every slot is real (decode)
    pages: torch.Tensor         # [n * num_pages] block ids to gather, row-major
    mask: torch.Tensor          # [n, 1, max_q, num_pages * block_size] bool, True = attend


@dataclass(slots=True)
class _Decodes:
    """Decode requests, attended from the pages in place (see the module docstring).

    Key j of request i sits in cache row `token_row[i, j]` (in units of one token's
    `[num_kv_heads, head_dim]` slab of the cache seen as `[blocks * 2 * block_size, ...]`);
    its value is `block_size` slabs further on. The grid is padded to the longest request,
    `valid` says which entries are real. The per-head CSR pattern depends on the layer's
    head counts, so the first layer that runs builds it and the group's other layers reuse
    it (`patterns`). The grid is built on first use (`build_grid`): the C++ kernel needs none."""
    token_index: torch.Tensor   # [n] flat token index of each decode
    rows: np.ndarray            # [n] batch rows, for the padded fallback
    layout: BatchLayout
    token_row: np.ndarray | None = None   # [n, max keys] int64
    valid: np.ndarray | None = None       # [n, max keys] bool
    key_lens: np.ndarray | None = None    # [n] int64 keys each request attends to
    patterns: dict = field(default_factory=dict)
    fallback: _Part | None = None
    kernel: tuple | None = None  # (block_table, rows, seq_lens, window) for the C++ kernel, when built


@dataclass(slots=True)
class _Prefills:
    """Requests with several query tokens, for the C++ varlen kernel (`paged_attention.paged_prefill`).
    The padded part is planned only if a layer cannot use the kernel (dtype, cache layout)."""
    rows: np.ndarray            # batch rows
    kernel: tuple               # (block_table, rows, query_start, query_lens, seq_lens, window)
    fallback: _Part | None = None


@dataclass(slots=True)
class _DecodePattern:
    """One group's decode attention plan for given head counts, shared by its layers."""
    scores: torch.Tensor        # sparse CSR [n * H, cache rows]: row i * H + h = head h of decode i
    value_rows: torch.Tensor    # [nnz] value row of each entry, same order
    offsets: torch.Tensor       # [n * H] start of each (request, head) bag
    dense_pos: torch.Tensor     # [nnz] flat position of each entry in the [n * H, max keys] grid
    max_keys: int


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    kv_rows: torch.Tensor | None  # [num_tokens] cache slab row of each token's key (value: + block_size);
                                  # made by the first layer that writes with torch (write_kv needs none)
    parts: list[_Part]
    decodes: _Decodes | None
    prefills: _Prefills | None
    layout: BatchLayout
    device: torch.device
    stack_plan: tuple | None = None   # `kernel_plan`'s answer, made by its first caller this step

    def kernel_plan(self) -> tuple | None:
        """This step's plan as the C++ layer stack takes it (zooinfer_kernels/cpu/decode_stack.cpp):
        (slots, decode block_table, rows, token_index, seq_lens, prefill block_table, rows,
        query_start, query_lens, seq_lens) (a part's tensors None where the step has none of it) and
        the window (0: none), or None where some of the step needs the padded path (no kernel
        plan: the library off, a non-CPU device) or the slots are not int64. Made once a step."""
        if self.stack_plan is None:
            d, p = self.decodes, self.prefills
            ok = not self.parts and (d is None or d.kernel is not None) and self.slot_mapping.dtype == torch.int64
            if not ok:
                self.stack_plan = ()
            else:
                dec = (d.kernel[0], d.kernel[1], d.token_index, d.kernel[2]) if d is not None else (None,) * 4
                pre = p.kernel[:5] if p is not None else (None,) * 5
                window = self.layout.sliding_window
                self.stack_plan = ((self.slot_mapping, *dec, *pre), 0 if window is None else int(window))
        return self.stack_plan or None


def _make_part(layout: BatchLayout, rows: np.ndarray, device: torch.device) -> _Part:
    qsl, seq_lens, bs, window = layout.query_start_loc, layout.seq_lens, layout.block_size, layout.sliding_window
    q_lens = (qsl[rows + 1] - qsl[rows]).astype(np.int64)
    max_q = int(q_lens.max())
    ctx = seq_lens[rows].astype(np.int64)
    first_q = ctx - q_lens                                              # position of the first query
    # First page each request needs: 0, or the one holding the window start of its first query.
    start_page = np.zeros_like(ctx) if window is None else np.maximum(first_q - window + 1, 0) // bs
    num_pages = int((-(-ctx // bs) - start_page).max())
    page_index = start_page[:, None] + np.arange(num_pages)[None, :]   # [n, num_pages] logical pages
    table = layout.block_table.numpy()
    page_index_clipped = np.minimum(page_index, table.shape[1] - 1)    # past-the-end pages are masked
    pages = table[rows[:, None], page_index_clipped].astype(np.int64)
    j = np.arange(max_q, dtype=np.int64)
    valid = j[None, :] < q_lens[:, None]
    token_index = np.where(valid, qsl[rows][:, None] + j[None, :], qsl[rows][:, None])
    q_pos = first_q[:, None] + j[None, :]                              # [n, max_q]
    kv_pos = (page_index[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(len(rows), -1)
    mask = (kv_pos[:, None, :] <= q_pos[:, :, None]) & (kv_pos[:, None, :] < ctx[:, None, None])
    if window is not None:
        mask &= kv_pos[:, None, :] > q_pos[:, :, None] - window
    return _Part(
        token_index=torch.from_numpy(token_index).to(device),
        valid=None if valid.all() else torch.from_numpy(valid).to(device),
        pages=torch.from_numpy(pages.reshape(-1)).to(device),
        mask=torch.from_numpy(mask).to(device).unsqueeze(1),
    )


def _build_grid(d: _Decodes) -> None:
    """Every decode's key slab rows, on a grid padded to the longest request."""
    layout, rows = d.layout, d.rows
    bs, window = layout.block_size, layout.sliding_window
    ctx = layout.seq_lens[rows].astype(np.int64)
    start = np.zeros_like(ctx) if window is None else np.maximum(ctx - window, 0)
    d.key_lens = ctx - start
    j = np.arange(int(d.key_lens.max()), dtype=np.int64)
    pos = np.minimum(start[:, None] + j[None, :], ctx[:, None] - 1)      # pads repeat the last key
    block = layout.block_table.numpy()[rows[:, None], pos // bs].astype(np.int64)
    d.token_row = block * (2 * bs) + pos % bs
    d.valid = j[None, :] < d.key_lens[:, None]


def _decode_pattern(d: _Decodes, num_heads: int, num_kv_heads: int, block_size: int, num_rows: int,
                    device: torch.device, dtype: torch.dtype = torch.float32) -> _DecodePattern:
    """CSR scores pattern over the cache seen as `[num_rows, head_dim]`: row i * H + h is
    query head h of decode i, its columns are the key rows of that request's KV head (one
    request's heads next to each other, so its pages stay in cache across its heads)."""
    if d.token_row is None:
        _build_grid(d)
    n, max_keys = d.token_row.shape
    head_kv = np.arange(num_heads) // (num_heads // num_kv_heads)
    grid = d.token_row[:, None, :] * num_kv_heads + head_kv[None, :, None]          # [n, H, max keys]
    dense_pos = np.flatnonzero(np.broadcast_to(d.valid[:, None, :], grid.shape))
    key_rows = grid.reshape(-1)[dense_pos]
    crow = np.zeros(n * num_heads + 1, dtype=np.int64)
    np.cumsum(np.repeat(d.key_lens, num_heads), out=crow[1:])
    crow_t, key_rows_t = torch.from_numpy(crow).to(device), torch.from_numpy(key_rows).to(device)
    with warnings.catch_warnings():   # "sparse CSR support is in beta": the two kernels used here are not
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(crow_t, key_rows_t, torch.zeros(len(key_rows), device=device, dtype=dtype),
                                          size=(num_heads * n, num_rows), check_invariants=False)
    return _DecodePattern(scores=pattern, value_rows=key_rows_t + block_size * num_kv_heads,
                          offsets=crow_t[:-1], dense_pos=torch.from_numpy(dense_pos).to(device),
                          max_keys=max_keys)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        """`layout.block_table` rows must be in batch order (row i = request i)."""
        device = torch.device(device)
        q_lens = layout.query_lens
        decode = np.flatnonzero(q_lens == 1)
        rest = np.flatnonzero(q_lens > 1)
        decodes = None
        if len(decode) and device.type == "cpu":
            decodes = _Decodes(token_index=torch.from_numpy(layout.query_start_loc[decode].astype(np.int64)).to(device),
                               rows=decode, layout=layout)
            if cpu_build.available():   # float32 decodes then run in zooinfer_kernels/cpu/paged_decode.cpp (one pass over the pages)
                decodes.kernel = (layout.block_table, torch.from_numpy(decode.astype(np.int64)),
                                  torch.from_numpy(layout.seq_lens[decode].astype(np.int64)), layout.sliding_window)
        elif len(decode):
            rest = np.concatenate([decode, rest])
        prefills, parts = None, []
        if len(rest) and device.type == "cpu" and cpu_build.available():   # the C++ varlen kernel
            as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
            prefills = _Prefills(rows=rest, kernel=(layout.block_table, as_long(rest),
                                                    as_long(layout.query_start_loc[rest]), as_long(q_lens[rest]),
                                                    as_long(layout.seq_lens[rest]), layout.sliding_window))
        elif len(rest):
            parts = [_make_part(layout, rest, device)]
        return TorchAttentionMetadata(slot_mapping=layout.slot_mapping.to(device), kv_rows=None,
                                      parts=parts, decodes=decodes, prefills=prefills, layout=layout, device=device)

    def forward(self, q, k, v, kv_cache, meta: TorchAttentionMetadata, scale: float, sinks=None):
        num_tokens, num_heads, head_dim = q.shape
        num_blocks, _, block_size, num_kv_heads, _ = kv_cache.shape   # [blocks, K|V, block, heads, dim]
        # Write this step's keys and values: one token's K is one row of the cache seen as
        # [blocks * 2 * block_size, kv_heads * head_dim], its V `block_size` rows further on.
        # On CPU `paged_attention.write_kv` does both rows in one pass, straight from strided k / v.
        # A packed layer's cache (cache/pool_layout.py) is a view whose pages lie a pool page
        # apart: the C++ kernels step by that block stride, the torch paths below index it.
        contiguous = kv_cache.is_contiguous()
        if not paged_attention.write_kv(kv_cache, k, v, meta.slot_mapping):
            if kv_cache.dtype == torch.int8:   # quantized, with per-token scales next to the data
                kv_quant.write(kv_cache, k, v, meta.slot_mapping)
            elif contiguous:
                if meta.kv_rows is None:   # block * 2B + offset: the K row of each token
                    s = meta.slot_mapping
                    meta.kv_rows = s + (s // block_size) * block_size
                slabs = kv_cache.view(-1, num_kv_heads * head_dim)
                slabs.index_copy_(0, meta.kv_rows, k.reshape(num_tokens, -1).to(kv_cache.dtype))
                slabs.index_copy_(0, meta.kv_rows + block_size, v.reshape(num_tokens, -1).to(kv_cache.dtype))
            else:   # strided pages: index (block, K|V, offset) of each token
                s = meta.slot_mapping
                blk, off = s // block_size, s % block_size
                kv_cache.index_put_((blk, torch.zeros_like(blk), off), k.to(kv_cache.dtype))
                kv_cache.index_put_((blk, torch.ones_like(blk), off), v.to(kv_cache.dtype))
        out = torch.empty_like(q)
        parts = meta.parts
        d = meta.decodes
        if d is not None:
            if (d.kernel is not None and q.dtype == torch.float32 and kv_cache.dtype in paged_attention.KV_DTYPES
                    and paged_attention.pages_contiguous(kv_cache)):
                table, rows, seq_lens, window = d.kernel
                paged_attention.paged_decode(q, kv_cache, table, rows, d.token_index, seq_lens, window, scale, out,
                                             sinks)
            elif q.dtype == kv_cache.dtype and q.dtype in _SPARSE_DTYPES and contiguous:
                # (the sparse path sees the whole cache as rows: contiguous caches only)
                self._decode(q, kv_cache, d, scale, out, sinks)
            else:   # no sparse kernel for this dtype or layout: the padded path, planned once per step
                if d.fallback is None:
                    d.fallback = _make_part(meta.layout, d.rows, meta.device)
                parts = [d.fallback, *parts]
        p = meta.prefills
        if p is not None:
            if (q.dtype == torch.float32 and kv_cache.dtype in paged_attention.KV_DTYPES
                    and paged_attention.pages_contiguous(kv_cache) and head_dim <= 256):
                paged_attention.paged_prefill(q, kv_cache, *p.kernel, scale, out, sinks)
            else:   # planned once per step, by the first layer that needs it
                if p.fallback is None:
                    p.fallback = _make_part(meta.layout, p.rows, meta.device)
                parts = [*parts, p.fallback]
        for part in parts:
            self._padded(q, kv_cache, part, scale, out, sinks)
        return out

    @staticmethod
    def _decode(q, kv_cache, d: _Decodes, scale: float, out: torch.Tensor, sinks=None) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        rows = kv_cache.view(-1, head_dim)
        key = (num_heads, num_kv_heads, q.dtype)
        if key not in d.patterns:
            d.patterns[key] = _decode_pattern(d, num_heads, num_kv_heads, block_size, rows.shape[0], q.device, q.dtype)
        pat = d.patterns[key]
        n = d.token_index.shape[0]
        queries = q.index_select(0, d.token_index).reshape(num_heads * n, head_dim)
        scores = torch.sparse.sampled_addmm(pat.scores, queries, rows.t(), beta=0.0, alpha=scale).values()
        # Softmax on the padded [n * H, max keys] grid (pads at -inf): one vectorised pass,
        # cheaper than segment reductions over the ragged scores.
        grid = torch.full((n * num_heads * pat.max_keys,), float("-inf"), dtype=scores.dtype, device=q.device)
        grid.index_copy_(0, pat.dense_pos, scores)
        grid = grid.view(n * num_heads, -1)
        if sinks is None:
            weights = grid.softmax(dim=-1)
        else:   # row i * H + h gets head h's sink as one more logit, dropped after the softmax
            sink_col = sinks.to(grid.dtype).repeat(n)[:, None]
            weights = (grid - torch.cat([grid, sink_col], dim=1).logsumexp(dim=-1, keepdim=True)).exp()
        weights = weights.view(-1).index_select(0, pat.dense_pos)
        o = F.embedding_bag(pat.value_rows, rows, pat.offsets, mode="sum", per_sample_weights=weights)
        out.index_copy_(0, d.token_index, o.view(n, num_heads, head_dim).to(out.dtype))

    @staticmethod
    def _padded(q, kv_cache, part: _Part, scale: float, out: torch.Tensor, sinks=None) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_blocks, _, block_size, num_kv_heads, _ = kv_cache.shape
        n, max_q = part.token_index.shape
        # Gather whole K pages and whole V pages as rows of 2-D views: plain row copies,
        # several times faster on CPU than advanced indexing over the 5-D tensor (a view of
        # each page's K|V halves, so strided pages work too).
        pages = kv_cache.view(num_blocks, 2, -1)
        keys, values = pages[:, 0].index_select(0, part.pages), pages[:, 1].index_select(0, part.pages)
        if kv_cache.dtype == torch.int8:   # data times the per-token scales after it
            keys, values = kv_quant.dequantize_pages(kv_cache, part.pages, keys, values, q.dtype)
        keys = keys.view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        queries = q[part.token_index].transpose(1, 2)          # [n, heads, max_q, dim]
        keys, values, mask = keys.to(q.dtype), values.to(q.dtype), part.mask
        if sinks is not None:   # one more key: zero vector and value, score = the head's sink via the mask
            keys, values = (F.pad(x, (0, 0, 0, 1)) for x in (keys, values))
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            sink = sinks.to(q.dtype).view(1, -1, 1, 1).expand(n, num_heads, max_q, 1)
            mask = torch.cat([bias.expand(n, num_heads, max_q, -1), sink], dim=-1)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        o = o.transpose(1, 2)                                  # [n, max_q, heads, dim]
        if part.valid is None:
            out[part.token_index.view(-1)] = o.reshape(-1, num_heads, head_dim)
        else:
            out[part.token_index[part.valid]] = o[part.valid]
