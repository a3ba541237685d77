"""Linears on quantized weights (zooinfer_kernels/cpu/quant_gemm*.cpp, quant_gemv_q8.cpp): the wrappers of their ops.

The layout (`models.quant.QuantWeight` builds it): w[n, k] = scale[n, k // G] * (q[n, k] - zero)
+ min[n, k // G]; 4-bit weights two per byte (a 32-weight block is 16 bytes, byte j = weight j
low nibble | weight j + 16 high nibble), 8-bit ones int8. K must be a multiple of 32 and of G.
Storage as GGUF files ship it (zooinfer_kernels/cpu/quant_storage.h), given by the keyword arguments:
5- / 6-bit q as the 4-bit nibbles plus `qh` (int32 high-bit planes, one word per 32-weight
block and plane), two-level scales as int8 `scale` / `minv` times float16 `scale_d` / `minv_d`
per super-block.

`isa` picks the instruction path: -1 the best this CPU has (`best_isa`), 0 scalar C++, 1 AVX2 +
FMA, 2 AVX-512; all are built into the one library (per-function target attributes), so tests
run each of them here. All need the kernel library (`cpu_build.available()`).

`quant_linear_q8` (zooinfer_kernels/cpu/quant_gemv_q8.cpp) is the decode product with x quantized to int8
per 32-block and integer dot products: not exact, within the bound its header states;
`quantize_activations_q8` gives its int8 x for the tests. `quant_linear_q8_gemm`
(zooinfer_kernels/cpu/quant_gemm_q8.cpp) computes the same formula for any number of rows, laid out as a
GEMM (16 output columns per register, each N tile's weights unpacked once per block of rows);
`quant_linear_int8_act` picks between the two by row count (`q8_gemm_min_rows`). Their `isa`:
-1 the best this CPU has (`q8_best_isa`), 2 the AVX-512 VNNI kernels above, 1 AVX2 + FMA
(zooinfer_kernels/cpu/quant_q8_avx2.cpp: vpmaddubsw, the decode op in row order, the GEMM op in GEMM order
for 4-bit weights; the path of CPUs without VNNI, and forced by tests on VNNI CPUs); the GEMM op
also takes 3, AMX-INT8 tiles (zooinfer_kernels/cpu/quant_gemm_amx.cpp: the VNNI kernel's bits;
opt-in, never picked by -1: measured slower than VNNI so far, see its header). On every path an
op's rows do not depend on the row count.

`quant_linear_bf16_amx` (zooinfer_kernels/cpu/quant_gemm_bf16.cpp) multiplies prefill-sized x on AMX-BF16
tiles: x and the dequantized weight rounded to bf16, summed in fp32 (not exact, within the bound its
header states). `activations: int8_bf16` (`ACT_CODES`) runs it from `BF16_MIN_ROWS` rows where AMX-BF16
runs and int8 activations below (of the kind of OpenVINO's CPU defaults on AMX).
"""
from __future__ import annotations

import functools

import torch

Q8_MAX_ROWS = 16    # quant_linear_q8 serves decode steps up to this many rows (DECODE_ROWS)
# From this many rows the GEMM-ordered kernel is faster, per int8 path (`python -m bench.quant_linears
# --rows 4,5,6,8 --paths q8-decode,q8-gemm`; AMX Xeon, VNNI, 2 threads: 4 rows 6.7 / 7.5 ms, 5 rows
# 8.6 / 7.6): AVX-512 VNNI 5 (its GEMM runs two column tiles per register tile), AVX2 8.
Q8_GEMM_MIN_ROWS = {2: 5, 1: 8}

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}

# `quantization.activations` (models/spec.py QUANT_ACTIVATIONS) as the products' code: x in fp32 (exact),
# int8 per 32-block at every row count, or int8 below BF16_MIN_ROWS and bf16 on AMX from there on.
ACT_CODES = {"float32": 0, "int8": 1, "int8_bf16": 2}
# From this many rows the AMX-BF16 product is faster than the int8 GEMM (it dequantizes the whole
# weight once per call, ~0.45 cycles a weight): Emerald Rapids, 2 threads, bf16 / int8 GEMM ms, Gemma-3's
# 72 Q4_K / Q5_0 / Q6_K linears at 33 / 48 / 64 / 1024 rows 11.8 / 10.8, 12.1 / 13.5, 13.2 / 16.6,
# 105 / 210; SmolLM2's 120 int4_asym ones (`python -m bench.quant_linears --paths q8-gemm,bf16-amx`)
# at 32 / 48 / 64 / 512 rows 13.3 / 10.9, 15.2 / 13.9, 16.6 / 17.4, 62.7 / 113.
BF16_MIN_ROWS = 64


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


Q8_ISA_NAMES = {1: "avx2", 2: "avx512_vnni"}


@functools.cache
def q8_best_isa() -> int:
    """The int8-activation path this CPU runs: 2 (AVX-512 F/BW/VL + VNNI), 1 (AVX2 + FMA) or 0 (none)."""
    return int(torch.ops.zooinfer_cpu.quant_q8_best_isa())


def q8_available() -> bool:
    """Whether this CPU runs the int8-activation products (`q8_best_isa() > 0`: AVX2 + FMA at least)."""
    return q8_best_isa() > 0


def vnni_available() -> bool:
    """Whether this CPU has the AVX-512 VNNI int8 kernels (isa 2; `quant_head_logits_q8` needs them)."""
    return q8_best_isa() == 2


@functools.cache
def q8_amx_available() -> bool:
    """Whether `quant_linear_q8_gemm(..., isa=3)` runs here (AMX-INT8 tiles, granted by the OS)."""
    return bool(torch.ops.zooinfer_cpu.quant_q8_amx_available())


def quant_linear_q8(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                    bits: int, group: int, zero: int, bias: torch.Tensor | None, *,
                    qh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                    min_d: torch.Tensor | None = None, isa: int = -1) -> torch.Tensor:
    """`quant_linear` for at most `Q8_MAX_ROWS` rows, x rounded to int8 per 32-block first (`isa`: above)."""
    return torch.ops.zooinfer_cpu.quant_linear_q8(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d, isa)


def quantize_activations_q8(x: torch.Tensor, isa: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as `quant_linear_q8` rounds it: int8 [M, K] and one fp32 scale per 32 [M, K // 32]
    (the same values on either `isa`)."""
    q, d = torch.ops.zooinfer_cpu.quantize_activations_q8(x, isa)
    return q, d


def quant_linear_q8_gemm(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                         bits: int, group: int, zero: int, bias: torch.Tensor | None, *,
                         qh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                         min_d: torch.Tensor | None = None, isa: int = -1) -> torch.Tensor:
    """`quant_linear_q8`'s product (same rounding of x, same bound) for any number of rows."""
    return torch.ops.zooinfer_cpu.quant_linear_q8_gemm(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d, isa)


@functools.cache
def q8_gemm_min_rows() -> int:
    """Rows from which this CPU's int8 path runs the GEMM-ordered kernel (`Q8_GEMM_MIN_ROWS`)."""
    return Q8_GEMM_MIN_ROWS.get(q8_best_isa(), 8)


def q8_op(rows: int):
    """The int8-activation op for `rows` rows of x: `quant_linear_q8` (decode) below
    `q8_gemm_min_rows()`, `quant_linear_q8_gemm` from there (the one place that picks)."""
    ops = torch.ops.zooinfer_cpu
    return ops.quant_linear_q8.default if rows < q8_gemm_min_rows() else ops.quant_linear_q8_gemm.default


@functools.cache
def bf16_amx_available() -> bool:
    """Whether `quant_linear_bf16_amx` runs here (AMX-BF16 tiles granted by the OS, AVX512-BF16, the
    native build)."""
    return bool(torch.ops.zooinfer_cpu.quant_bf16_amx_available())


def quant_linear_bf16_amx(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                          bits: int, group: int, zero: int, bias: torch.Tensor | None, *,
                          qh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                          min_d: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times the quantized W on AMX-BF16 tiles: x and W rounded to bf16, fp32 sums, + bias."""
    return torch.ops.zooinfer_cpu.quant_linear_bf16_amx(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d)


def quant_linear_int8_act(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                          bits: int, group: int, zero: int, bias: torch.Tensor | None, *,
                          qh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                          min_d: torch.Tensor | None = None, act: int = 1) -> torch.Tensor:
    """The int8-activation product on the faster kernel for x's row count (`q8_op`; `q8_available`
    must hold); with `act` 2 (`ACT_CODES`) from `BF16_MIN_ROWS` rows the AMX-BF16 one where it runs."""
    if act == 2 and x.shape[0] >= BF16_MIN_ROWS and bf16_amx_available():
        return quant_linear_bf16_amx(x, qs, scale, minv, bits, group, zero, bias, qh=qh, scale_d=scale_d, min_d=min_d)
    return q8_op(x.shape[0])(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d, -1)


def bound_mode(act: int) -> int:
    """Which kernels `bind` calls for the activation code `act` (`ACT_CODES`) here: 0 the exact
    `quant_linear`, 1 int8 activations at every row count (`q8_op`), 2 int8 below `BF16_MIN_ROWS`
    rows and `quant_linear_bf16_amx` from there. The C++ layer stack (cpu/decode_stack.cpp) takes
    its linears' kernels from this and `q8_gemm_min_rows`, so it picks as `bind` does."""
    if not (act and q8_available()):
        return 0
    return 2 if act == 2 and bf16_amx_available() else 1


def bind(qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, bits: int, group: int, zero: int,
         bias: torch.Tensor | None, act: int, *, qh: torch.Tensor | None = None,
         scale_d: torch.Tensor | None = None, min_d: torch.Tensor | None = None):
    """The product on one weight with every argument but x bound: `run(x)` for float32 x [M, K] (K the
    weight's, a multiple of 32 and of the group) runs the op `quant_linear_int8_act` (`act` 1 or 2,
    `ACT_CODES`) or `quant_linear` (`act` 0) would, with the same arguments, so the same values. Why: a
    `QuantLinear` that gathers its buffers and picks an op on every call spends ~8 us of Python a call
    (Zen 5, 2 threads), about 1 ms of a SmolLM2 decode step of ~10 (120 calls); bound once it is one
    op call."""
    mode = bound_mode(act)
    if mode:
        if mode == 2:
            bf16 = torch.ops.zooinfer_cpu.quant_linear_bf16_amx.default

            def run(x: torch.Tensor) -> torch.Tensor:
                if x.shape[0] >= BF16_MIN_ROWS:
                    return bf16(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d)
                return q8_op(x.shape[0])(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d, -1)
        else:
            def run(x: torch.Tensor) -> torch.Tensor:
                return q8_op(x.shape[0])(x, qs, scale, minv, bits, group, zero, bias, qh, scale_d, min_d, -1)
    else:
        exact = torch.ops.zooinfer_cpu.quant_linear.default

        def run(x: torch.Tensor) -> torch.Tensor:
            return exact(x, qs, scale, minv, bits, group, zero, bias, -1, qh, scale_d, min_d)
    return run
