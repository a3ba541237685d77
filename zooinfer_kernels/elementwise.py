"""Fused CPU kernels for the elementwise parts of a decoder layer (zooinfer_kernels/cpu/fused_elementwise.cpp),
and when to use them.

In eager mode every torch op is its own pass over memory: RMSNorm is six of them, rope a
dozen, act(gate) * up three. These C++ ops do each in one pass per row (same fp32 formulas,
a few ulp apart). `use_kernel` says when they apply: eager mode only (under torch.compile the torch code stays, so inductor fuses it
itself and the graph has no opaque ops), fp32 CPU tensors, no autograd (the ops have no
backward), and the kernel library built (`ZOOINFER_CPU_KERNELS=0` turns it off).
`ENABLED = False` turns off only these ops and the fused LM head (`lm_head.GreedyHead` asks
`use_kernel` too; A/B benchmarks), not the attention kernels or the panel GEMM.

Each wrapper's torch twin is the code next to its call site in models/layers.py.
"""
from __future__ import annotations

import torch

from zooinfer_kernels import cpu_build

ENABLED = True
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}   # activation name -> the act_mul kernel's `kind`


def use_kernel(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops can run on these tensors now (eager, fp32 CPU, no grad, built)."""
    if not ENABLED or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    for t in tensors:          # a loop, not all(<genexpr>): ~0.4 us less a call, ~150 calls a step
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return cpu_build.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * (weight + offset) over the last dim; x may be a
    strided view of up to 3 dims (q or k heads of the qkv output). Returns a new tensor."""
    return torch.ops.zooinfer_cpu.rms_norm.default(x, weight, float(eps), float(offset))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                 multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x * multiplier), residual + x * multiplier), one pass; inputs untouched."""
    return torch.ops.zooinfer_cpu.add_rms_norm.default(x, residual, weight, float(eps), float(offset), float(multiplier))


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up = [tokens, 2 * I] (gate first); activation in ACTIVATIONS."""
    return torch.ops.zooinfer_cpu.act_mul.default(gate_up, ACTIVATIONS[activation])


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rope of q [T, H, D] and k [T, Hk, D] (strided views are fine) over the first
    2 * cos.shape[1] dims, cos/sin tables indexed by position. Returns new contiguous q, k."""
    return torch.ops.zooinfer_cpu.rope.default(positions, q, k, cos, sin)
