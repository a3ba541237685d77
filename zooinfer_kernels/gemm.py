"""The panel layout of linear weights and the panel GEMM (zooinfer_kernels/cpu/panel_gemm.cpp, panels.h).

A weight `[N, K]` packed once as contiguous column panels `[ceil(N/NR), K, NR]` is read in
address order, each byte once per product, so a decode step's few rows stream the weight
from DRAM at full rate (models/prepack.py decides which linears get panels and up to how
many rows they use them). The LM head kernels (`lm_head.linear_argmax`, the fp32 decision
of `lm_head.screened_argmax`) read the same panels.
"""
from __future__ import annotations

import functools

import torch

NR = 32                     # panel width (panels.h: two 16-float vectors)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """`w [N, K]` as contiguous column panels `[ceil(N/NR), K, NR]`, zero-padded past N."""
    n, k = w.shape
    full, tail = divmod(n, NR)
    panels = torch.zeros(full + (tail > 0), k, NR, dtype=w.dtype)
    with torch.no_grad():
        panels[:full] = w[:full * NR].view(full, NR, k).transpose(1, 2)
        if tail:
            panels[full, :, :tail] = w[full * NR:].T
    return panels


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` for fp32 x `[M, K]` (rows contiguous) and W `[n, K]` given as its
    panels (`pack_panels`). Needs the kernel library (`cpu_build.available()`)."""
    return torch.ops.zooinfer_cpu.panel_linear.default(x, panels, n, bias)


def panel_linear_blocked(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`panel_linear` laid out for many rows (prefill chunks, zooinfer_kernels/cpu/panel_gemm_blocked.cpp):
    x packed into 14-row tiles (6 rows and two half-panel passes without AVX-512), the partial
    sums kept in registers over k blocks of up to 768 steps, the rows split between threads. Same panels,
    same result to fp32 rounding; `zooinfer_kernels.gemm_choice` decides from how many rows it runs, by
    measuring it against MKL at start-up."""
    return torch.ops.zooinfer_cpu.panel_linear_blocked.default(x, panels, n, bias)


def panel_linear_blocked_act(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                             act: int) -> torch.Tensor:
    """`act_mul(panel_linear_blocked(x, panels, n, bias), act)` for a gate_up weight (`n` = 2I rows,
    gate first; act 0 silu, 1 gelu_tanh): `[M, I]`, bit for bit the unfused result, without the
    `[M, 2I]` product ever leaving the cache (each thread's rows run through an L2 scratch)."""
    return torch.ops.zooinfer_cpu.panel_linear_blocked_act.default(x, panels, n, bias, act)


@functools.cache
def vector_width() -> int:
    """Floats per register in the panel kernels' tiles as built here: 16 with AVX-512 (a tile spans
    a whole panel), 8 otherwise (half a panel; panels.h). Needs the kernel library."""
    return int(torch.ops.zooinfer_cpu.panel_vector_width())
