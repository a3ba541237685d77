"""MKL-packed weights for the CPU float32 linears (`prepack_linears`).

Why: `F.linear` on CPU runs MKL sgemm, which re-packs the weight (B matrix) into its
blocked layout on every call. For a prefill chunk of 2048 rows that costs little, but a
decode step multiplies 1-64 rows by each weight, and there packing the weight costs about
as much as the product itself. `cblas_sgemm_pack` packs it once at load; every call then
runs `cblas_sgemm_compute` on the packed copy. On this project's bench machine (2 threads)
that is 1.2-2x faster for 32-64-row products and equal for 2048-row ones; end to end +8%
(tiny Llama) and +18% (SmolLM2-135M) tokens/s (see the closing note of issue 7).

How: torch ships the two MKL calls as `torch.ops.mkl._mkl_reorder_linear_weight` and
`torch.ops.mkl._mkl_linear` (inductor's weight freezing uses them). `_mkl_linear` computes
with the packed weight only when the row count equals its `prepack_batch_size` argument and
otherwise falls back to a plain linear; MKL's packed layout for B does not depend on the row
count (its size is the same for every M, and results match for M from 1 to 2048), so we pass
the actual row count on every call. Because that reuse is an observation, not a documented
MKL promise, each weight is checked right after packing against `F.linear` at several row
counts; a weight that fails stays a plain `nn.Linear` (and a warning says so).

Under torch.compile the packed product runs as the opaque custom op `zooinfer::packed_linear`
(dynamo cannot trace an MKL-DNN tensor), which finds the packed weight by key.

Memory: the packed copy is as large as the weight (the allocation is larger but its tail is
never touched), and the original stays (ties, state dicts and fallbacks use it), so packed
linears take twice their weight bytes. `EngineConfig.prepack_weights=False` turns it off.
"""
from __future__ import annotations

import itertools
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

_PACKED: dict[int, torch.Tensor] = {}    # key -> packed weight, for the compiled path
_keys = itertools.count()
_CHECK_ROWS = (1, 3, 17, 64)


def supported() -> bool:
    """Whether this torch build has the MKL packed-GEMM ops."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


@torch.library.custom_op("zooinfer::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed with the packed copy of `weight` registered under `key`."""
    return _packed_matmul(x, _PACKED[key], weight, bias)


@packed_linear.register_fake
def _(x, weight, bias, key):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(nn.Module):
    """An `nn.Linear` whose product runs on an MKL-packed copy of its weight. Holds the
    same `weight` / `bias` Parameters as the module it replaces (ties survive)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = packed                 # MKL-DNN tensor: a plain attribute, not a buffer
        self.key = next(_keys)
        _PACKED[self.key] = packed
        weakref.finalize(self, _PACKED.pop, self.key, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.zooinfer.packed_linear(x, self.weight, self.bias, self.key)
        return _packed_matmul(x, self.packed, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, mkl_packed"


def _pack(linear: nn.Linear) -> torch.Tensor | None:
    """The packed weight, or None when this weight cannot use it or the check fails."""
    w = linear.weight
    if w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous() or w.numel() == 0:
        return None
    b = linear.bias
    if b is not None and (b.dtype != torch.float32 or b.device.type != "cpu"):
        return None
    with torch.no_grad():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), 64)
        gen = torch.Generator().manual_seed(0)
        for rows in _CHECK_ROWS:
            x = torch.randn(rows, w.shape[1], generator=gen)
            want = F.linear(x, w, b)
            got = _packed_matmul(x, packed, w.detach(), None if b is None else b.detach())
            tol = 1e-4 * (1.0 + want.abs().max().item())
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=tol):
                return None
    return packed


def prepack_linears(model: nn.Module) -> int:
    """Replace every CPU float32 `nn.Linear` of `model` with a `PackedLinear`; returns how
    many were packed. A no-op (0) when MKL is missing."""
    if not supported():
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    packed, failed = 0, []
    for parent, name, child in targets:
        p = _pack(child)
        if p is None:
            if child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                failed.append(name)
            continue
        setattr(parent, name, PackedLinear(child, p))
        packed += 1
    if failed:
        warnings.warn(f"MKL packed weights disagreed with F.linear for {len(failed)} linear(s) "
                      f"(e.g. {failed[0]!r}); those stay unpacked", RuntimeWarning, stacklevel=2)
    return packed
