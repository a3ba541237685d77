"""Greedy tokens from a quantized LM head: screened with int8 activations, decided exactly.

Why: the LM head is the largest weight a decode step reads. Gemma-3-270M's tied head is
262144 x 640 in Q8_0 (178 MB, three quarters of the model's bytes); SmolLM2's is 49152 x 576
Q8_0. The exact fp32 decode product on quantized weights (zooinfer_kernels/cpu/quant_gemm.cpp) widens
every weight to fp32; the int8-activation kernel (zooinfer_kernels/cpu/quant_gemv_q8.cpp, VNNI) does
the same product in integer dot products at a fraction of the instructions, but is not exact.
A greedy step needs only the argmax, and that can be made exact cheaply:

1. a = the int8-activation product x W^T (x rounded to int8 per 32-block, `quant_linear_q8`'s
   formula; an 8-bit head, Q8_0 or int8, on a kernel of its own: zooinfer_kernels/cpu/quant_head.cpp);
2. every row n satisfies |a_n - e_n| <= B, with e the exact fp32 decode product
   (`quant_linear`), where, with x^ the rounded x and W_int the integer part the int8 kernel
   multiplies by x^ (scale * q as the kernels read q; quant_gemv_q8.cpp's header):
       B = |W_int|_2 |x - x^|_2 + K 2^-21 |W_mag|_2 (|x|_2 + |x^|_2)
   |.|_2 of a weight is its largest row norm (`QuantHeadScreen`, computed once at load). The
   first term is Cauchy-Schwarz on a - e's real-number part, sum_k W_int[n, k] (x^_k - x_k)
   (the min part is the same fp32 sums in both kernels); the second covers the fp32 rounding of
   both kernels: each rounds fewer than K / 16 + 10 times along a chain, and the magnitudes it
   rounds, |scale q| |x_k| and |zero scale| |x_k| and |min| |x_k| (q as stored), sum to at most
   |W_mag|_2 max(|x|_2, |x^|_2) by Cauchy-Schwarz again, with W_mag's row norm the sum of the
   three parts' norms;
3. the exact argmax e_n* has a_n* >= max(a) - 2B, so the exact product is computed only on the
   rows above that threshold (`quant_linear` on those rows: per row bit for bit the full
   product), and their argmax, first index among ties, is the answer.

So `quant_argmax` returns exactly `quant_linear(x, W).argmax(-1)`: the greedy tokens of the
logits path with float32 activations, whatever activations the head's linear uses, at the cost
of the int8 product plus a few hundred exact rows (`candidates` picks them in one C++ pass).
Up to `QUANT_ROWS` rows (the exact kernel's decode path, whose per-row results do not depend on
the other rows); non-finite x (its bound is not finite) makes every row a candidate: the exact
product in full, and its argmax as `lm_head.argmax` takes it (the first NaN wins).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build, lm_head, quant_gemm

QUANT_ROWS = range(1, quant_gemm.Q8_MAX_ROWS + 1)   # rows a step may have for `quant_argmax`
ROUNDING = 2.0 ** -21                               # per K: the fp32 rounding term of the bound (see above)


@dataclass(frozen=True, slots=True)
class QuantHeadScreen:
    """The norms of a quantized head that bound its int8-activation product's error, largest over
    rows, rounded up: `int_norm` of the integer part the rounded x multiplies (`scale * q` with
    the zero subtracted only for 5 / 6-bit storage, as the int8 kernel's formula folds it in:
    quant_gemv_q8.cpp), `mag_norm` of the magnitudes either kernel rounds (|scale q| + |zero
    scale| + |min| per weight, q as stored: the row's three norms summed)."""
    int_norm: float
    mag_norm: float


def _rows(qw, r0: int, r1: int):
    """Rows [r0, r1) of a `QuantWeight` as views (no copy)."""
    cut = (lambda t: None if t is None else t[r0:r1])
    return qw._replace(**{f: cut(getattr(qw, f)) for f in ("qs", "scale", "min", "qh", "scale_d", "min_d")})


@torch.no_grad()
def make_quant_screen(qw, chunk_rows: int = 16384) -> QuantHeadScreen | None:
    """The screen of a quantized head (`models.quant.QuantWeight`), or None where `quant_argmax`
    cannot run: no kernel library, no AVX-512 VNNI, or non-finite scales (no bound). Exact sums
    of q^2 per group (int32) times the scales squared, in float64, a chunk of rows at a time.
    Gated on VNNI, not on the AVX2 int8-activation path (`quant_gemm.q8_available`): the 8-bit
    heads' own kernel (`quant_head_logits_q8`, zooinfer_kernels/cpu/quant_head.cpp) is vpdpbusd only; AVX2
    CPUs take the exact head product."""
    if not (cpu_build.available() and quant_gemm.vnni_available()):
        return None
    folded = qw.bits in (5, 6)           # the int8 kernel's integer part is q - zero for these
    int_sq, mag = 0.0, 0.0
    for r0 in range(0, qw.n, chunk_rows):
        part = _rows(qw, r0, min(qw.n, r0 + chunk_rows))
        q = part.values().to(torch.int32)             # |q| <= 255: G q^2 fits int32
        groups = (lambda t: (t * t).view(part.n, -1, qw.group).sum(-1).double())    # exact sums of squares
        qz = groups(q - part.zero) if folded else groups(q)
        scale, minv = part.float_scales()
        s2 = scale.double() ** 2
        int_sq = max(int_sq, float((s2 * qz).sum(1).max()))
        row = (s2 * groups(q)).sum(1).sqrt() + (s2.sum(1) * qw.group).sqrt() * part.zero
        if minv is not None:
            row = row + (minv.double() ** 2 * qw.group).sum(1).sqrt()
        mag = max(mag, float(row.max()))
    norms = (math.sqrt(int_sq) * (1 + 2 ** -40), mag * (1 + 2 ** -40))
    return QuantHeadScreen(*norms) if all(math.isfinite(v) for v in norms) else None


def _exact(x: torch.Tensor, head, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The exact decode product of x with the head's weight (its rows `rows` only: the same
    values as those columns of the full product, each row is computed on its own)."""
    pick = (lambda t: t if t is None or rows is None else t.index_select(0, rows))
    return quant_gemm.quant_linear(x, pick(head.qs), pick(head.scale), pick(head.minv), head.bits, head.group,
                                   head.zero, None, qh=pick(head.qh), scale_d=pick(head.scale_d),
                                   min_d=pick(head.min_d))


def error_bound(x: torch.Tensor, screen: QuantHeadScreen, xq_d: tuple | None = None) -> torch.Tensor:
    """B per row of x [M, K] (float64 [M]): |int8-activation logit - exact logit| <= B for
    every vocab row (module docstring); `xq_d`: x as `quantize_activations_q8` rounds it, if known."""
    xq, d = quant_gemm.quantize_activations_q8(x) if xq_d is None else xq_d
    xd = x.double()
    xhat = xq.double() * d.double().repeat_interleave(32, dim=1)
    err, xn, xhn = (xd - xhat).norm(dim=1), xd.norm(dim=1), xhat.norm(dim=1)
    b = screen.int_norm * err + x.shape[1] * ROUNDING * screen.mag_norm * (xn + xhn)
    return b * (1 + 2 ** -30)


def quant_argmax(x: torch.Tensor, head, screen: QuantHeadScreen) -> torch.Tensor:
    """`quant_linear(x, W).argmax(-1)` for the `models.quant.QuantLinear` head (no bias) and
    fp32 x [M, K], M in `QUANT_ROWS` (module docstring). Returns int64 [M]."""
    k_pad = head.scale.shape[1] * head.group
    x2 = x.reshape(-1, head.in_features).float()
    if k_pad != head.in_features:
        x2 = F.pad(x2, (0, k_pad - head.in_features))
    xq_d = quant_gemm.quantize_activations_q8(x2)
    if _plain_8bit(head):      # Q8_0 / int8: the head's own kernel (zooinfer_kernels/cpu/quant_head.cpp)
        approx = torch.ops.zooinfer_cpu.quant_head_logits_q8.default(*xq_d, head.qs, head.scale, head.group)
    else:
        approx = quant_gemm.quant_linear_q8(x2, head.qs, head.scale, head.minv, head.bits, head.group, head.zero,
                                            None, qh=head.qh, scale_d=head.scale_d, min_d=head.min_d)
    cols = candidates(approx, 2 * error_bound(x2, screen, xq_d))   # all columns for non-finite x (a NaN / inf margin)
    # a column that is a candidate for another row only is below this row's exact maximum
    # (module docstring), so the argmax over the union is each row's; cols ascend: first index wins
    exact = _exact(x2, head, cols if cols.numel() < head.out_features else None)   # all rows: no copy
    return cols[lm_head.argmax(exact)]


def _plain_8bit(head) -> bool:
    """An 8-bit head with one fp16 / fp32 scale per group of a multiple of 32, no min, no zero."""
    return (head.bits == 8 and head.minv is None and head.zero == 0 and head.scale_d is None and head.group % 32 == 0
            and head.scale.dtype in (torch.float16, torch.float32))


def candidates(logits: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """The columns n with logits[m, n] >= max_n logits[m, n] - margin[m] for some row m, ascending
    (int64); every column where a row's maximum or threshold is not finite
    (zooinfer_kernels/cpu/quant_head.cpp)."""
    return torch.ops.zooinfer_cpu.quant_head_candidates.default(logits, margin)
