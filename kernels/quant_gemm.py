"""Linears on quantized weights (kernels/cpu/quant_gemm*.cpp, quant_gemv_q8.cpp): the wrappers of their ops.

The layout (`models.quant.QuantWeight` builds it): w[n, k] = scale[n, k // G] * (q[n, k] - zero)
+ min[n, k // G]; 4-bit weights two per byte (a 32-weight block is 16 bytes, byte j = weight j
low nibble | weight j + 16 high nibble), 8-bit ones int8. K must be a multiple of 32 and of G.
Storage as GGUF files ship it (kernels/cpu/quant_storage.h), given by the keyword arguments:
5- / 6-bit q as the 4-bit nibbles plus `qh` (int32 high-bit planes, one word per 32-weight
block and plane), two-level scales as int8 `scale` / `minv` times float16 `scale_d` / `minv_d`
per super-block.

`isa` picks the instruction path: -1 the best this CPU has (`best_isa`), 0 scalar C++, 1 AVX2 +
FMA, 2 AVX-512; all are built into the one library (per-function target attributes), so tests
run each of them here. All need the kernel library (`cpu_build.available()`).

`quant_linear_q8` (kernels/cpu/quant_gemv_q8.cpp) is the decode product with x quantized to int8
per 32-block and VNNI integer dot products (AVX-512 VNNI only, `q8_available`): not exact, within
the bound its header states; `quantize_activations_q8` gives its int8 x for the tests.
`quant_linear_q8_gemm` (kernels/cpu/quant_gemm_q8.cpp) computes the same formula for any number of
rows, laid out as a GEMM (16 output columns per register, each N tile's weights unpacked once per
block of rows); `quant_linear_int8_act` picks between the two by row count (`Q8_GEMM_MIN_ROWS`).
"""
from __future__ import annotations

import functools

import torch

Q8_MAX_ROWS = 16    # quant_linear_q8 serves decode steps up to this many rows (DECODE_ROWS)
Q8_GEMM_MIN_ROWS = 8   # from this many rows the GEMM-ordered kernel is faster (bench.quant_linears)

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}


def best_isa() -> int:
    """The fastest instruction path this CPU runs: 2 (AVX-512 F+BW), 1 (AVX2+FMA) or 0 (scalar)."""
    return int(torch.ops.zooinfer_cpu.quant_best_isa())


def quant_linear(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                 bits: int, group: int, zero: int, bias: torch.Tensor | None, isa: int = -1, *,
                 qh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                 min_d: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, W, bias)` for fp32 x [M, K] and the quantized W [N, K] (layout above)."""
    return torch.ops.zooinfer_cpu.quant_linear(x, qs, scale, minv, bits, group, zero, bias, isa, qh, scale_d, min_d)


def dequantize(qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, bits: int, group: int,
               zero: int, k: int, isa: int = -1, *, qh: torch.Tensor | None = None,
               scale_d: torch.Tensor | None = None, min_d: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, k] in fp32 (each weight `scale * q + (min - zero * scale)`, one FMA)."""
    return torch.ops.zooinfer_cpu.quant_dequantize(qs, scale, minv, bits, group, zero, k, isa, qh, scale_d, min_d)


@functools.cache
def q8_available() -> bool:
    """Whether this CPU runs `quant_linear_q8` (AVX-512 F/BW/VL + VNNI)."""
    return bool(torch.ops.zooinfer_cpu.quant_q8_available())


def quant_linear_q8(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                    bits: int, group: int, zero: int, bias: torch.Tensor | None, *,
                    qh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                    min_d: torch.Tensor | None = None) -> torch.Tensor:
    """`quant_linear` for at most `Q8_MAX_ROWS` rows, x rounded to int8 per 32-block first."""
    return torch.ops.zooinfer_cpu.quant_linear_q8(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d)


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as `quant_linear_q8` rounds it: int8 [M, K] and one fp32 scale per 32 [M, K // 32]."""
    q, d = torch.ops.zooinfer_cpu.quantize_activations_q8(x)
    return q, d


def quant_linear_q8_gemm(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                         bits: int, group: int, zero: int, bias: torch.Tensor | None, *,
                         qh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                         min_d: torch.Tensor | None = None) -> torch.Tensor:
    """`quant_linear_q8`'s product (same rounding of x, same bound) for any number of rows."""
    return torch.ops.zooinfer_cpu.quant_linear_q8_gemm(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d)


def quant_linear_int8_act(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                          bits: int, group: int, zero: int, bias: torch.Tensor | None, **storage) -> torch.Tensor:
    """The int8-activation product on the faster kernel for x's row count: the decode kernel below
    `Q8_GEMM_MIN_ROWS` rows, the GEMM-ordered one from there on (`q8_available` must hold)."""
    op = quant_linear_q8 if x.shape[0] < Q8_GEMM_MIN_ROWS else quant_linear_q8_gemm
    return op(x, qs, scale, minv, bits, group, zero, bias, **storage)
