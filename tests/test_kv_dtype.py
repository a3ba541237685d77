"""KV cache dtypes (cache/kv_dtype.py) at the page level: page bytes and block counts per
dtype, bf16 / int8 pages written by the C++ store and by torch (identical bytes), and the
paged decode / prefill kernels on them against the float32 kernel on the same (rounded or
dequantized) values and against the float32 reference."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from attention import get_backend, kv_quant
from cache.kv_cache_spec import FullAttentionSpec, MLASpec, StateSpec
from cache.kv_dtype import check_specs, resolve_kv_cache_dtype
from cache.sizing import make_kv_cache_config, requests_that_fit
from zooinfer_kernels import cpu_build, paged_attention
from tests.test_cpu_prefill import _reference, _step

torch.set_num_threads(1)

needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the CPU kernels")


def test_page_bytes_and_exact_block_counts_per_kv_dtype():
    """SmolLM2-135M's shape (30 layers, 3 kv heads of 64, blocks of 16) under a 64 MiB budget.
    Page bytes per layer: fp32 2*16*3*64*4 = 24576, bf16 12288, int8 6144 of data + 2*16*3*4 =
    384 of scales = 6528. A block covers all 30 layers: 737280 / 368640 / 195840 bytes, so
    64 MiB = 67108864 B buys 91 / 182 / 342 blocks (bf16 exactly twice fp32)."""
    counts = {}
    for dtype, page in ((torch.float32, 24576), (torch.bfloat16, 12288), (torch.int8, 6528)):
        specs = {i: FullAttentionSpec(16, 3, 64, dtype) for i in range(30)}
        assert specs[0].page_size_bytes == page
        cfg = make_kv_cache_config(specs, 16, memory_bytes=64 << 20)
        assert cfg.bytes_per_block == 30 * page
        counts[dtype] = cfg.num_blocks
    assert counts == {torch.float32: 91, torch.bfloat16: 182, torch.int8: 342}
    # 90 usable blocks of 16 tokens: requests of 256 tokens (16 blocks each) that fit at once
    cfg = make_kv_cache_config({i: FullAttentionSpec(16, 3, 64, torch.bfloat16) for i in range(30)}, 16,
                               memory_bytes=64 << 20)
    assert requests_that_fit(cfg, 256) == 181 // 16


def test_state_layers_keep_float32_states():
    """A hybrid: the attention page halves in bf16, the state stays float32 bytes."""
    state = StateSpec(16, shapes=(("conv", (3, 64)), ("ssm", (4, 16, 16))), dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        cfg = make_kv_cache_config({0: state, 1: FullAttentionSpec(16, 2, 32, dtype), 2: state}, 16, num_blocks=64)
        st = next(g.spec for g in cfg.groups if isinstance(g.spec, StateSpec))
        assert st.dtype == torch.float32 and st.state_bytes == (3 * 64 + 4 * 16 * 16) * 4


def test_kv_dtype_names_and_one_line_errors():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve_kv_cache_dtype("int8", torch.float32, "cpu") == torch.int8
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, "cuda") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, int8, fp8_e4m3"):
        resolve_kv_cache_dtype("fp16", torch.float32, "cpu")
    with pytest.raises(ValueError, match="fp8_e4m3 needs device='cuda'"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.float32, "cpu")
    with pytest.raises(ValueError, match="int8 needs attention_backend='torch'"):
        resolve_kv_cache_dtype("int8", torch.float32, "cuda", "flashinfer")
    check_specs({0: StateSpec(16, shapes=(("s", (4, 4)),)), 1: FullAttentionSpec(16, 2, 32, torch.int8)}, torch.int8)
    with pytest.raises(ValueError, match=r"int8: cache 1 \(MLASpec\) has no per-token scales"):
        check_specs({0: FullAttentionSpec(16, 2, 32, torch.int8), 1: MLASpec(16, 32, 8, torch.int8)}, torch.int8)


def test_quantize_bound_and_zero_rows():
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[7, 1] = 0
    q, s = kv_quant.quantize(x)
    deq = q.float() * s[..., None]
    assert q.dtype == torch.int8 and q.abs().max() == 127 and s[7, 1] == 0 and (deq[7, 1] == 0).all()
    assert ((deq - x).abs() <= s[..., None] / 2 * (1 + 1e-6)).all()      # half a step: max|x| / 254


def _paged(cache32: torch.Tensor, dtype: torch.dtype, pad: int = 12):
    """`cache32`'s values in a `dtype` cache laid out as the runner lays out a layer: pages of
    `page_size_bytes` (+ `pad` bytes, as in a packed pool page) in one byte buffer, viewed in
    the spec's cache shape. Returns (cache, buffer, float32 cache of the values it holds)."""
    n, _, bs, heads, dim = cache32.shape
    spec = FullAttentionSpec(bs, heads, dim, dtype)
    buf = torch.zeros(n, spec.page_size_bytes + pad, dtype=torch.uint8)
    cache = buf.view(dtype)[:, : spec.view_bytes() // dtype.itemsize].view(spec.cache_shape(n))
    if dtype == torch.int8:
        clean = cache32.nan_to_num(0.0)   # int8 holds no NaN: unused slots are zeros there
        q, s = kv_quant.quantize(clean.reshape(-1, heads, dim))
        cache.copy_(q.view(cache.shape))
        kv_quant.scales_view(cache).copy_(s.view(n, 2, bs, heads))
        values = q.float().view(cache.shape) * s.view(n, 2, bs, heads, 1)
    else:
        cache.copy_(cache32)
        values = cache.float()
    return cache, buf, values


def _forward(layout, cache, q, k, v, scale):
    backend = get_backend("torch")
    return backend.forward(q, k, v, cache, backend.plan(layout, torch.device("cpu")), scale)


MIXED = dict(ctx=[1, 40, 17, 95, 33, 64], qlen=[1, 1, 17, 30, 1, 5])   # decodes, a fresh prompt, chunks


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(6, 2, 64, None), (4, 4, 24, 20), (4, 1, 256, 40)])
def test_kernels_on_bf16_and_int8_pages(dtype, heads, kv_heads, dim, window, monkeypatch):
    """A mixed batch (decodes + prefill chunks over earlier pages, shuffled blocks) through the
    backend's write + attention, C++ kernels on, against the float32 kernels on a float32 cache
    holding exactly the values the low-precision pages hold and the step's k / v rounded or
    quantized the same way. bf16: bit for bit (the conversion is exact, the arithmetic the
    same). int8: prefill bit for bit, decode within fp32 rounding (the scale is applied to the
    dot product, not to each element). The torch path (kernels off) writes identical bytes and
    attends within fp32 rounding; against the float32 reference on the original K/V int8 stays
    within 0.05 (|x| ~ N(0, 1): half a quantization step is <= 0.02 per element)."""
    assert cpu_build.available()
    layout, cache32, q, k, v = _step(heads, kv_heads, dim, MIXED["ctx"], MIXED["qlen"], window, seed=dim)
    scale = dim ** -0.5
    cache, buf, values = _paged(cache32, dtype)
    if dtype == torch.int8:
        (kq, ks), (vq, vs) = kv_quant.quantize(k), kv_quant.quantize(v)
        k_ref, v_ref = kq.float() * ks[..., None], vq.float() * vs[..., None]
    else:
        k_ref, v_ref = k.to(dtype).float(), v.to(dtype).float()
    ref_cache = values.clone()
    want = _forward(layout, ref_cache, q, k_ref, v_ref, scale)          # float32 kernels
    calls = []
    for name in ("paged_decode", "paged_prefill", "write_kv"):
        fn = getattr(paged_attention, name)
        monkeypatch.setattr(paged_attention, name, lambda *a, _f=fn, _n=name: calls.append((_n, a[0].dtype)) or _f(*a))
    got = _forward(layout, cache, q, k, v, scale)                        # kernels on dtype pages
    assert calls == [("write_kv", dtype), ("paged_decode", torch.float32), ("paged_prefill", torch.float32)]
    monkeypatch.undo()
    decode = torch.from_numpy(np.repeat(np.asarray(MIXED["qlen"]) == 1, MIXED["qlen"]))
    assert torch.isfinite(got).all()
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
        written = cache.float()
    else:
        assert torch.equal(got[~decode], want[~decode])
        torch.testing.assert_close(got[decode], want[decode], rtol=1e-5, atol=1e-6)
        written = cache.float() * kv_quant.scales_view(cache)[..., None]
    slots = layout.slot_mapping
    blk, off = slots // layout.block_size, slots % layout.block_size
    assert torch.equal(written[blk, :, off], ref_cache[blk, :, off])     # the step's K/V as stored
    # kernels off: the torch store writes the same bytes, the padded path attends
    cache_t, buf_t, _ = _paged(cache32, dtype)
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
    if dtype == torch.bfloat16:
        cache_t.copy_(cache_t.float().nan_to_num(0.0))   # the padded path gathers whole page grids
    torch_out = _forward(layout, cache_t, q, k, v, scale)
    assert torch.equal(cache_t[blk, :, off], cache[blk, :, off])
    if dtype == torch.int8:
        assert torch.equal(buf_t, buf)
    torch.testing.assert_close(torch_out, got, rtol=1e-5, atol=1e-5)
    if dtype == torch.int8:
        full = cache32.clone()
        full[blk, 0, off], full[blk, 1, off] = k, v
        err = (got - _reference(layout, full, q, scale)).abs().max().item()
        assert err < 0.05, err
