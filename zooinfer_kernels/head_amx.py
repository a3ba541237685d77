"""Greedy tokens of a quantized LM head for batched steps: screened in bf16 on AMX, decided exactly.

Why: past `quant_head.QUANT_ROWS` (16 rows) a greedy step's head is the int8-activation GEMM
(`quant_linear_q8`), compute-bound on per-32-block scales: Gemma-3's 262144 x 640 Q8_0 head took
23.8 ms of a 32-request decode step at 2 threads (Emerald Rapids), a third of the throughput
workload. A bf16 copy of the head needs no scales, and AMX tiles multiply it at the weight stream's
speed (zooinfer_kernels/cpu/head_amx.cpp). Its logits s only screen:

- with W the head as the exact kernel reads it (`quant_linear`, fp32 x), W^ its bf16 rounding and
  x^ that of x, the real numbers satisfy s - e = (W^ - W) x^ + W (x^ - x), so
  |s_n - e_n| <= B = |W^ - W|_2 |x^|_2 + |W|_2 |x^ - x|_2 + K 2^-21 |W^|_2 |x^|_2 (the tiles' fp32
  sums, generously) + K 2^-120 (1 + |W^|_2) (denormal inputs and products flushed)
  + K 2^-21 |W_mag|_2 (|x|_2 + |x^|_2) (the exact kernel's fp32 rounding, `quant_head`'s term);
  |.|_2 of a weight is its largest row norm,
  measured once from the actual rounding;
- so the exact argmax n* has s_n* >= max(s) - 2B; the exact product is computed on the union of
  the columns above that threshold (`quant_head.candidates`), 16 token rows at a time (the decode
  kernel: each row's result bit for bit that of the full product), and their argmax is the answer.

`amx_argmax` therefore returns exactly the exact product's argmax taken 16 rows at a time: the
tokens `quant_head.quant_argmax` gives at up to 16 rows, now at any row count. Non-finite x makes
B non-finite: every column is a candidate, the exact product in full. The copy costs two bytes a
weight (Gemma-3: 335 MB beside its 178 MB Q8_0 head), so it is made only where AMX-BF16 runs.
(One int8 scale per row instead, half the bytes, bounded at 7-50 logits on Gemma-3's hidden
states: every column stayed a candidate.)
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build, lm_head, quant_gemm, quant_head

AMX_ROWS = range(quant_gemm.Q8_MAX_ROWS + 1, sys.maxsize)   # past `quant_head.QUANT_ROWS`: `amx_argmax` replaces the logits
VT, KT = 16, 32                                             # B tile: 16 vocab rows x 32 k (head_amx.cpp)
S_ROUNDING = 2.0 ** -21                                     # per K: the tiles' fp32 sums
FLUSH = 2.0 ** -120                                         # per K: flushed denormal inputs / products


@dataclass(frozen=True, slots=True)
class AmxHeadScreen:
    """The head rounded to bf16 as AMX B tiles, with the norms of the bound (module docstring;
    float64 maxima over rows, rounded up)."""
    tiles: torch.Tensor     # bf16 [NT, KS, 16, 32] (`pack_pair_tiles`)
    d_norm: float           # |W^ - W|_2
    w_norm: float           # |W|_2
    wb_norm: float          # |W^|_2
    mag_norm: float         # `quant_head.QuantHeadScreen.mag_norm`


def available() -> bool:
    """Whether this CPU and build run AMX-BF16 tiles (CPUID and the kernel's tile permission): the
    readiness the fp32 head's AMX screen already reports (`cpu_build.amx_available`)."""
    return cpu_build.amx_available()


def pack_pair_tiles(w: torch.Tensor) -> torch.Tensor:
    """`w [N, K]` (bf16) as TDPBF16PS B tiles [NT, KS, 16, 32]: tile (t, s) row r holds, for vocab
    rows j = 0..15, w[16t + j, 32s + 2r], w[16t + j, 32s + 2r + 1]; zero-padded to an even NT and
    KS * 32 columns."""
    n, k = w.shape
    nt, ks = 2 * -(-n // (2 * VT)), -(-k // KT)
    padded = torch.zeros(nt * VT, ks * KT, dtype=torch.bfloat16)
    padded[:n, :k] = w
    return padded.view(nt, VT, ks, VT, 2).permute(0, 2, 3, 1, 4).contiguous().view(nt, ks, VT, KT)


def _dequantized(qw) -> torch.Tensor:
    """The head's weights [n, k_pad] in float64, exactly as the fp32 kernels' formula has them:
    scale (q - zero) + min per group (the scales broadcast over each group's weights)."""
    scale, minv = qw.float_scales()
    q = qw.values().view(qw.n, -1, qw.group).double()
    w = scale.double()[..., None] * (q - qw.zero if qw.zero else q)
    return (w + minv.double()[..., None] if minv is not None else w).view(qw.n, -1)


@torch.no_grad()
def make_amx_screen(qw, screen: quant_head.QuantHeadScreen | None, chunk_rows: int = 16384) -> AmxHeadScreen | None:
    """The AMX screen of a quantized head (`models.quant.QuantWeight`) that has a `quant_head`
    screen; None without AMX-BF16, where `lm_head.screen_isa()` is not "amx" (`ZOOINFER_SCREEN_ISA`
    turns the screens off) or where a norm is not finite."""
    if screen is None or not available() or lm_head.screen_isa() != "amx":   # ZOOINFER_SCREEN_ISA=none: no copy
        return None
    wb = torch.empty(qw.n, qw.k_pad, dtype=torch.bfloat16)
    norms = [0.0, 0.0, 0.0]
    for r0 in range(0, qw.n, chunk_rows):
        w = _dequantized(quant_head._rows(qw, r0, min(qw.n, r0 + chunk_rows)))
        part = w.to(torch.bfloat16)          # float64 -> bf16 rounds once (to nearest)
        wb[r0:r0 + len(w)] = part
        wh = part.double()
        for i, t in enumerate((wh - w, w, wh)):
            norms[i] = max(norms[i], float(t.norm(dim=1).max()))
    if not all(math.isfinite(v) for v in norms):
        return None
    return AmxHeadScreen(pack_pair_tiles(wb), *(v * (1 + 2 ** -40) for v in norms), mag_norm=screen.mag_norm)


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded to bf16, rows padded to a multiple of 16 and K to one of 32 with zeros."""
    m, k = x.shape
    xb = torch.zeros(-(-m // VT) * VT, -(-k // KT) * KT, dtype=torch.bfloat16)
    xb[:m, :k] = x
    return xb


def error_bound(x: torch.Tensor, xb: torch.Tensor, screen: AmxHeadScreen) -> torch.Tensor:
    """B per row of x [M, K] (float64 [M]): |screen logit - exact logit| <= B on every vocab row."""
    m, k = x.shape
    xd, xh = x.double(), xb[:m, :k].double()
    xn, xhn, err = xd.norm(dim=1), xh.norm(dim=1), (xh - xd).norm(dim=1)
    kp = xb.shape[1]
    b = (screen.d_norm * xhn + screen.w_norm * err + kp * S_ROUNDING * screen.wb_norm * xhn
         + kp * FLUSH * (1 + screen.wb_norm) + k * quant_head.ROUNDING * screen.mag_norm * (xn + xhn))
    return b * (1 + 2 ** -30)


def screen_logits(x: torch.Tensor, screen: AmxHeadScreen, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s [M, n] float32, x^ padded): the screen logits of x [M, K] (K as the head's k_pad)."""
    xb = round_rows(x)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    torch.ops.zooinfer_cpu.head_logits_bf16_amx.default(xb, screen.tiles, n, out)
    return out, xb


def amx_argmax(x: torch.Tensor, head, screen: AmxHeadScreen) -> torch.Tensor:
    """The exact decode product's argmax (first index among ties) for the `models.quant.QuantLinear`
    head (no bias) and fp32 x [M, K], any M: module docstring. Returns int64 [M]."""
    k_pad = head.scale.shape[1] * head.group
    x2 = x.reshape(-1, head.in_features).float()
    if k_pad != head.in_features:
        x2 = F.pad(x2, (0, k_pad - head.in_features))
    s, xb = screen_logits(x2, screen, head.out_features)
    cols = quant_head.candidates(s, 2 * error_bound(x2, xb, screen))
    rows = cols if cols.numel() < head.out_features else None
    step = quant_gemm.Q8_MAX_ROWS                    # the decode kernel's rows (QUANT_ROWS): per row the full product's bits
    picks = [lm_head.argmax(quant_head._exact(x2[i:i + step], head, rows)) for i in range(0, len(x2), step)]
    return cols[torch.cat(picks)]
