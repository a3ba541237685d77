"""The FlashInfer backend's host side, on CPU: the paged-KV CSR arrays it hands the kernels,
the token split between the decode and prefill wrappers, the K/V write rows, and its
forward run against a stand-in `flashinfer` that follows the wrappers' documented contract
(queries aligned to the end of the listed keys, causal, `window_left`, GQA). The real
kernels run only on CUDA: bench/gpu_check.py checks them against the torch backend."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from attention import BatchLayout, get_backend
from attention.flashinfer_backend import (FlashInferAttentionBackend, kv_write_rows, paged_kv_csr,
                                          part_token_index, split_decode_prefill)

torch.set_num_threads(1)

# block_size 4, window 6. Batch order: a prefill chunk, two decodes, a prefill chunk.
#   r0: positions 7..9 of 10: window start 2 -> pages 0..2, last page holds 2 tokens
#   r1: position 12 of 13: window start 7 -> pages 1..3 (page 0 is dead: null), last 1
#   r2: position 3 of 4: pages 0..0, last 4
#   r3: positions 15..19 of 20: window start 10 -> pages 2..4, last 4
QSL = np.array([0, 3, 4, 5, 10])
SEQ_LENS = np.array([10, 13, 4, 20])
TABLE = np.array([[7, 3, 11, 0, 0, 0],
                  [0, 9, 2, 14, 0, 0],
                  [5, 0, 0, 0, 0, 0],
                  [0, 0, 8, 1, 13, 0]], dtype=np.int32)


def test_split_and_token_index():
    decode, prefill = split_decode_prefill(np.diff(QSL))
    assert decode.tolist() == [1, 2] and prefill.tolist() == [0, 3]
    assert part_token_index(QSL, decode).tolist() == [3, 4]
    assert part_token_index(QSL, prefill).tolist() == [0, 1, 2, 5, 6, 7, 8, 9]


def test_csr_mixed_batch_sliding_window_shuffled_blocks():
    dec = paged_kv_csr(QSL, SEQ_LENS, TABLE, 4, 6, np.array([1, 2]))
    assert dec.qo_indptr.tolist() == [0, 1, 2]
    assert dec.kv_indptr.tolist() == [0, 3, 4]
    assert dec.kv_indices.tolist() == [9, 2, 14, 5]
    assert dec.last_page_len.tolist() == [1, 4]
    pre = paged_kv_csr(QSL, SEQ_LENS, TABLE, 4, 6, np.array([0, 3]))
    assert pre.qo_indptr.tolist() == [0, 3, 8]
    assert pre.kv_indptr.tolist() == [0, 3, 6]
    assert pre.kv_indices.tolist() == [7, 3, 11, 8, 1, 13]
    assert pre.last_page_len.tolist() == [2, 4]
    for a in (dec.qo_indptr, dec.kv_indptr, dec.kv_indices, dec.last_page_len):
        assert a.dtype == np.int32


def test_csr_full_attention_lists_every_page():
    full = paged_kv_csr(QSL, SEQ_LENS, TABLE, 4, None, np.arange(4))
    assert full.kv_indptr.tolist() == [0, 3, 7, 8, 13]
    assert full.kv_indices.tolist() == [7, 3, 11, 0, 9, 2, 14, 5, 0, 0, 8, 1, 13]
    assert full.last_page_len.tolist() == [2, 1, 4, 4]


def test_kv_write_rows():
    # cache [blocks, 2, B=4, H, D] viewed as rows: block b's K rows start at 8b, its V rows at 8b + 4
    assert kv_write_rows(np.array([29, 2, 15, 16]), 4).tolist() == [57, 2, 27, 32]


# ---------------------------------------------------------------- the kernels' contract
def _paged_attention(q, cache, qo_indptr, kv_indptr, kv_indices, last_page_len, window_left, sm_scale):
    """FlashInfer's paged attention by its documentation, one request at a time: request i's
    keys are its listed pages cut to kv_len = (pages - 1) * B + last; query j of q_len sits at
    kv_len - q_len + j; key p is seen when p <= that and, for window_left >= 0, p >= it - window_left."""
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(len(last_page_len)):
        pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * block_size + int(last_page_len[i])
        k = cache[pages, 0].reshape(-1, kv_heads, cache.shape[4])[:kv_len].float()
        v = cache[pages, 1].reshape(-1, kv_heads, cache.shape[4])[:kv_len].float()
        qi = q[qo_indptr[i]:qo_indptr[i + 1]].float()
        group = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("thd,lhd->htl", qi, k) * sm_scale
        qpos = torch.arange(kv_len - len(qi), kv_len)[:, None]
        kpos = torch.arange(kv_len)[None, :]
        masked = kpos > qpos
        if window_left >= 0:
            masked |= kpos < qpos - window_left
        out[qo_indptr[i]:qo_indptr[i + 1]] = torch.einsum("htl,lhd->thd", s.masked_fill(masked, -torch.inf).softmax(-1), v)
    return out.to(q.dtype)


class _FakeWrapper:
    """Stands in for BatchDecode/BatchPrefillWithPagedKVCacheWrapper (same plan/run calls)."""
    log: list = []

    def __init__(self, workspace, kv_layout, decode, **kwargs):
        assert kv_layout == "NHD"
        self.decode, self.kwargs = decode, kwargs

    def plan(self, *args, **kw):
        if self.decode:
            indptr, indices, last, heads, kv_heads, dim, page = args
            qo = torch.arange(len(last) + 1, dtype=torch.int32)
        else:
            qo, indptr, indices, last, heads, kv_heads, dim, page = args
            assert kw["causal"] is True
        self.args = (qo, indptr, indices, last, kw["window_left"], kw["sm_scale"])
        _FakeWrapper.log.append(("decode" if self.decode else "prefill", len(last), kw["window_left"]))

    def run(self, q, cache):
        return _paged_attention(q, cache, *self.args)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = lambda ws, layout, **kw: _FakeWrapper(ws, layout, True, **kw)
    mod.BatchPrefillWithPagedKVCacheWrapper = lambda ws, layout, **kw: _FakeWrapper(ws, layout, False, **kw)
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(FlashInferAttentionBackend, "_workspace_on", lambda self, device: None)
    _FakeWrapper.log = []
    return mod


MIXED = [(9, 1), (0, 13), (6, 7), (0, 1), (25, 1), (17, 5)]   # (cached tokens, new tokens)


def _random_batch(window, heads=8, kv_heads=2, dim=16, bs=4, dtype=torch.bfloat16, reqs=MIXED, seed=0):
    """A batch on scattered blocks (dead sliding pages pointing at the null block)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).numpy()
    table, used = np.zeros((len(reqs), 10), dtype=np.int32), 0
    for i, (done, new) in enumerate(reqs):
        n = -(-(done + new) // bs)
        table[i, :n] = perm[used:used + n]
        used += n
        if window is not None:     # the runner nulls pages wholly before every future window
            table[i, :max(done - window + 1, 0) // bs] = 0
    cache = torch.randn(num_blocks, 2, bs, kv_heads, dim, generator=g).to(dtype)
    q_lens = np.array([n for _, n in reqs])
    seq_lens = np.array([d + n for d, n in reqs])
    positions = np.concatenate([np.arange(d, d + n) for d, n in reqs])
    rows = np.repeat(np.arange(len(reqs)), q_lens)
    slots = table[rows, positions // bs].astype(np.int64) * bs + positions % bs
    layout = BatchLayout(np.concatenate(([0], np.cumsum(q_lens))), seq_lens, torch.from_numpy(table),
                         torch.from_numpy(slots), bs, window)
    t = int(q_lens.sum())
    q, k, v = (torch.randn(t, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    return layout, cache, q, k, v


@pytest.mark.parametrize("window", [None, 6])
def test_csr_contract_equals_torch_backend(window):
    """The CSR arrays under FlashInfer's contract give the torch backend's attention (float32)."""
    layout, cache, q, k, v = _random_batch(window, dtype=torch.float32)
    ref_cache = cache.clone()
    ref = get_backend("torch").forward(q, k, v, ref_cache, get_backend("torch").plan(layout, "cpu"), 0.25)
    table = layout.block_table.numpy()
    out = torch.empty_like(q)
    for rows in split_decode_prefill(layout.query_lens):
        c = paged_kv_csr(layout.query_start_loc, layout.seq_lens, table, 4, window, rows)
        tok = torch.from_numpy(part_token_index(layout.query_start_loc, rows))
        out[tok] = _paged_attention(q[tok], ref_cache, *(torch.from_numpy(a) for a in
                                    (c.qo_indptr, c.kv_indptr, c.kv_indices, c.last_page_len)),
                                    -1 if window is None else window - 1, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_forward_with_stand_in_kernels(fake_flashinfer, window):
    """The backend's own plan/forward (K/V writes by row, decode/prefill split and scatter,
    lazy wrapper plans shared by layers, rescaled queries for another scale) on bf16."""
    layout, cache, q, k, v = _random_batch(window)
    torch_be, fi = get_backend("torch"), get_backend("flashinfer")
    ref_cache, fi_cache = cache.clone(), cache.clone()
    tmeta, fmeta = torch_be.plan(layout, "cpu"), fi.plan(layout, "cpu")
    for scale in (0.25, 0.125):          # two layers of one group, the second with another scale
        ref = torch_be.forward(q, k, v, ref_cache, tmeta, scale)
        out = fi.forward(q, k, v, fi_cache, fmeta, scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(fi_cache, ref_cache)          # the same slots written
    w = -1 if window is None else window - 1
    assert _FakeWrapper.log == [("decode", 3, w), ("prefill", 3, w)]   # planned once, not per layer
    # The next step reuses slot 0's wrappers (no new workspace per step).
    before = [id(x) for x in fi._slots[0].values()]
    fi.forward(q, k, v, fi_cache, fi.plan(layout, "cpu"), 0.25)
    assert [id(x) for x in fi._slots[0].values()] == before and len(fi._slots) == 1


@pytest.mark.parametrize("window", [None, 6])
def test_graph_metadata_is_replanned_in_place(fake_flashinfer, window):
    """A CUDA-graph bucket's metadata: planned lazily at the warm-up forward, then re-planned
    in place for each step's padded decode batch; the tensors a graph would hold stay put."""
    from runtime.worker.cuda_graphs import pad_decode_layout
    fi, torch_be = get_backend("flashinfer"), get_backend("torch")
    meta = fi.graph_metadata(4, 10, 4, window, "cpu")
    empty = BatchLayout(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64), torch.zeros(0, 10, dtype=torch.int32),
                        torch.zeros(0, dtype=torch.int64), 4, window)
    fi.plan_graph(meta, pad_decode_layout(empty, 4))     # a bucket of 4 dummy requests, as captured
    _, cache, *_ = _random_batch(window)
    warm = torch.zeros(4, 8, 16, dtype=torch.bfloat16)
    fi.forward(warm, warm[:, :2], warm[:, :2], cache.clone(), meta, 0.25)        # warm-up: lazy plan
    held = (meta.k_rows, meta.v_rows, meta.parts[0].wrapper)
    for seed, reqs in enumerate(([(9, 1), (25, 1), (3, 1)], [(30, 1), (0, 1)])):
        layout, cache, q, k, v = _random_batch(window, reqs=reqs, seed=seed + 1)
        fi.plan_graph(meta, pad_decode_layout(layout, 4))
        pad = lambda t: torch.cat((t, t.new_zeros(4 - len(t), *t.shape[1:])))   # noqa: E731
        ref_cache, fi_cache = cache.clone(), cache.clone()
        ref = torch_be.forward(q, k, v, ref_cache, torch_be.plan(layout, "cpu"), 0.25)
        out = fi.forward(pad(q), pad(k), pad(v), fi_cache, meta, 0.25)[:len(reqs)]
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(fi_cache[1:], ref_cache[1:])          # dummies wrote only the null block
        assert all(a is b for a, b in zip((meta.k_rows, meta.v_rows, meta.parts[0].wrapper), held))
    assert _FakeWrapper.log == [("decode", 4, -1 if window is None else window - 1)] * 3
    assert meta.parts[0].wrapper.kwargs["use_cuda_graph"] is True


def test_forward_refuses_float32(fake_flashinfer):
    layout, cache, q, k, v = _random_batch(None, dtype=torch.float32)
    fi = get_backend("flashinfer")
    with pytest.raises(ValueError, match=r"^attention backend 'flashinfer' needs a float16 or bfloat16 model"):
        fi.forward(q, k, v, cache, fi.plan(layout, "cpu"), 0.25)


def test_choosing_flashinfer_without_it_is_one_line_error():
    try:
        import flashinfer  # noqa: F401
        if torch.cuda.is_available():
            pytest.skip("flashinfer and CUDA are present: the backend constructs")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match=r"^attention backend 'flashinfer' needs") as e:
        get_backend("flashinfer")
    assert "\n" not in str(e.value)


def test_engine_reports_the_backend_error():
    from runtime import LLM
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match=r"^attention backend 'flashinfer' needs"):
        LLM("zoo/smollm2-tiny.yaml", attention_backend="flashinfer", max_model_len=64)
