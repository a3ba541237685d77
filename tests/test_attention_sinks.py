"""Attention sinks (gpt-oss) at op level: every CPU-runnable attention path against a dense
float64 reference in which each head's sink logit joins the softmax denominator as a key
with no value.

Paths (each test pins which one ran): the torch backend's C++ decode and prefill kernels,
its sparse decode and padded-SDPA fallbacks (`ZOOINFER_CPU_KERNELS=0`), its padded path for
bf16, the triton kernels under the interpreter, and FlashInfer, which must refuse. Batches
mix decodes, fresh prompts, chunk continuations (keys only in the pages) and GQA, with and
without sliding windows; one test runs a prompt through chunked prefill and then decodes.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from attention import ForwardContext, get_backend, set_forward_context
from zooinfer_kernels import cpu_build
from tests.test_cpu_prefill import _reference, _step

torch.set_num_threads(1)
CPU = torch.device("cpu")

# (context after the step, query tokens this step): fresh prompts, a continuation, decodes.
CTX = [23, 40, 9, 1, 31, 18]
QLEN = [23, 12, 1, 1, 1, 5]


def _dense(layout, cache, q, scale, sinks):
    """The float64 reference with each head's sink in the denominator (float32 out)."""
    return _reference(layout, cache, q, scale, sinks).double()


def _batch(heads, kv_heads, dim, window, bs=4, seed=0, ctx=CTX, qlen=QLEN, nan=False):
    """`_step`'s batch; with `nan` the slots no request may read hold NaN (the kernels never
    read them), else zeros (the padded fallback gathers whole pages, and NaN * 0 is NaN)."""
    layout, cache, q, k, v = _step(heads, kv_heads, dim, ctx, qlen, window, bs=bs, seed=seed)
    if not nan:
        cache = cache.nan_to_num(0.0)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed + 7)) * 2
    return layout, cache, q, k, v, sinks


def _written(cache, layout, k, v):
    """The cache after the step's K/V write (what the backends attend over)."""
    cache = cache.clone()
    s = layout.slot_mapping
    cache[s // layout.block_size, 0, s % layout.block_size] = k
    cache[s // layout.block_size, 1, s % layout.block_size] = v
    return cache


def _forward(name, layout, cache, q, k, v, sinks, scale):
    """The op as a model calls it; returns (out, plan) so callers can pin the path."""
    backend = get_backend(name)
    meta = backend.plan(layout, CPU)
    with set_forward_context(ForwardContext(backend, [meta])):
        out = torch.ops.zooinfer.paged_attention(q, k, v, cache, 0, scale, sinks)
    return out, meta


SHAPES = [(4, 4, 16, None), (8, 2, 16, None), (8, 2, 16, 5), (4, 1, 32, 9)]


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the CPU kernels")
@pytest.mark.parametrize("heads, kv_heads, dim, window", SHAPES)
def test_cpu_kernels_with_sinks(heads, kv_heads, dim, window, monkeypatch):
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "1")
    assert cpu_build.available()
    layout, cache, q, k, v, sinks = _batch(heads, kv_heads, dim, window, nan=True)
    scale = dim ** -0.5
    ref = _dense(layout, _written(cache, layout, k, v), q, scale, sinks)
    out, meta = _forward("torch", layout, cache, q, k, v, sinks, scale)
    # both C++ kernels ran, no padded fallback was planned
    assert meta.decodes.kernel is not None and meta.prefills is not None
    assert meta.parts == [] and meta.prefills.fallback is None and meta.decodes.fallback is None
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    no_sink = _dense(layout, _written(cache, layout, k, v), q, scale, torch.full((heads,), -torch.inf))
    assert (out.double() - no_sink).abs().max() > 1e-2       # the sinks changed the output


@pytest.mark.parametrize("heads, kv_heads, dim, window", SHAPES)
def test_torch_fallbacks_with_sinks(heads, kv_heads, dim, window, monkeypatch):
    """Kernels off: decodes take the sparse sampled_addmm path, the rest the padded SDPA."""
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
    layout, cache, q, k, v, sinks = _batch(heads, kv_heads, dim, window, seed=1)
    scale = dim ** -0.5
    ref = _dense(layout, _written(cache, layout, k, v), q, scale, sinks)
    out, meta = _forward("torch", layout, cache, q, k, v, sinks, scale)
    assert meta.decodes.kernel is None and meta.decodes.patterns   # the sparse decode ran
    assert meta.prefills is None and len(meta.parts) == 1           # the padded SDPA ran
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_padded_path_bf16_with_sinks():
    """Half precision: decodes and prefills both take the padded SDPA path."""
    layout, cache, q, k, v, sinks = _batch(8, 2, 16, 6, seed=2)
    scale = 0.25
    ref = _dense(layout, _written(cache, layout, k, v).bfloat16(), q.bfloat16(), scale, sinks.bfloat16())
    out, meta = _forward("torch", layout, cache.bfloat16(), q.bfloat16(), k.bfloat16(), v.bfloat16(),
                         sinks.bfloat16(), scale)
    assert meta.decodes.fallback is not None
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_chunked_prefill_then_decode_with_sinks(kernels, monkeypatch):
    """One 23-token prompt in chunks of 7, 9 and 7, then 3 decodes, through the same pages; a
    sliding window of 6 so later chunks see keys only in the pages and dead pages are skipped."""
    if kernels == "1" and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", kernels)
    heads, kv_heads, dim, window, bs = 8, 2, 16, 6, 4
    gen = torch.Generator().manual_seed(5)
    total = 26
    q_all = torch.randn(total, heads, dim, generator=gen)
    k_all = torch.randn(total, kv_heads, dim, generator=gen)
    v_all = torch.randn(total, kv_heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    backend = get_backend("torch")
    n_pages = -(-total // bs)
    table = torch.from_numpy((np.random.default_rng(0).permutation(n_pages) + 1).astype(np.int32)[None, :])
    cache = torch.zeros(n_pages + 1, 2, bs, kv_heads, dim)
    from attention import BatchLayout
    done = 0
    for n in [7, 9, 7, 1, 1, 1]:
        pos = np.arange(done, done + n)
        slots = torch.from_numpy(table[0, pos // bs].numpy().astype(np.int64) * bs + pos % bs)
        layout = BatchLayout(query_start_loc=np.array([0, n]), seq_lens=np.array([done + n]),
                             block_table=table, slot_mapping=slots, block_size=bs, sliding_window=window)
        meta = backend.plan(layout, CPU)
        with set_forward_context(ForwardContext(backend, [meta])):
            out = torch.ops.zooinfer.paged_attention(q_all[done:done + n], k_all[done:done + n],
                                                     v_all[done:done + n], cache, 0, 0.3, sinks)
        ref = _dense(layout, cache, q_all[done:done + n], 0.3, sinks)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        done += n


def test_triton_with_sinks():
    """The triton kernels under the interpreter (small grid: a few tens of programs)."""
    pytest.importorskip("triton")
    ctx, qlen = [19, 6, 11, 1], [19, 1, 4, 1]
    layout, cache, q, k, v, sinks = _batch(4, 2, 16, None, ctx=ctx, qlen=qlen, seed=3)
    ref = _dense(layout, _written(cache, layout, k, v), q, 0.25, sinks)
    out, _ = _forward("triton", layout, cache.clone(), q, k, v, sinks, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    layout, cache, q, k, v, sinks = _batch(4, 2, 16, 5, ctx=ctx, qlen=qlen, seed=4)
    ref = _dense(layout, _written(cache, layout, k, v), q, 0.25, sinks)
    out, _ = _forward("triton", layout, cache.clone(), q, k, v, sinks, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_flashinfer_refuses_sinks():
    """FlashInfer's paged wrappers take no sinks: the backend says so instead of dropping them."""
    from attention.flashinfer_backend import FlashInferAttentionBackend
    backend = object.__new__(FlashInferAttentionBackend)   # no GPU here; forward refuses before any CUDA work
    x = torch.zeros(1, 2, 8)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        backend.forward(x, x, x, torch.zeros(2, 2, 4, 2, 8), None, 1.0, sinks=torch.zeros(2))
