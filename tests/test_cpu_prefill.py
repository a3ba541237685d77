"""The C++ varlen prefill kernel (`paged_attention.paged_prefill`, zooinfer_kernels/cpu/paged_prefill.cpp)
against the torch backend's padded SDPA path and a float64 reference, through the backend's
real plan + forward (the step's K/V written into the pages first). Batches mix fresh
prompts, chunk continuations / prefix hits (keys that live only in the pages) and decodes;
every page slot a request must not read holds NaN."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from attention import BatchLayout, get_backend
from zooinfer_kernels import cpu_build, paged_attention
from attention.torch_backend import _make_part

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the CPU kernels")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_build.available(), "the C++ CPU kernels did not build (see the warning)"


# (context after the step, query tokens this step) per request: fresh prompts (ctx == q),
# continuations and prefix hits (ctx > q), a 2-token tail, decodes (q == 1), ragged lengths.
CTX = [40, 100, 7, 300, 64, 2, 33, 190, 17]
QLEN = [40, 30, 7, 100, 1, 2, 20, 1, 16]


def _step(heads, kv_heads, dim, ctx, qlen, window, bs=16, seed=0):
    """One step's batch over shuffled pages of a float32 cache. Keys before the step are in
    the pages already; the step's own K/V come as k, v (the forward writes them). The null
    block, every slot past a request's last token, every table slot past its last page and
    (sliding window) every page wholly below the window of the request's first query hold
    NaN or point at the null block: reading any of them shows up in the output."""
    gen = torch.Generator().manual_seed(seed)
    ctx, qlen = np.asarray(ctx), np.asarray(qlen)
    n_pages = -(-ctx // bs)
    num_blocks = int(n_pages.sum()) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).numpy()
    table = np.zeros((len(ctx), int(n_pages.max()) + 2), dtype=np.int32)
    first = np.concatenate(([0], np.cumsum(n_pages)))
    cache = torch.randn(num_blocks, 2, bs, kv_heads, dim, generator=gen)
    for i, (L, nb, ql) in enumerate(zip(ctx, n_pages, qlen)):
        table[i, :nb] = perm[first[i]:first[i + 1]]
        cache[table[i, nb - 1], :, (L - 1) % bs + 1:] = float("nan")     # slots past the last token
        if window is not None:
            table[i, :max(L - ql - window + 1, 0) // bs] = 0              # dead pages: the null block
    cache[0] = float("nan")
    qsl = np.concatenate(([0], np.cumsum(qlen)))
    pos = np.concatenate([np.arange(L - ql, L) for L, ql in zip(ctx, qlen)])
    req = np.repeat(np.arange(len(ctx)), qlen)
    slots = table[req, pos // bs].astype(np.int64) * bs + pos % bs
    layout = BatchLayout(query_start_loc=qsl, seq_lens=ctx, block_table=torch.from_numpy(table),
                         slot_mapping=torch.from_numpy(slots), block_size=bs, sliding_window=window)
    tokens = int(qlen.sum())
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    return layout, cache, q, k, v


def _reference(layout, cache, q, scale, sinks=None):
    """float64 attention of every query token over its visible keys, gathered position by position.
    With `sinks` ([heads]) each head's sink logit joins the softmax denominator (a key with no value)."""
    bs, window = layout.block_size, layout.sliding_window
    table = layout.block_table.numpy()
    group = q.shape[1] // cache.shape[3]
    qsl = layout.query_start_loc
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, L in enumerate(layout.seq_lens):
        ql = qsl[i + 1] - qsl[i]
        for j in range(ql):
            p = L - ql + j
            pos = np.arange(0 if window is None else max(p - window + 1, 0), p + 1)
            blocks = torch.from_numpy(table[i, pos // bs].astype(np.int64))
            k = cache[blocks, 0, torch.from_numpy(pos % bs)].double().repeat_interleave(group, dim=1)
            v = cache[blocks, 1, torch.from_numpy(pos % bs)].double().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,khd->hk", q[qsl[i] + j].double(), k) * scale
            if sinks is None:
                w = s.softmax(-1)
            else:
                w = torch.cat([s, sinks.double()[:, None]], dim=1).softmax(-1)[:, :-1]
            out[qsl[i] + j] = torch.einsum("hk,khd->hd", w, v)
    return out.float()


def _forward(layout, cache, q, k, v, scale, monkeypatch, calls):
    """The backend's plan + forward on a copy of the cache; counts the kernel calls."""
    prefill = paged_attention.paged_prefill
    monkeypatch.setattr(paged_attention, "paged_prefill", lambda *a: calls.append(a) or prefill(*a))
    backend = get_backend("torch")
    meta = backend.plan(layout, torch.device("cpu"))
    cache = cache.clone()
    out = backend.forward(q, k, v, cache, meta, scale)
    return out, cache, meta


def _padded(layout, cache, q, scale):
    """The padded SDPA path over every request (whole page grids, so NaN pages are zeroed)."""
    out = torch.empty_like(q)
    part = _make_part(layout, np.arange(layout.num_reqs), torch.device("cpu"))
    get_backend("torch")._padded(q, cache.nan_to_num(0.0), part, scale, out)
    return out


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 8, 32), (9, 3, 64), (4, 2, 64), (6, 2, 32), (6, 3, 24)])
@pytest.mark.parametrize("bs", [16, 3])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 1000])
def test_prefill_kernel_matches_padded_and_reference(heads, kv_heads, dim, bs, window, monkeypatch):
    layout, cache, q, k, v = _step(heads, kv_heads, dim, CTX, QLEN, window, bs=bs,
                                   seed=heads + dim + bs + (window or 0))
    scale = dim ** -0.5
    calls = []
    out, written, meta = _forward(layout, cache, q, k, v, scale, monkeypatch, calls)
    rest = np.flatnonzero(np.asarray(QLEN) > 1)
    assert len(calls) == 1 and meta.parts == [] and meta.prefills.fallback is None
    assert calls[0][3].tolist() == rest.tolist()                      # block table rows of the prefills
    assert torch.isfinite(out).all()
    ref = _reference(layout, written, q, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _padded(layout, written, q, scale), rtol=1e-5, atol=1e-5)


def test_prefill_kernel_tiny_llama_and_smollm2_shapes(monkeypatch):
    """A step like the benchmarks': ~2048 tokens of fresh 64-256-token prompts (several query
    tiles per request), plus a 256-token chunk after a 512-token prefix."""
    rng = np.random.default_rng(0)
    lens = list(rng.integers(64, 257, size=12)) + [768]
    qlen = lens[:-1] + [256]
    for heads, kv_heads, dim in ((8, 8, 32), (9, 3, 64)):
        layout, cache, q, k, v = _step(heads, kv_heads, dim, lens, qlen, None, seed=dim)
        out, written, _ = _forward(layout, cache, q, k, v, dim ** -0.5, monkeypatch, [])
        torch.testing.assert_close(out, _padded(layout, written, q, dim ** -0.5), rtol=1e-5, atol=1e-5)


def test_strided_queries_scattered_tokens_and_threads():
    """q as a strided view (a slice of a fused qkv buffer), only the requests' token rows of
    `out` written, the same result on 1 and 4 threads (work items handed out dynamically)."""
    heads, kv_heads, dim = 6, 2, 32
    layout, cache, q, _, _ = _step(heads, kv_heads, dim, [150, 9, 70], [150, 4, 30], None, seed=3)
    ref = _reference(layout, cache, q, 0.3)
    tokens = q.shape[0]
    fused = torch.randn(tokens + 5, heads * dim * 2)
    fused[:tokens, : heads * dim] = q.reshape(tokens, -1)
    q_view = fused[:, : heads * dim].view(tokens + 5, heads, dim)
    assert not q_view.is_contiguous()
    qsl = layout.query_start_loc
    args = (layout.block_table, torch.arange(3), torch.from_numpy(qsl[:-1].astype(np.int64)),
            torch.from_numpy(np.diff(qsl).astype(np.int64)), torch.from_numpy(layout.seq_lens.astype(np.int64)))
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 4):
            torch.set_num_threads(n_threads)
            out = torch.full((tokens + 5, heads, dim), 7.0)
            paged_attention.paged_prefill(q_view, cache, *args, None, 0.3, out)
            torch.testing.assert_close(out[:tokens], ref, rtol=1e-5, atol=1e-5)
            assert (out[tokens:] == 7.0).all()
    finally:
        torch.set_num_threads(threads)


def test_float64_falls_back_to_the_padded_path(monkeypatch):
    """No kernel for float64: the first layer plans the padded part, later layers reuse it.
    (The padded path gathers whole page grids, null block included: no NaN pages here.)"""
    layout, cache, q, k, v = _step(4, 2, 32, CTX, QLEN, 5, seed=7)
    cache = cache.nan_to_num(0.0)
    calls = []
    backend = get_backend("torch")
    monkeypatch.setattr(paged_attention, "paged_prefill", lambda *a: calls.append(a))
    meta = backend.plan(layout, torch.device("cpu"))
    cache64 = cache.double()
    out = backend.forward(q.double(), k.double(), v.double(), cache64, meta, 0.2)
    part = meta.prefills.fallback
    assert calls == [] and part is not None
    backend.forward(q.double(), k.double(), v.double(), cache64, meta, 0.2)
    assert meta.prefills.fallback is part
    torch.testing.assert_close(out.float(), _reference(layout, cache64.float(), q, 0.2), rtol=1e-5, atol=1e-5)


def test_kernels_off_plans_the_padded_part(monkeypatch):
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
    layout, _, _, _, _ = _step(4, 2, 32, CTX, QLEN, None)
    meta = get_backend("torch").plan(layout, torch.device("cpu"))
    assert meta.prefills is None and len(meta.parts) == 1


def test_bad_inputs_raise_one_line():
    layout, cache, q, _, _ = _step(4, 2, 16, [40], [20], None)
    table, rows = layout.block_table, torch.zeros(1, dtype=torch.long)
    start, qlen, out = torch.zeros(1, dtype=torch.long), torch.tensor([20]), torch.empty_like(q)
    with pytest.raises(RuntimeError, match="request 0 has 20 queries .* more queries than keys"):
        paged_attention.paged_prefill(q, cache, table, rows, start, qlen, torch.tensor([10]), None, 1.0, out)
    with pytest.raises(RuntimeError, match="outside the block table"):
        paged_attention.paged_prefill(q, cache, table, rows, start, qlen, torch.tensor([10_000]), None, 1.0, out)
    bad = table.clone()
    bad[0, 1] = cache.shape[0] + 3
    with pytest.raises(RuntimeError, match="block id .* out of range"):
        paged_attention.paged_prefill(q, cache, bad, rows, start, qlen, torch.tensor([40]), None, 1.0, out)
    with pytest.raises(RuntimeError, match="float32"):
        paged_attention.paged_prefill(q.double(), cache.double(), table, rows, start, qlen, torch.tensor([40]), None, 1.0,
                              out.double())


def test_window_beyond_int32_equals_no_window(monkeypatch):
    """Lane masks are int32 chunk offsets: a window past 2**31 must clamp, not wrap."""
    outs = []
    for window in (None, 2 ** 40):
        layout, cache, q, k, v = _step(4, 2, 32, CTX, QLEN, window, seed=11)
        out, _, _ = _forward(layout, cache, q, k, v, 0.2, monkeypatch, [])
        outs.append(out)
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
