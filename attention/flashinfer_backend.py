"""The FlashInfer backend: paged prefill and decode kernels for CUDA.

Our cache layout, `[num_blocks, 2, block_size, kv_heads, head_dim]`, is FlashInfer's single
tensor "NHD" paged cache, so the kernels read our pages in place. Per step and per KV cache
group the plan
- builds the paged-KV CSR arrays (qo_indptr, kv_indptr, kv_indices, last_page_len) with a
  few numpy gathers (`paged_kv_csr`, a pure function tested on CPU);
- splits the batch into decodes (one query token) and the rest (prefill chunks), one
  FlashInfer wrapper each, shared by every layer of the group.
Sliding groups pass `window_left = W - 1` (a query sees itself and the W - 1 keys before it)
and list only the pages from the one holding the earliest query's window start: FlashInfer
aligns queries to the end of the listed keys, so dropping whole leading pages keeps every
relative position, and the null-block slots of dead pages are never read.

The wrappers' own `plan()` needs the head counts, dtype and softmax scale, which only the
first layer's call reveals, so it runs lazily inside that layer's `forward` (host work only).
Layers whose scale differs from the planned one get their queries rescaled instead.

CUDA graphs (runtime/worker/cuda_graphs.py) use `graph_metadata` / `plan_graph`: per batch-size
bucket a decode wrapper built on static index buffers, re-planned in place before each replay.
flashinfer is imported only when this backend is constructed; nothing here runs on CPU except
the pure planning helpers.

Packed pool pages (cache/pool_layout.py: a model whose KV cache groups' pages differ in bytes
packs small-page layers into one pool page, so such a layer's cache is a view whose block
stride is the pool page, not its own page) are UNVERIFIED with FlashInfer: recent FlashInfer
releases read a paged cache through its strides, but no GPU has checked it here. Until one
does, `forward` refuses a cache that is not contiguous rather than risk reading another
layer's pages; use the triton backend (stride-generic) for such models.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from attention.backend import AttentionBackend, BatchLayout

WORKSPACE_BYTES = 128 << 20     # FlashInfer's recommended float workspace (split-k partials)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class PagedKVCSR:
    """FlashInfer's paged-KV description of some requests (all int32, host)."""
    qo_indptr: np.ndarray        # [n + 1] query token offsets (re-based to the part)
    kv_indptr: np.ndarray        # [n + 1] offsets into kv_indices
    kv_indices: np.ndarray       # [kv_indptr[-1]] block ids, request-major
    last_page_len: np.ndarray    # [n] tokens in each request's last listed page, 1..block_size


def paged_kv_csr(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                 block_size: int, sliding_window: int | None, rows: np.ndarray) -> PagedKVCSR:
    """CSR arrays of requests `rows` (indices into the batch; block_table row i = request i).

    A request lists pages `start .. ceil(seq_len / B) - 1`, where `start` is 0, or for a
    sliding window W the page holding position `first_query - W + 1` (clamped at 0)."""
    rows = np.asarray(rows, dtype=np.int64)
    q_lens = (query_start_loc[rows + 1] - query_start_loc[rows]).astype(np.int64)
    ctx = seq_lens[rows].astype(np.int64)
    end = -(-ctx // block_size)
    if sliding_window is None:
        start = np.zeros_like(ctx)
    else:
        start = np.maximum(ctx - q_lens - sliding_window + 1, 0) // block_size
    n_pages = end - start
    kv_indptr = np.concatenate(([0], np.cumsum(n_pages)))
    req = np.repeat(np.arange(len(rows)), n_pages)
    col = start[req] + np.arange(int(kv_indptr[-1])) - kv_indptr[:-1][req]
    return PagedKVCSR(
        qo_indptr=np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32),
        kv_indptr=kv_indptr.astype(np.int32),
        kv_indices=block_table[rows[req], col].astype(np.int32),
        last_page_len=(ctx - (end - 1) * block_size).astype(np.int32),
    )


def kv_write_rows(slot_mapping: np.ndarray, block_size: int) -> np.ndarray:
    """Row of each token's key in `kv_cache.view(-1, kv_heads, head_dim)`; its value is
    `block_size` rows further (block b's K page starts at row 2*b*B, its V page at (2b+1)*B)."""
    slot_mapping = np.asarray(slot_mapping, dtype=np.int64)
    return (slot_mapping // block_size) * (2 * block_size) + slot_mapping % block_size


def split_decode_prefill(query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Batch rows with one query token (decode kernel) and with more (prefill kernel)."""
    return np.flatnonzero(query_lens == 1), np.flatnonzero(query_lens > 1)


def part_token_index(query_start_loc: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Flat token indices of requests `rows`, request-major."""
    q_lens = query_start_loc[rows + 1] - query_start_loc[rows]
    starts = np.repeat(query_start_loc[rows], q_lens)
    offsets = np.arange(int(q_lens.sum())) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    return (starts + offsets).astype(np.int64)


@dataclass(slots=True)
class _Part:
    """One kernel call: the decode rows or the prefill rows of a step."""
    decode: bool
    csr: PagedKVCSR
    token_index: torch.Tensor | None   # device int64; None: the part is every token, in order
    wrapper: object = None             # FlashInfer wrapper (made at the first layer's forward)


@dataclass(slots=True)
class FlashInferMetadata:
    k_rows: torch.Tensor               # [num_tokens] int64 device, see kv_write_rows
    v_rows: torch.Tensor
    parts: list[_Part]
    window_left: int                   # -1: full attention
    slot: int                          # eager wrapper slot (-1: a CUDA graph bucket's own)
    planned: bool = False
    sm_scale: float = 0.0
    graph: dict = field(default_factory=dict)   # CUDA graph: static buffers + plan arguments


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(self):
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError("attention backend 'flashinfer' needs the flashinfer package "
                               f"(pip install -e '.[gpu]') and a CUDA GPU: {e}") from None
        if not torch.cuda.is_available():
            raise RuntimeError("attention backend 'flashinfer' needs a CUDA GPU; none is visible "
                               "(use attention_backend='torch' on CPU)")
        self._fi = flashinfer
        self._workspace: torch.Tensor | None = None
        self._slots: list[dict] = []       # eager wrappers, one dict per KV cache group of a step
        self._next_slot = 0
        self._forward_seen = False

    # ------------------------------------------------------------- planning
    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            raise ValueError(f"attention backend 'flashinfer' runs on CUDA only, got device '{device}'")
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def plan(self, layout: BatchLayout, device: torch.device) -> FlashInferMetadata:
        """Valid until the next step's plans: wrappers are reused slot by slot, one slot per
        plan() call since the previous forward (= per KV cache group of this step)."""
        device = torch.device(device)
        self._workspace_on(device)
        if self._forward_seen:
            self._next_slot, self._forward_seen = 0, False
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        qsl, seq_lens = layout.query_start_loc, layout.seq_lens
        table = layout.block_table.cpu().numpy()
        decode, prefill = split_decode_prefill(layout.query_lens)
        parts = []
        for rows, is_decode in ((decode, True), (prefill, False)):
            if not len(rows):
                continue
            whole = len(rows) == layout.num_reqs        # one kind only: no gather/scatter
            index = None if whole else torch.from_numpy(part_token_index(qsl, rows)).to(device)
            csr = paged_kv_csr(qsl, seq_lens, table, layout.block_size, layout.sliding_window, rows)
            parts.append(_Part(is_decode, csr, index))
        k_rows = torch.from_numpy(kv_write_rows(layout.slot_mapping.cpu().numpy(), layout.block_size)).to(device)
        return FlashInferMetadata(k_rows, k_rows + layout.block_size, parts,
                                  _window_left(layout.sliding_window), slot)

    def _eager_wrapper(self, slot: int, kind: str):
        while len(self._slots) <= slot:
            self._slots.append({})
        wrappers = self._slots[slot]
        if kind not in wrappers:
            if kind == "prefill":
                wrappers[kind] = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            else:
                wrappers[kind] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=kind == "decode_tc")
        return wrappers[kind]

    def _plan_wrappers(self, meta: FlashInferMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                       scale: float) -> None:
        """The wrappers' plan, at the group's first layer (it knows heads, dtype and scale)."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        # fp8 pages (kv_cache_dtype fp8_e4m3, scale 1: stored as k.to(fp8)) under a half model: unverified, no GPU run yet
        fp8 = kv_cache.dtype == torch.float8_e4m3fn and q.dtype in _HALF_DTYPES
        if not fp8 and (kv_cache.dtype not in _HALF_DTYPES or q.dtype != kv_cache.dtype):
            raise ValueError("attention backend 'flashinfer' needs a float16 or bfloat16 model and a KV cache of "
                             f"that dtype or fp8_e4m3, got q {q.dtype} / cache {kv_cache.dtype} (set dtype='bfloat16')")
        num_heads = q.shape[1]
        args = dict(num_qo_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    page_size=block_size, window_left=meta.window_left, sm_scale=scale,
                    q_data_type=q.dtype, kv_data_type=kv_cache.dtype)
        # Tensor-core decode pays off once several query heads share a KV head (vLLM's rule).
        tc = num_heads // num_kv_heads > 4
        for part in meta.parts:
            if part.wrapper is None:
                if meta.slot < 0:
                    part.wrapper = self._graph_wrapper(meta, tc)
                else:
                    part.wrapper = self._eager_wrapper(
                        meta.slot, "prefill" if not part.decode else "decode_tc" if tc else "decode")
            _plan_part(part, args)
        meta.graph["args"] = args
        meta.planned, meta.sm_scale = True, scale

    # ------------------------------------------------------------- running
    def forward(self, q, k, v, kv_cache, meta: FlashInferMetadata, scale: float, sinks=None):
        if sinks is not None:
            # The paged wrappers used here take no sink logits; FlashInfer's sink-aware entry points
            # (trtllm-gen kernels) are not wired or verified here, so refuse instead of dropping them.
            raise NotImplementedError("attention backend 'flashinfer' does not support attention sinks "
                                      "(attention.sinks, gpt-oss); use attention_backend='triton' on GPU")
        self._forward_seen = True
        if not kv_cache.is_contiguous():      # packed pool pages: unverified here (see the module docstring)
            raise ValueError(
                f"flashinfer backend: this layer's KV cache is a strided view (block stride "
                f"{kv_cache.stride(0)} elements, page {kv_cache[0].numel()}): its KV cache groups' pages "
                f"differ in size and share pool pages, which is not verified with FlashInfer yet; "
                f"use attention_backend='triton'")
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        rows = kv_cache.view(-1, num_kv_heads, head_dim)
        rows.index_copy_(0, meta.k_rows, k.to(kv_cache.dtype))
        rows.index_copy_(0, meta.v_rows, v.to(kv_cache.dtype))
        if not meta.planned:
            self._plan_wrappers(meta, q, kv_cache, scale)
        if scale != meta.sm_scale:            # another layer of the group, another scale
            q = q * (scale / meta.sm_scale)
        q = q.contiguous()
        if len(meta.parts) == 1 and meta.parts[0].token_index is None:
            return meta.parts[0].wrapper.run(q, kv_cache)
        out = torch.empty_like(q)
        for part in meta.parts:
            out.index_copy_(0, part.token_index, part.wrapper.run(q.index_select(0, part.token_index), kv_cache))
        return out

    # ------------------------------------------------------------- CUDA graphs
    def graph_metadata(self, batch_size: int, max_pages_per_req: int, block_size: int,
                       sliding_window: int | None, device: torch.device) -> FlashInferMetadata:
        """Static metadata of a decode-only bucket of `batch_size` requests: every tensor a
        captured graph reads lives at a fixed address, refreshed in place by `plan_graph`."""
        device = torch.device(device)
        self._workspace_on(device)
        i32 = dict(dtype=torch.int32, device=device)
        graph = dict(kv_indptr=torch.zeros(batch_size + 1, **i32),
                     kv_indices=torch.zeros(batch_size * max_pages_per_req, **i32),
                     last_page_len=torch.ones(batch_size, **i32),
                     batch_size=batch_size, block_size=block_size, sliding_window=sliding_window)
        k_rows = torch.zeros(batch_size, dtype=torch.int64, device=device)
        part = _Part(True, _dummy_decode_csr(batch_size), None)
        return FlashInferMetadata(k_rows, k_rows + block_size, [part], _window_left(sliding_window),
                                  slot=-1, graph=graph)

    def _graph_wrapper(self, meta: FlashInferMetadata, tensor_cores: bool):
        g = meta.graph
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=g["kv_indptr"], paged_kv_indices_buffer=g["kv_indices"],
            paged_kv_last_page_len_buffer=g["last_page_len"])

    def plan_graph(self, meta: FlashInferMetadata, layout: BatchLayout) -> None:
        """Refresh a bucket's static metadata from a decode-only layout already padded to the
        bucket size. Before the first (warm-up) forward the wrapper plan stays lazy."""
        g = meta.graph
        if layout.num_reqs != g["batch_size"] or (layout.query_lens != 1).any():
            raise ValueError(f"plan_graph: needs {g['batch_size']} decode requests, got query lens "
                             f"{layout.query_lens.tolist()}")
        table = layout.block_table.cpu().numpy()
        part = meta.parts[0]
        part.csr = paged_kv_csr(layout.query_start_loc, layout.seq_lens, table, layout.block_size,
                                layout.sliding_window, np.arange(layout.num_reqs))
        rows = torch.from_numpy(kv_write_rows(layout.slot_mapping.cpu().numpy(), layout.block_size))
        meta.k_rows.copy_(rows, non_blocking=True)
        meta.v_rows.copy_(rows + layout.block_size, non_blocking=True)
        if "args" in g:
            _plan_part(part, g["args"])     # copies the CSR into the wrapper's static buffers


def _window_left(sliding_window: int | None) -> int:
    return -1 if sliding_window is None else sliding_window - 1


def _dummy_decode_csr(n: int) -> PagedKVCSR:
    """n one-token requests on the null block: what a bucket is captured with."""
    return PagedKVCSR(np.arange(n + 1, dtype=np.int32), np.arange(n + 1, dtype=np.int32),
                      np.zeros(n, dtype=np.int32), np.ones(n, dtype=np.int32))


def _plan_part(part: _Part, args: dict) -> None:
    c = part.csr
    t = lambda a: torch.from_numpy(a)   # noqa: E731  (host int32; FlashInfer copies what it needs)
    common = dict(window_left=args["window_left"], sm_scale=args["sm_scale"],
                  q_data_type=args["q_data_type"], kv_data_type=args["kv_data_type"])
    heads = (args["num_qo_heads"], args["num_kv_heads"], args["head_dim"], args["page_size"])
    if part.decode:
        part.wrapper.plan(t(c.kv_indptr), t(c.kv_indices), t(c.last_page_len), *heads,
                          pos_encoding_mode="NONE", **common)
    else:
        part.wrapper.plan(t(c.qo_indptr), t(c.kv_indptr), t(c.kv_indices), t(c.last_page_len), *heads,
                          causal=True, **common)
