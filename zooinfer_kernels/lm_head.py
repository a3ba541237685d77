"""Greedy tokens of an LM head: the fused LM head + argmax kernels and the fast argmax over logits.

- `linear_argmax` (zooinfer_kernels/cpu/linear_argmax.cpp): `(x @ W.T).argmax(-1)` from the head's
  panels (`gemm.pack_panels`) without writing the logits: the product is computed with the
  tokens as vector lanes, so the argmax is a per-lane compare on each finished tile.
- `screened_argmax`: the same tokens, screened on a low-precision copy of the head
  (`HeadScreen`, `make_screen`) and decided in fp32 among the rows the screen's rigorous error
  bound cannot rule out. The screen pass runs on the best instruction set the CPU has
  (`usable_screen_isas`): AMX tiles on a bf16 copy (zooinfer_kernels/cpu/screened_argmax.cpp), else
  AVX-512 BF16 (VDPBF16PS, zooinfer_kernels/cpu/screened_lanes.cpp), else AVX2 on an int16 copy
  (VPMADDWD, zooinfer_kernels/cpu/screened_i16.cpp); each needs its own layout of the copy.
- `quant_head.quant_argmax` (zooinfer_kernels/quant_head.py): a quantized head (`models.quant.QuantLinear`
  carrying a `quant_screen`), screened with int8 activations and decided on the exact product.
- `argmax_rows` (zooinfer_kernels/cpu/argmax_rows.cpp): `logits.argmax(-1)` in one vectorised pass
  per row (torch's CPU argmax over the last dim is a scalar loop).
All return exactly torch.argmax's index: the first maximum, NaN counting as the maximum.
`python -m bench.greedy_head` times them against the product + argmax they replace; the
README ("Execution") has the numbers.

`GreedyHead` is the one place that picks among them (and the torch fallbacks): the model
runner asks it for an all-greedy step's tokens, the sampler for the argmax of its logits.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from zooinfer_kernels import cpu_build, elementwise, gemm, head_amx, quant_head

# Row counts for which `linear_argmax` replaces the LM head product + argmax: from 24 rows up
# it is faster (it passes over the weight once per 64 rows but never writes or re-reads the
# logits); fewer rows leave most of its 16-token vector lanes empty, and the product is a
# weight stream where the panel GEMM is as fast.
GREEDY_ROWS = range(24, sys.maxsize)
# ... per vector width of the kernel build (`gemm.vector_width`): with AVX2's 16 registers the token-lane
# tiles hold 16 tokens, and the panel product + argmax measured faster at every row count from 24
# (`python -m bench.greedy_head` on Zen 3: 32 rows 42-48 ms against 54-100, 64 rows 83-107 against
# 95-159), so there the fused fp32 kernel serves only the screen's decisions.
GREEDY_ROWS_BY_WIDTH = {16: GREEDY_ROWS, 8: range(0)}
# Row counts for which a head with a screen takes `screened_argmax` instead, per screen
# instruction set (`python -m bench.greedy_head`): AMX reads half the bytes and multiplies
# several times faster, so it wins at every row count measured; so does VDPBF16PS (half the
# bytes, twice the fp32 FMA rate) and so does the AVX2 int16 screen (half the bytes, VPMADDWD
# at twice the fp32 FMA rate). A row count must be in both `SCREENED_ROWS` (the switch for
# every set: tests empty it to turn the screen off) and its set's range.
SCREENED_ROWS = range(1, sys.maxsize)
SCREENED_ROWS_BY_ISA = {"amx": SCREENED_ROWS, "avx512_bf16": SCREENED_ROWS, "avx2": SCREENED_ROWS}
SCREEN_ISAS = ("amx", "avx512_bf16", "avx2")   # preference order
SCREEN_ISA_ENV = "ZOOINFER_SCREEN_ISA"           # force one ("amx", "avx512_bf16", "avx2") or "none"

VT, KT = 16, 32             # AMX bf16 A tile: 16 rows x 32 k (screened_argmax.cpp)
RV = 4                      # the pair layouts pad the vocab tiles to a multiple of this
INT32_MAX = 2 ** 31 - 1


def linear_argmax(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """`(x @ W.T).argmax(-1)` without the logits (first index of the maximum, NaN wins, as
    torch.argmax); x [M, K], W [n, K] given as its column panels (`gemm.pack_panels`).
    Returns int64 [M]."""
    return torch.ops.zooinfer_cpu.linear_argmax.default(x, panels, n)


@dataclass(frozen=True, slots=True)
class HeadScreen:
    """The LM head rounded for `screened_argmax`, laid out for the screen's instruction set
    `isa` (bf16 for "amx" and "avx512_bf16"; int16 levels times one `scale` for "avx2"), with
    the largest row norms of W, of its rounding W^ and of W - W^ (float64, from the actual
    rounding): they bound how far a screen logit can be from the fp32 one, which decides which
    rows stay candidates. `qmax`: the int16 copy's largest |level| (its int32 sums' room)."""
    tiles: torch.Tensor     # "amx": `pack_bf16_tiles`; "avx512_bf16": `pack_bf16_pairs`; "avx2": `pack_i16_pairs`
    w_norm: float
    wb_norm: float
    dw_norm: float
    isa: str = "amx"
    scale: float = 0.0
    qmax: int = 0


def usable_screen_isas() -> list[str]:
    """The screen instruction sets this CPU can run, best first (AMX, AVX-512 BF16, AVX2):
    measured at run time (CPUID, and for AMX the kernel's permission); [] without the kernel
    library."""
    if not cpu_build.available():
        return []
    ops = torch.ops.zooinfer_cpu
    return [isa for isa, ok in (("amx", cpu_build.amx_available()), ("avx512_bf16", ops.bf16_screen_available()),
                                ("avx2", ops.i16_screen_available())) if ok]


def screen_isa() -> str | None:
    """The instruction set a new screen uses: the best usable one, or the one
    `ZOOINFER_SCREEN_ISA` names ("none": no screen); None where none applies. A forced value
    this CPU cannot run is an error naming the variable."""
    have = usable_screen_isas()
    forced = os.environ.get(SCREEN_ISA_ENV, "").strip().lower()
    if not forced:
        return have[0] if have else None
    if forced == "none":
        return None
    if forced not in have:
        raise ValueError(f"{SCREEN_ISA_ENV}={forced!r} is not usable on this CPU (usable: {', '.join(have) or 'none'})")
    return forced


def pack_bf16_tiles(w: torch.Tensor) -> torch.Tensor:
    """`w [N, K]` rounded to bf16 as AMX A tiles `[NT, KS, 16, 32]`: tile (t, s) holds
    w[16t : 16t+16, 32s : 32s+32] row-major, zero-padded to an even NT and to KS * 32 columns."""
    n, k = w.shape
    nt, ks = 2 * -(-n // (2 * VT)), -(-k // KT)
    tiles = torch.zeros(nt * VT, ks * KT, dtype=torch.bfloat16)
    with torch.no_grad():
        tiles[:n, :k] = w
    return tiles.view(nt, VT, ks, KT).transpose(1, 2).contiguous()


def pack_bf16_pairs(w: torch.Tensor) -> torch.Tensor:
    """`w [N, K]` rounded to bf16 with vocab rows as vector lanes, `[NT, KP, 32]`: tile t, k
    pair p holds (w[16t + r, 2p], w[16t + r, 2p + 1]) for r = 0..15, zero-padded past N, to
    NT a multiple of RV tiles, and to 2 * KP columns."""
    pairs = _padded_pairs(*w.shape, torch.bfloat16)
    with torch.no_grad():
        pairs[:w.shape[0], :w.shape[1]] = w
    return _to_lanes(pairs)


def _padded_pairs(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros for an [n, k] head in a pair layout: rows to whole register blocks of RV vocab
    tiles, columns to whole k pairs."""
    return torch.zeros(RV * -(-n // (RV * VT)) * VT, 2 * -(-k // 2), dtype=dtype)


def _to_lanes(padded: torch.Tensor) -> torch.Tensor:
    """`_padded_pairs` rows as `[NT, KP, 32]`: vocab rows as lanes, k pairs adjacent."""
    rows, cols = padded.shape
    return padded.view(rows // VT, VT, cols // 2, 2).transpose(1, 2).reshape(rows // VT, cols // 2, 2 * VT).contiguous()


def unpack_pairs(pairs: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The `[n, k]` matrix a pair layout (`pack_bf16_pairs`, `pack_i16_pairs`) holds (a view
    where it can be)."""
    nt, kp, _ = pairs.shape
    return pairs.view(nt, kp, VT, 2).permute(0, 2, 1, 3).reshape(nt * VT, kp * 2)[:n, :k]


def i16_levels(k: int) -> int:
    """The largest |level| of an int16 head copy with k columns: the int32 sums of the AVX2
    screen hold 2 * ceil(k / 2) products of a weight level and an x level, and x gets about 4x
    the weight's levels (hidden states' outlier features set each token's scale; one scale
    serves the whole head): Qw = sqrt(budget / 4), budget = (2^31 - 1) / (2 ceil(k / 2))."""
    budget = INT32_MAX // (2 * -(-k // 2))
    return max(1, min(32767, math.isqrt(budget // 4)))


def pack_i16_pairs(w: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`w [N, K]` as int16 levels of one scale, `w ~ scale * q`, in the lane layout of
    `pack_bf16_pairs` (`[NT, KP, 32]`: tile t, k pair p holds (q[16t + r, 2p], q[16t + r,
    2p + 1]) for r = 0..15, zero-padded). Returns (q, scale); scale 0 for an all-zero w."""
    n, k = w.shape
    levels = i16_levels(k)
    amax = float(w.abs().max()) if w.numel() else 0.0
    scale = float(torch.tensor(amax / levels, dtype=torch.float32))    # the fp32 scale the kernel multiplies by
    q = _padded_pairs(n, k, torch.int16)
    if scale > 0:
        with torch.no_grad():
            q[:n, :k] = torch.round(w / scale).clamp_(-levels, levels).to(torch.int16)
    return _to_lanes(q), scale


def make_screen(w: torch.Tensor, isa: str | None = None, chunk_rows: int = 4096) -> HeadScreen | None:
    """The screen of a contiguous fp32 CPU head weight for `isa` (default `screen_isa()`): a bf16
    copy, or for "avx2" an int16 one; None where none applies (no usable instruction set, other
    weights, or non-finite entries: no error bound)."""
    isa = screen_isa() if isa is None else isa
    if isa is None:
        return None
    if isa not in SCREEN_ISAS:
        raise ValueError(f"make_screen: isa must be one of {', '.join(SCREEN_ISAS)}, got {isa!r}")
    if w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous() or w.dim() != 2 or w.numel() == 0:
        return None
    if not bool(torch.isfinite(w).all()):
        return None
    scale, qmax = 0.0, 0
    if isa == "avx2":
        tiles, scale = pack_i16_pairs(w)
        qmax = int(tiles.abs().max())
        levels = unpack_pairs(tiles, *w.shape)       # the actual rounding, for its norms
        rounded = (lambda r0, r1: levels[r0:r1].double() * scale)    # exact: an int16 times an fp32 scale
    else:
        tiles = pack_bf16_tiles(w) if isa == "amx" else pack_bf16_pairs(w)
        rounded = (lambda r0, r1: w[r0:r1].bfloat16().double())
    norms = [0.0, 0.0, 0.0]
    with torch.no_grad():
        for start in range(0, w.shape[0], chunk_rows):   # float64 copies a chunk at a time
            wd, wh = w[start:start + chunk_rows].double(), rounded(start, start + chunk_rows)
            for i, t in enumerate((wd, wh, wd - wh)):
                norms[i] = max(norms[i], float(t.norm(dim=1).max()))
    if not all(math.isfinite(v) for v in norms):
        return None
    return HeadScreen(tiles, *norms, isa=isa, scale=scale, qmax=qmax)


def screened_argmax(x: torch.Tensor, panels: torch.Tensor, n: int, screen: HeadScreen) -> torch.Tensor:
    """The same tokens as `linear_argmax(x, panels, n)`, screened on the head's rounded copy
    (`screen`) and decided in fp32 among the rows the screen cannot rule out. Returns int64 [M]."""
    ops = torch.ops.zooinfer_cpu
    if screen.isa == "amx":
        return ops.screened_argmax.default(x, screen.tiles, panels, n, screen.w_norm, screen.wb_norm, screen.dw_norm)
    if screen.isa == "avx2":
        return ops.screened_argmax_i16.default(x, screen.tiles, panels, n, screen.scale, screen.qmax, screen.w_norm,
                                               screen.wb_norm, screen.dw_norm)
    return ops.screened_argmax_lanes.default(x, screen.tiles, panels, n, screen.w_norm, screen.wb_norm, screen.dw_norm)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of a float32 CPU matrix in one vectorised pass per row. Returns int64 [rows]."""
    return torch.ops.zooinfer_cpu.argmax_rows.default(x)


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
    `SCREENED_ROWS` and in `SCREENED_ROWS_BY_ISA[screen.isa]`, else `linear_argmax` in `GREEDY_ROWS`
    and in `GREEDY_ROWS_BY_WIDTH[gemm.vector_width()]`. Otherwise the logits are computed
    and `argmax` takes their argmax. Every path gives `compute_logits(hidden).argmax(-1)` exactly,
    but for a quantized head with `quant_screen` (a `models.quant.QuantLinear`, same conditions,
    rows in `quant_head.QUANT_ROWS`): `quant_argmax` gives the argmax of its exact fp32 decode
    product, which is its logits' argmax with float32 activations (with `activations: int8` the
    logits are the int8 product, whose argmax may differ where two logits nearly tie); past those
    rows, with an `amx_screen` (AMX CPUs, `head_amx.AMX_ROWS`), `amx_argmax` gives the same exact
    product's argmax, taken 16 rows at a time.
    """

    __slots__ = ("head", "logits_scaling")

    def __init__(self, head=None, logits_scaling: float = 1.0):
        self.head = head
        self.logits_scaling = logits_scaling

    def path(self, hidden: torch.Tensor) -> str:
        """The path `tokens` takes for these hidden states: "screened_argmax", "linear_argmax",
        "quant_argmax" (a quantized head with a `quant_screen`), "amx_argmax" (past its rows, with an
        `amx_screen`), or "logits" (the caller
        computes the logits; `argmax` then picks from them)."""
        head = self.head
        if (head is None or getattr(head, "bias", None) is not None or self.logits_scaling != 1.0
                or not elementwise.use_kernel(hidden)):
            return "logits"
        rows = hidden.shape[0]
        if getattr(head, "quant_screen", None) is not None:    # a quantized head (zooinfer_kernels/quant_head.py)
            if rows in quant_head.QUANT_ROWS:
                return "quant_argmax"
            amx = getattr(head, "amx_screen", None) is not None and rows in head_amx.AMX_ROWS
            return "amx_argmax" if amx else "logits"
        if getattr(head, "kind", None) != "panel":
            return "logits"
        screen = getattr(head, "screen", None)
        if screen is not None and rows in SCREENED_ROWS and rows in SCREENED_ROWS_BY_ISA[screen.isa]:
            return "screened_argmax"
        fused = rows in GREEDY_ROWS and rows in GREEDY_ROWS_BY_WIDTH.get(gemm.vector_width(), GREEDY_ROWS)
        return "linear_argmax" if fused else "logits"

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Greedy tokens of `hidden [rows, hidden_size]` straight from the head, without logits;
        None where no fused path applies (`path` says "logits")."""
        path = self.path(hidden)
        head = self.head
        if path == "screened_argmax":
            return screened_argmax(hidden, head.packed, head.out_features, head.screen)
        if path == "linear_argmax":
            return linear_argmax(hidden, head.packed, head.out_features)
        if path == "quant_argmax":
            return quant_head.quant_argmax(hidden, head, head.quant_screen)
        if path == "amx_argmax":
            return head_amx.amx_argmax(hidden, head, head.amx_screen)
        return None

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of `logits [rows, vocab]` (module-level `argmax`)."""
        return argmax(logits)

    def __call__(self, hidden: torch.Tensor, compute_logits) -> torch.Tensor:
        """Greedy tokens of `hidden`: `tokens(hidden)`, else `argmax(compute_logits(hidden))`."""
        tokens = self.tokens(hidden)
        return tokens if tokens is not None else argmax(compute_logits(hidden))
