"""Greedy tokens of an LM head: the fused LM head + argmax kernels and the fast argmax over logits.

- `linear_argmax` (kernels/cpu/linear_argmax.cpp): `(x @ W.T).argmax(-1)` from the head's
  panels (`gemm.pack_panels`) without writing the logits: the product is computed with the
  tokens as vector lanes, so the argmax is a per-lane compare on each finished tile.
- `screened_argmax` (kernels/cpu/screened_argmax.cpp, needs AMX): the same tokens, screened
  on a bf16 copy of the head in AMX tiles (`Bf16Screen`, `make_screen`) and decided in fp32
  among the rows the screen's rigorous error bound cannot rule out.
- `argmax_rows` (kernels/cpu/argmax_rows.cpp): `logits.argmax(-1)` in one vectorised pass
  per row (torch's CPU argmax over the last dim is a scalar loop).
All three return exactly torch.argmax's index: the first maximum, NaN counting as the maximum.
`python -m bench.greedy_head` times them against the product + argmax they replace; the
README ("Execution") has the numbers.

`GreedyHead` is the one place that picks among them (and the torch fallbacks): the model
runner asks it for an all-greedy step's tokens, the sampler for the argmax of its logits.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from kernels import cpu_build, elementwise

# Row counts for which `linear_argmax` replaces the LM head product + argmax: from 24 rows up
# it is faster (it passes over the weight once per 64 rows but never writes or re-reads the
# logits); fewer rows leave most of its 16-token vector lanes empty, and the product is a
# weight stream where the panel GEMM is as fast.
GREEDY_ROWS = range(24, sys.maxsize)
# Row counts for which a head with a bf16 screen (AMX) takes `screened_argmax` instead: it
# reads half the bytes and multiplies on AMX, so it wins at every row count measured.
SCREENED_ROWS = range(1, sys.maxsize)

VT, KT = 16, 32             # AMX bf16 A tile: 16 rows x 32 k (screened_argmax.cpp)


def linear_argmax(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """`(x @ W.T).argmax(-1)` without the logits (first index of the maximum, NaN wins, as
    torch.argmax); x [M, K], W [n, K] given as its column panels (`gemm.pack_panels`).
    Returns int64 [M]."""
    return torch.ops.zooinfer_cpu.linear_argmax(x, panels, n)


@dataclass(frozen=True, slots=True)
class Bf16Screen:
    """The LM head in bf16 AMX tiles for `screened_argmax`, with the largest row norms of W,
    of its bf16 rounding W^ and of W - W^ (float64, from the actual rounding): they bound how
    far a bf16 logit can be from the fp32 one, which decides which rows stay candidates."""
    tiles: torch.Tensor     # bf16 [NT, KS, 16, 32], NT = 2 * ceil(N / 32), KS = ceil(K / 32)
    w_norm: float
    wb_norm: float
    dw_norm: float


def pack_bf16_tiles(w: torch.Tensor) -> torch.Tensor:
    """`w [N, K]` rounded to bf16 as AMX A tiles `[NT, KS, 16, 32]`: tile (t, s) holds
    w[16t : 16t+16, 32s : 32s+32] row-major, zero-padded to an even NT and to KS * 32 columns."""
    n, k = w.shape
    nt, ks = 2 * -(-n // (2 * VT)), -(-k // KT)
    tiles = torch.zeros(nt * VT, ks * KT, dtype=torch.bfloat16)
    with torch.no_grad():
        tiles[:n, :k] = w
    return tiles.view(nt, VT, ks, KT).transpose(1, 2).contiguous()


def make_screen(w: torch.Tensor, chunk_rows: int = 4096) -> Bf16Screen | None:
    """The bf16 screen of a contiguous fp32 CPU head weight, or None (other weights, or
    non-finite entries: no error bound then)."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous() or w.dim() != 2 or w.numel() == 0:
        return None
    norms = [0.0, 0.0, 0.0]
    with torch.no_grad():
        for start in range(0, w.shape[0], chunk_rows):   # float64 copies a chunk at a time
            wd = w[start:start + chunk_rows].double()
            wh = w[start:start + chunk_rows].bfloat16().double()
            for i, t in enumerate((wd, wh, wd - wh)):
                norms[i] = max(norms[i], float(t.norm(dim=1).max()))
    if not all(math.isfinite(v) for v in norms):
        return None
    return Bf16Screen(pack_bf16_tiles(w), *norms)


def screened_argmax(x: torch.Tensor, panels: torch.Tensor, n: int, screen: Bf16Screen) -> torch.Tensor:
    """The same tokens as `linear_argmax(x, panels, n)`, screened on the head's bf16 copy
    (`screen`) and decided in fp32 among the rows the screen cannot rule out. Returns int64 [M]."""
    return torch.ops.zooinfer_cpu.screened_argmax(x, screen.tiles, panels, n, screen.w_norm, screen.wb_norm,
                                                  screen.dw_norm)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of a float32 CPU matrix in one vectorised pass per row. Returns int64 [rows]."""
    return torch.ops.zooinfer_cpu.argmax_rows(x)


_ARGMAX_CHUNK = 128


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of a 2-D tensor, same result (the first maximal index, NaN counts as the
    maximum), faster on CPU. CPU float32 goes to `argmax_rows` when the kernel library is
    built (one vectorised pass per row, no small-op thread hand-offs). Otherwise, on CPU,
    rows longer than two chunks use chunk maxima: torch's argmax over the last dim is a
    scalar loop while `amax` is vectorised, so the chunk maxima find the first chunk holding
    the row's maximum and the argmax inside that one chunk finds the first index of it.
    Other devices: torch's argmax."""
    n, vocab = x.shape
    if x.device.type == "cpu" and x.dtype == torch.float32 and vocab and cpu_build.available():
        return argmax_rows(x)
    if vocab <= 2 * _ARGMAX_CHUNK or x.device.type != "cpu":
        return x.argmax(dim=-1)
    c = _ARGMAX_CHUNK
    full = vocab // c
    chunk_max = x[:, :full * c].reshape(n, full, c).amax(dim=-1)
    if vocab % c:
        chunk_max = torch.cat([chunk_max, x[:, full * c:].amax(dim=-1, keepdim=True)], dim=1)
    chunk = chunk_max.argmax(dim=-1)
    cols = (chunk[:, None] * c + torch.arange(c, device=x.device)).clamp_(max=vocab - 1)
    return chunk * c + x.gather(1, cols).argmax(dim=-1)


class GreedyHead:
    """How greedy tokens come out of one LM head: the only place that picks the path.

    `head` is the LM head module (None: logits only). When it carries the head's panels
    (`kind == "panel"`, `packed`, `out_features`: a `models.prepack.PackedLinear`), has no
    bias, the logits are unscaled (scaling can round two logits into a tie that the raw
    products do not have) and the fused kernels apply to the hidden states (eager, fp32 CPU,
    no grad, library built: `elementwise.use_kernel`), `tokens` skips the logits:
    `screened_argmax` when the head also carries a bf16 `screen` and the row count is in
    `SCREENED_ROWS`, else `linear_argmax` in `GREEDY_ROWS`. Otherwise the logits are computed
    and `argmax` takes their argmax. Every path gives `compute_logits(hidden).argmax(-1)` exactly.
    """

    __slots__ = ("head", "logits_scaling")

    def __init__(self, head=None, logits_scaling: float = 1.0):
        self.head = head
        self.logits_scaling = logits_scaling

    def path(self, hidden: torch.Tensor) -> str:
        """The path `tokens` takes for these hidden states: "screened_argmax", "linear_argmax",
        or "logits" (the caller computes the logits; `argmax` then picks from them)."""
        head = self.head
        if (getattr(head, "kind", None) != "panel" or head.bias is not None or self.logits_scaling != 1.0
                or not elementwise.use_kernel(hidden)):
            return "logits"
        rows = hidden.shape[0]
        if getattr(head, "screen", None) is not None and rows in SCREENED_ROWS:
            return "screened_argmax"
        return "linear_argmax" if rows in GREEDY_ROWS else "logits"

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Greedy tokens of `hidden [rows, hidden_size]` straight from the head, without logits;
        None where no fused path applies (`path` says "logits")."""
        path = self.path(hidden)
        head = self.head
        if path == "screened_argmax":
            return screened_argmax(hidden, head.packed, head.out_features, head.screen)
        if path == "linear_argmax":
            return linear_argmax(hidden, head.packed, head.out_features)
        return None

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of `logits [rows, vocab]` (module-level `argmax`)."""
        return argmax(logits)

    def __call__(self, hidden: torch.Tensor, compute_logits) -> torch.Tensor:
        """Greedy tokens of `hidden`: `tokens(hidden)`, else `argmax(compute_logits(hidden))`."""
        tokens = self.tokens(hidden)
        return tokens if tokens is not None else argmax(compute_logits(hidden))
