"""The torch backend against naive per-request attention: paged, varlen, GQA, mixed batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attention import BatchLayout, ForwardContext, get_backend, set_forward_context

torch.set_num_threads(1)


def _naive(q, k, v, scale, window=None):
    """q: [t, H, D] at the last t positions of k/v [L, KVH, D]; causal, optionally windowed."""
    t, heads, _ = q.shape
    L, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * scale
    pos_q = torch.arange(L - t, L)[:, None]
    kv = torch.arange(L)[None, :]
    scores = scores.masked_fill(kv > pos_q, float("-inf"))
    if window is not None:
        scores = scores.masked_fill(kv <= pos_q - window, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads, kv_heads, window", [(4, 4, None), (8, 2, None), (8, 2, 5), (4, 4, 9)])
def test_mixed_batch_matches_naive(heads, kv_heads, window):
    torch.manual_seed(0)
    bs, dim, num_blocks = 4, 8, 64
    backend = get_backend("torch")
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, bs, kv_heads, dim))
    # (already cached tokens, new tokens): decodes, a first chunk, a later chunk, a 1-token prompt
    reqs = [(9, 1), (0, 13), (6, 7), (0, 1), (15, 1)]
    perm = torch.randperm(num_blocks - 1) + 1           # scattered physical blocks, never block 0
    tables, used = np.zeros((len(reqs), 8), dtype=np.int32), 0
    full_k, full_v = [], []
    for i, (done, new) in enumerate(reqs):
        n_blocks = -(-(done + new) // bs)
        tables[i, :n_blocks] = perm[used: used + n_blocks].numpy()
        used += n_blocks
        k, v = torch.randn(done + new, kv_heads, dim), torch.randn(done + new, kv_heads, dim)
        full_k.append(k)
        full_v.append(v)
        for p in range(done):   # the earlier steps' tokens are already in the cache
            cache[tables[i, p // bs], 0, p % bs] = k[p]
            cache[tables[i, p // bs], 1, p % bs] = v[p]
    q_lens = np.array([n for _, n in reqs])
    seq_lens = np.array([d + n for d, n in reqs])
    positions = np.concatenate([np.arange(d, d + n) for d, n in reqs])
    rows = np.repeat(np.arange(len(reqs)), q_lens)
    slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
    layout = BatchLayout(query_start_loc=np.concatenate(([0], np.cumsum(q_lens))), seq_lens=seq_lens,
                         block_table=torch.from_numpy(tables), slot_mapping=torch.from_numpy(slots),
                         block_size=bs, sliding_window=window)
    meta = backend.plan(layout, torch.device("cpu"))
    q = torch.randn(int(q_lens.sum()), heads, dim)
    k = torch.cat([fk[d:] for fk, (d, _) in zip(full_k, reqs)])
    v = torch.cat([fv[d:] for fv, (d, _) in zip(full_v, reqs)])
    with set_forward_context(ForwardContext(backend, [meta])):
        out = torch.ops.zooinfer.paged_attention(q, k, v, cache, 0, dim ** -0.5)
    start = 0
    for i, (done, new) in enumerate(reqs):
        ref = _naive(q[start:start + new], full_k[i], full_v[i], dim ** -0.5, window)
        torch.testing.assert_close(out[start:start + new], ref, rtol=1e-5, atol=1e-5)
        start += new
    # The new tokens were written where the slot mapping says.
    slots_t = torch.from_numpy(slots)
    torch.testing.assert_close(cache[slots_t // bs, 0, slots_t % bs], k)
    torch.testing.assert_close(cache[slots_t // bs, 1, slots_t % bs], v)
    assert cache[0].abs().sum() == 0         # the null block is never written


def test_op_is_registered_and_needs_context():
    assert hasattr(torch.ops.zooinfer, "paged_attention")
    x = torch.zeros(1, 1, 4)
    with pytest.raises(RuntimeError, match="outside set_forward_context"):
        torch.ops.zooinfer.paged_attention(x, x, x, torch.zeros(2, 2, 4, 1, 4), 0, 1.0)


@pytest.mark.parametrize("heads, kv_heads, window", [(4, 4, None), (8, 2, 6)])
def test_sparse_decode_path_matches_padded_path(heads, kv_heads, window):
    """Decode-only steps on CPU attend straight from the pages (sampled_addmm + embedding_bag,
    no gather); half precision takes the padded gather + SDPA path. Both equal naive
    attention, over requests whose contexts differ a lot (padding would dominate)."""
    torch.manual_seed(1)
    bs, dim, num_blocks = 4, 8, 96
    backend = get_backend("torch")
    ctx = np.array([1, 3, 4, 5, 17, 30, 2, 41])
    n_blocks = -(-ctx // bs)
    perm = (torch.randperm(num_blocks - 1) + 1).numpy()
    tables = np.zeros((len(ctx), 12), dtype=np.int32)
    starts = np.concatenate(([0], np.cumsum(n_blocks)))
    for i, nb in enumerate(n_blocks):
        tables[i, :nb] = perm[starts[i]:starts[i + 1]]
    cache = torch.randn(backend.kv_cache_shape(num_blocks, bs, kv_heads, dim))
    cache[0] = 0
    pos = ctx - 1
    slots = tables[np.arange(len(ctx)), pos // bs].astype(np.int64) * bs + pos % bs
    layout = BatchLayout(query_start_loc=np.arange(len(ctx) + 1), seq_lens=ctx,
                         block_table=torch.from_numpy(tables), slot_mapping=torch.from_numpy(slots),
                         block_size=bs, sliding_window=window)
    q, k, v = torch.randn(len(ctx), heads, dim), torch.randn(len(ctx), kv_heads, dim), torch.randn(len(ctx), kv_heads, dim)
    meta = backend.plan(layout, torch.device("cpu"))
    assert meta.decodes is not None and meta.parts == []
    out = backend.forward(q, k, v, cache, meta, dim ** -0.5)
    for i, L in enumerate(ctx):   # naive reference from the (now written) cache
        pg = torch.from_numpy(tables[i, :n_blocks[i]].astype(np.int64))
        keys, values = cache[pg, 0].reshape(-1, kv_heads, dim)[:L], cache[pg, 1].reshape(-1, kv_heads, dim)[:L]
        ref = _naive(q[i:i + 1], keys, values, dim ** -0.5, window)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)
    half_cache = cache.to(torch.bfloat16)
    half_meta = backend.plan(layout, torch.device("cpu"))
    half = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), half_cache, half_meta, dim ** -0.5)
    assert half_meta.decodes.fallback is not None          # the padded path ran
    torch.testing.assert_close(half.float(), out, rtol=3e-2, atol=3e-2)
