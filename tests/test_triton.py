"""The triton backend against the torch backend: same outputs, byte-identical caches.

On CPU the kernels run under Triton's interpreter, chosen per launch by the kernels module
(no TRITON_INTERPRET needed, nothing set for other test modules). Every batch here stays at
tens of programs, since each interpreted program costs milliseconds.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from attention import BatchLayout, get_backend  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _batch(reqs, heads, kv_heads, dim, bs, window=None, dtype=torch.float32, seed=0, null_dead=False):
    """A step for `reqs` = [(tokens already cached, new tokens)]: a cache holding random
    history in shuffled physical blocks (never block 0), the layout, and q/k/v as
    non-contiguous views of one fused projection, as a model produces them. With
    `null_dead`, table slots of pages wholly below every query's window point at block 0,
    as the runner does once the cache manager has freed them."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(d + n) // bs) for d, n in reqs)
    num_blocks = 1 + sum(-(-(d + n) // bs) for d, n in reqs)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).numpy()
    table = np.zeros((len(reqs), max_blocks + 2), dtype=np.int32)    # spare columns stay 0
    used = 0
    for i, (done, new) in enumerate(reqs):
        n = -(-(done + new) // bs)
        table[i, :n] = ids[used:used + n]
        used += n
        if null_dead and window:
            table[i, :max(done - window + 1, 0) // bs] = 0
    cache = torch.randn(num_blocks, 2, bs, kv_heads, dim, generator=gen).to(dtype)
    cache[0] = 0
    q_lens = np.array([n for _, n in reqs])
    seq_lens = np.array([d + n for d, n in reqs])
    positions = np.concatenate([np.arange(d, d + n) for d, n in reqs])
    rows = np.repeat(np.arange(len(reqs)), q_lens)
    slots = table[rows, positions // bs].astype(np.int64) * bs + positions % bs
    layout = BatchLayout(query_start_loc=np.concatenate(([0], np.cumsum(q_lens))), seq_lens=seq_lens,
                         block_table=torch.from_numpy(table), slot_mapping=torch.from_numpy(slots),
                         block_size=bs, sliding_window=window)
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return cache, layout, q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)


def _run(name, cache, layout, q, k, v):
    backend = get_backend(name)
    cache = cache.clone()
    out = backend.forward(q, k, v, cache, backend.plan(layout, CPU), q.shape[-1] ** -0.5)
    return out, cache


def _check(reqs, heads=4, kv_heads=2, dim=16, bs=4, window=None, dtype=torch.float32, atol=1e-5):
    batch = _batch(reqs, heads, kv_heads, dim, bs, window, dtype)
    assert not batch[2].is_contiguous()        # the kernels read q/k/v through their strides
    ref, ref_cache = _run("torch", *batch)
    out, cache = _run("triton", *batch)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    assert torch.equal(cache, ref_cache)       # the write kernel: the whole cache, every byte


def test_decode_only():
    _check([(9, 1), (1, 1), (30, 1), (16, 1)])


def test_prefill_chunks_only():
    # first chunks, one spanning two query tiles (> 16 queries), and a 2-token chunk
    _check([(0, 13), (0, 21), (0, 2)])


def test_mixed_batch_with_chunk_continuation():
    # decodes, a first chunk, later chunks after cached context, a 1-token prompt
    _check([(9, 1), (0, 13), (6, 7), (0, 1), (17, 19)])


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 2), (32, 2)])
def test_gqa(heads, kv_heads):
    # 6/2: 3 query heads per kv head (padded group); 32/2: 16 per kv head, two programs each
    _check([(5, 1), (3, 6), (0, 18)], heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window):
    # contexts far beyond the window: whole pages below it, both for decodes and chunks
    _check([(30, 1), (0, 21), (25, 7), (3, 1)], window=window)


def test_pages_below_the_window_are_never_read():
    """Dead pages point at the null block, here filled with NaN for the triton run only:
    any load of it would reach the output (NaN * 0 is NaN)."""
    cache, layout, q, k, v = _batch([(40, 1), (33, 9), (37, 2)], 4, 2, 16, 4, window=6, null_dead=True)
    assert (layout.block_table[:, 0] == 0).all()
    ref, ref_cache = _run("torch", cache, layout, q, k, v)
    cache[0] = float("nan")
    out, new_cache = _run("triton", cache, layout, q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(new_cache[1:], ref_cache[1:])


def test_head_dim_and_block_size_not_powers_of_two():
    _check([(7, 1), (0, 10), (5, 6)], dim=12, bs=3, window=7)


@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2), (torch.float64, 1e-10)])
def test_other_dtypes(dtype, atol):
    # the torch reference runs SDPA in the same dtype; the caches must still match exactly
    _check([(9, 1), (0, 13), (6, 7)], dtype=dtype, atol=atol)


def test_write_kernel_skips_padding_slots():
    from attention.triton_kernels import write_kv
    cache, layout, _, k, v = _batch([(0, 5)], 4, 2, 16, 4)
    slots = layout.slot_mapping.clone()
    slots[2] = -1
    before = cache.clone()
    write_kv(k, v, cache, slots)
    written = slots >= 0
    s = slots[written]
    assert torch.equal(cache[s // 4, 0, s % 4], k[written])
    assert torch.equal(cache[s // 4, 1, s % 4], v[written])
    untouched = torch.ones(cache.shape[0] * 4, dtype=torch.bool)
    untouched[s] = False
    assert torch.equal(cache.transpose(1, 2).reshape(-1, 2, 2, 16)[untouched],
                       before.transpose(1, 2).reshape(-1, 2, 2, 16)[untouched])


def test_backend_is_registered():
    b = get_backend("triton")
    assert b.name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*triton"):
        get_backend("nope")


PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40)]


@pytest.mark.parametrize("spec", ["zoo/smollm2-tiny.yaml", "zoo/mistral-sw-small.yaml",
                                  "zoo/gpt-oss-small.yaml"])   # sliding/full layers with attention sinks
def test_llm_greedy_matches_torch_backend(spec):
    """Whole engine, greedy: chunked prefill (16-token budget) mixes chunk continuations with
    decodes; mistral-sw-small's 24-token window frees pages of the 40-token prompt."""
    params = SamplingParams(temperature=0, max_tokens=4)
    ref = [o.outputs[0].token_ids for o in
           LLM(spec, max_model_len=64).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(spec, max_model_len=64, attention_backend="triton", max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == ref
    assert len({t for toks in ref for t in toks}) > 3     # the model does not collapse to one token


@pytest.mark.parametrize("heads, dk, dv", [(4, 16, 16), (2, 12, 80)])
def test_gated_delta_step_matches_torch(heads, dk, dv):
    """The Triton decode step of Gated DeltaNet against the torch reference, out of place and
    in place; 2/12/80 exercises padded key dims and two value blocks per head."""
    from attention.triton_kernels import gated_delta_step
    from models.gated_deltanet import l2norm, recurrent_gated_delta_step
    gen = torch.Generator().manual_seed(0)
    r = 3
    q = l2norm(torch.randn(r, heads, dk, generator=gen)) * dk ** -0.5
    k = l2norm(torch.randn(r, heads, dk, generator=gen))
    v = torch.randn(r, heads, dv, generator=gen)
    g = -torch.rand(r, heads, generator=gen)
    beta = torch.rand(r, heads, generator=gen)
    state = torch.randn(r, heads, dk, dv, generator=gen)
    ref_out, ref_state = recurrent_gated_delta_step(q, k, v, g, beta, state)
    out, new_state = gated_delta_step(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, ref_state, atol=1e-5, rtol=1e-5)
    out2, same = gated_delta_step(q, k, v, g, beta, state, new_state=state)
    assert same is state and torch.equal(state, new_state) and torch.equal(out2, out)
