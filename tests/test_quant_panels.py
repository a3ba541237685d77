"""The exact product on quantized weights past the decode rows (zooinfer_kernels/cpu/quant_gemm_panels.cpp):
panels dequantized into the blocked fp32 GEMM's layout and run on its register kernel equal that
GEMM on the dequantized weight bit for bit (same floats, same reduction order), bias included, on
every weight format, K tails and several 256-step k blocks, odd N (a last panel past N), chunks of
224 rows and their tails, weights of several 64-row storage tiles, and 1 or 2 threads; and stay
within tests/test_quant.py's fp32 bound of x @ dequantize(W)^T."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build
from tests.test_quant import WEIGHTS, _bound, gguf_weight

def _avx512() -> bool:
    if not cpu_build.available():
        return False
    from zooinfer_kernels import quant_gemm
    return quant_gemm.best_isa() >= 2


needs_avx512 = pytest.mark.skipif(not _avx512(), reason="needs the kernel library and an AVX-512 CPU")


def _both(qw, x: torch.Tensor, bias: torch.Tensor | None):
    """(quant_linear on the AVX-512 path, panel_linear_blocked on panels of quant_dequantize(W))."""
    from zooinfer_kernels import gemm, quant_gemm
    xp = F.pad(x, (0, qw.k_pad - qw.k))
    got = quant_gemm.quant_linear(xp, qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, bias, 2, **qw.storage)
    deq = quant_gemm.dequantize(qw.qs, qw.scale, qw.min, qw.bits, qw.group, qw.zero, qw.k_pad, 2, **qw.storage)
    return got, gemm.panel_linear_blocked(xp, gemm.pack_panels(deq), qw.n, bias)


@needs_avx512
@pytest.mark.parametrize("case", WEIGHTS, ids=[c[0] for c in WEIGHTS])
def test_panel_path_is_the_blocked_gemm_on_the_dequantized_weight(case):
    _, qw, w = case
    g = torch.Generator().manual_seed(31)
    for rows, with_bias in ((17, False), (29, True), (230, True)):   # one chunk's tiles and tails, two chunks
        x = torch.randn(rows, qw.k, generator=g)
        bias = torch.randn(qw.n, generator=g) if with_bias else None
        got, want = _both(qw, x, bias)
        assert torch.equal(got, want), (rows, (got - want).abs().max())
        ref = x @ w.T + (0 if bias is None else bias)
        assert ((got - ref).abs() <= _bound(x, qw) + 2.0 ** -23 * ref.abs()).all(), rows


@needs_avx512
@pytest.mark.parametrize("fmt", ["Q5_0", "Q6_K", "Q4_K"])
def test_panel_path_on_packed_storage_and_threads(fmt):
    """130 weight rows (three 64-row tiles of planes / two-level scales, a last panel of 2
    columns), K = 512 (two k blocks); threads split the panels: 1 and 2 threads agree bit for bit."""
    qw, w = gguf_weight(fmt, 130, 512, seed=32)
    x = torch.randn(40, qw.k, generator=torch.Generator().manual_seed(33))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, want = _both(qw, x, None)
        torch.set_num_threads(2)
        two, _ = _both(qw, x, None)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, want) and torch.equal(two, one)
    assert ((one - x @ w.T).abs() <= _bound(x, qw)).all()
