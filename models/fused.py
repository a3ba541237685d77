"""Fused CPU kernels for the elementwise parts of a decoder layer, and when to use them.

In eager mode every torch op is its own pass over memory: RMSNorm is six of them, rope a
dozen, act(gate) * up three. The C++ ops in kernels/cpu/fused_elementwise.cpp do
each in one pass per row (same fp32 formulas, a few ulp apart). `use_kernel` says when they
apply: eager mode only (under torch.compile the torch code stays, so inductor fuses it
itself and the graph has no opaque ops), fp32 CPU tensors, no autograd (the ops have no
backward), and the kernel library built (`ZOOINFER_CPU_KERNELS=0` turns it off).
`ENABLED = False` turns off only these ops (A/B benchmarks), not the attention kernels.

Each wrapper's torch twin is the code next to its call site in models/layers.py.
"""
from __future__ import annotations

import sys

import torch

from kernels import cpu_build

ENABLED = True
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}   # activation name -> the act_mul kernel's `kind`
# Row counts for which `linear_argmax` (kernels/cpu/linear_argmax.cpp) beats the LM
# head product + argmax on this project's bench machine (2 threads, tiny Llama and SmolLM2
# heads): from 24 rows up, 15-45% faster (1024 rows included: it passes over the weight once
# per 64 rows, but never writes or re-reads the logits). Fewer rows leave most of its
# 16-token vector lanes empty and the product is a weight stream, where the panel kernel is
# as fast.
GREEDY_ROWS = range(24, sys.maxsize)
# Row counts for which a head with a bf16 screen (`prepack.Bf16Screen`, AMX) uses
# `screened_argmax` instead: 1.3-3.5x faster than `linear_argmax` and 1-5x than the panel
# product + argmax at 1-256 rows on the tiny Llama and SmolLM2 heads (`python -m
# bench.greedy_head`: it reads half the bytes and multiplies on AMX), and as exact.
SCREENED_ROWS = range(1, sys.maxsize)


def use_kernel(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops can run on these tensors now (eager, fp32 CPU, no grad, built)."""
    if torch.compiler.is_compiling() or not ENABLED or torch.is_grad_enabled():
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32:
            return False
    return cpu_build.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * (weight + offset) over the last dim; x may be a
    strided view of up to 3 dims (q or k heads of the qkv output). Returns a new tensor."""
    return torch.ops.zooinfer_cpu.rms_norm(x, weight, float(eps), float(offset))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                 multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x * multiplier), residual + x * multiplier), one pass; inputs untouched."""
    return torch.ops.zooinfer_cpu.add_rms_norm(x, residual, weight, float(eps), float(offset), float(multiplier))


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up = [tokens, 2 * I] (gate first); activation in ACTIVATIONS."""
    return torch.ops.zooinfer_cpu.act_mul(gate_up, ACTIVATIONS[activation])


def linear_argmax(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """`(x @ W.T).argmax(-1)` without the logits (first index of the maximum, NaN wins, as
    torch.argmax); x [M, K], W [n, K] given as its column panels (`prepack.pack_panels`).
    Returns int64 [M]."""
    return torch.ops.zooinfer_cpu.linear_argmax(x, panels, n)


def screened_argmax(x: torch.Tensor, panels: torch.Tensor, n: int, screen) -> torch.Tensor:
    """The same tokens as `linear_argmax(x, panels, n)`, screened on the head's bf16 copy
    (`screen`, a `prepack.Bf16Screen`) and decided in fp32 among the rows the screen cannot
    rule out. Returns int64 [M]."""
    return torch.ops.zooinfer_cpu.screened_argmax(x, screen.tiles, panels, n, screen.w_norm, screen.wb_norm,
                                                  screen.dw_norm)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rope of q [T, H, D] and k [T, Hk, D] (strided views are fine) over the first
    2 * cos.shape[1] dims, cos/sin tables indexed by position. Returns new contiguous q, k."""
    return torch.ops.zooinfer_cpu.rope(positions, q, k, cos, sin)
