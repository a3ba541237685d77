"""Quantized linear weights: one integer layout for every format, and the linear that runs on it.

Why one layout: the GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; models/
quant_gguf.py) and the loader's own int8 / int4 all decode as

    w[n, k] = scale[n, k // G] * (q[n, k] - zero) + min[n, k // G]          (min optional)

with 4-bit q (two per byte, unsigned, `zero` 8 for symmetric formats) or 8-bit q (int8), and
scale / min per group of G weights: fp16 where the format's own are (the legacy GGUF formats, so
Q4_1 takes the file's 5 bits per weight), fp32 otherwise. Every format is repacked into it
without loss: the K-quants' 6- and 8-bit sub-scales times their fp16 super-scale are exact in
fp32, 5- and 6-bit values fit int8. So two kernels (kernels/cpu/quant_gemm.cpp: 4- and 8-bit) serve all formats, and
`QuantWeight.dequantize` computes exactly what gguf's numpy `dequantize` computes (same
operations in the same order; tests/test_quant.py checks it bit for bit on every format).
The cost of the repack is memory for the K-quants: fp32 scales take 1 (G=32) or 2 (G=16) bits per
weight where a GGUF super-block holds 6-bit ones, and 5/6-bit formats are widened to 8 bits
(bytes per weight are in `QuantWeight.nbytes`, printed by bench/quant.py).

`QuantEmbedding` looks rows up in a `QuantWeight` (a tied head's: models/quant_gguf.py), so a
tied model does not keep a float copy of its embedding beside the quantized head.

`QuantLinear` replaces an `nn.Linear`: its product runs on the C++ kernel (decode rows
dequantize in registers; prefill chunks dequantize a weight tile once and use at::mm), or,
without the kernel library, dequantizes the weight in torch and calls `F.linear`. Under
torch.compile it is the opaque custom op `zooinfer::quant_linear`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_build, quant_gemm
from models.spec import QUANT_ACTIVATIONS as ACTIVATIONS


@dataclass(slots=True)
class QuantWeight:
    """A weight [n, k] in the layout above; K is padded to `k_pad` (zero weights) when needed."""
    bits: int                    # 4 or 8
    group: int                   # G: weights per scale (a multiple of 32 for 4-bit, of 16 for 8-bit)
    zero: int                    # subtracted from q before scaling (8: symmetric 4-bit formats)
    qs: torch.Tensor             # uint8 [n, k_pad // 2] (4-bit) or int8 [n, k_pad]
    scale: torch.Tensor          # float32 or float16 [n, k_pad // G]
    min: torch.Tensor | None     # same dtype as scale, [n, k_pad // G], or None
    k: int                       # the true in-features
    fmt: str = ""                # where it came from (Q4_1, int8, ...), for reports

    @property
    def n(self) -> int:
        return self.qs.shape[0]

    @property
    def k_pad(self) -> int:
        return self.scale.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.min) if t is not None)

    def values(self) -> torch.Tensor:
        """q as int16 [n, k_pad] (4-bit values unpacked, zero not subtracted)."""
        if self.bits == 8:
            return self.qs.to(torch.int16)
        b = self.qs.view(self.n, -1, 16)
        return torch.cat((b & 15, b >> 4), dim=-1).reshape(self.n, -1).to(torch.int16)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [n, k]: scale * (q - zero) [+ min], unfused, as gguf's numpy does."""
        q = (self.values() - self.zero).to(torch.float32)
        w = self.scale.float().repeat_interleave(self.group, dim=1) * q
        if self.min is not None:
            w = w + self.min.float().repeat_interleave(self.group, dim=1)
        return w[:, :self.k]

    def regroup(self, group: int) -> QuantWeight:
        """The same weight with groups of `group` (a divisor of G): scales repeated, exact."""
        r = self.group // group
        rep = (lambda t: None if t is None else t.repeat_interleave(r, dim=1).contiguous())
        return QuantWeight(self.bits, group, self.zero, self.qs, rep(self.scale), rep(self.min), self.k, self.fmt)

    def to_8bit(self) -> QuantWeight:
        """4-bit values widened to int8 with the zero folded in (q - zero, exact)."""
        if self.bits == 8:
            return self
        q = (self.values() - self.zero).to(torch.int8).contiguous()
        return QuantWeight(8, self.group, 0, q, self.scale, self.min, self.k, self.fmt)

    def with_float_scales(self) -> QuantWeight:
        """The same weight with fp32 scale / min (fp16 ones widen exactly)."""
        f = (lambda t: None if t is None else t.float())
        return QuantWeight(self.bits, self.group, self.zero, self.qs, f(self.scale), f(self.min), self.k, self.fmt)

    def take_rows(self, index: torch.Tensor) -> QuantWeight:
        """Rows in the order `index` (a row permutation is exact on row-wise blocks)."""
        pick = (lambda t: None if t is None else t[index].contiguous())
        return QuantWeight(self.bits, self.group, self.zero, pick(self.qs), pick(self.scale), pick(self.min),
                           self.k, self.fmt)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [n, k] (k % 32 == 0) -> [n, k // 2] in the 4-bit block order."""
    b = q.to(torch.uint8).view(q.shape[0], -1, 32)
    return (b[..., :16] | (b[..., 16:] << 4)).reshape(q.shape[0], -1).contiguous()


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack weights of one K along the rows (a fused qkv / gate_up projection). Parts of
    different formats are brought to one losslessly: the smallest group, 8-bit if any is, a
    zero min where one part has none."""
    if len(parts) == 1:
        return parts[0]
    if len({p.k_pad for p in parts}) != 1:
        raise ValueError(f"concat_rows: parts have different K ({sorted({p.k for p in parts})})")
    group = math.gcd(*(p.group for p in parts))
    same = len({(p.bits, p.zero) for p in parts}) == 1
    parts = [p.regroup(group) if same else p.regroup(group).to_8bit() for p in parts]
    if len({p.scale.dtype for p in parts}) > 1:     # fp16 and fp32 scales: fp32 (exact)
        parts = [p.with_float_scales() for p in parts]
    mins = [p.min for p in parts]
    if any(m is not None for m in mins):
        mins = [torch.zeros_like(p.scale) if m is None else m for p, m in zip(parts, mins)]
        minv = torch.cat(mins)
    else:
        minv = None
    fmt = "+".join(dict.fromkeys(p.fmt for p in parts))
    return QuantWeight(parts[0].bits, group, parts[0].zero, torch.cat([p.qs for p in parts]),
                       torch.cat([p.scale for p in parts]), minv, parts[0].k, fmt)


def _padded_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """w [n, k] zero-padded to a multiple of lcm(group, 32) and viewed as [n, groups, group]."""
    n, k = w.shape
    step = math.lcm(group, 32)
    k_pad = -(-k // step) * step
    w = F.pad(w.float(), (0, k_pad - k))
    return w.view(n, k_pad // group, group), k_pad


@torch.no_grad()
def quantize_int8(w: torch.Tensor) -> QuantWeight:
    """Symmetric int8 with one scale per output channel (row): q = round(w / s), s = max|w| / 127."""
    n, k = w.shape
    g, k_pad = _padded_groups(w, -(-k // 32) * 32)
    s = g.abs().amax(-1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(g / s[..., None]).clamp(-127, 127).to(torch.int8).view(n, k_pad)
    return QuantWeight(8, k_pad, 0, q.contiguous(), s.contiguous(), None, k, "int8")


@torch.no_grad()
def quantize_int4(w: torch.Tensor, group: int = 32, symmetric: bool = True) -> QuantWeight:
    """4-bit group-wise. Symmetric (as GGUF Q4_0): s = -w_max / 8 with w_max the group's weight of
    largest magnitude, q - 8 = round(w / s) clamped to [-8, 7], so w_max is exact and all 16
    levels are used (a weight of the opposite extreme may be one step off). Asymmetric:
    q = round((w - lo) / s) in [0, 15], s = (hi - lo) / 15, min = lo (per group of `group`)."""
    if group <= 0 or group % 32:
        raise ValueError(f"quantization.group_size must be a positive multiple of 32, got {group}")
    n, k = w.shape
    g, k_pad = _padded_groups(w, group)
    if symmetric:
        s = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1) / -8
        s = torch.where(s != 0, s, torch.ones_like(s))
        q, minv, zero = torch.round(g / s[..., None]).clamp(-8, 7) + 8, None, 8
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = (hi - lo) / 15
        s = torch.where(s > 0, s, torch.ones_like(s))
        q, minv, zero = torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15), lo.contiguous(), 0
    fmt = "int4" if symmetric else "int4_asym"
    return QuantWeight(4, group, zero, pack_nibbles(q.view(n, k_pad)), s.contiguous(), minv, k, fmt)


def _matmul(x: torch.Tensor, qs, scale, minv, bits: int, group: int, zero: int, k: int,
            bias: torch.Tensor | None, act_int8: bool = False) -> torch.Tensor:
    rows = x.numel() // k if k else 0
    n = qs.shape[0]
    x2 = x.reshape(rows, k).float()
    k_pad = scale.shape[1] * group
    if k_pad != k:
        x2 = F.pad(x2, (0, k_pad - k))
    b = None if bias is None else bias.float()
    if x2.device.type == "cpu" and cpu_build.available():
        if act_int8 and rows <= quant_gemm.Q8_MAX_ROWS and quant_gemm.q8_available():
            out = quant_gemm.quant_linear_q8(x2, qs, scale, minv, bits, group, zero, b)
        else:
            out = quant_gemm.quant_linear(x2, qs, scale, minv, bits, group, zero, b)
    else:   # no kernel library: dequantize in torch (correct, slower)
        w = QuantWeight(bits, group, zero, qs, scale, minv, k_pad).dequantize()
        out = F.linear(x2, w, b)
    return out.to(x.dtype).view(*x.shape[:-1], n)


@torch.library.custom_op("zooinfer::quant_linear", mutates_args=())
def quant_linear_op(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                    bits: int, group: int, zero: int, k: int, bias: torch.Tensor | None,
                    act_int8: bool = False) -> torch.Tensor:
    """`F.linear(x, W, bias)` with W given quantized (`QuantWeight` fields)."""
    return _matmul(x, qs, scale, minv, bits, group, zero, k, bias, act_int8)


@quant_linear_op.register_fake
def _(x, qs, scale, minv, bits, group, zero, k, bias, act_int8=False):
    return x.new_empty((*x.shape[:-1], qs.shape[0]))


class QuantLinear(nn.Module):
    """An `nn.Linear` whose weight is a `QuantWeight` (the float weight is dropped). `weight`
    gives the dequantized fp32 weight on demand, for the rare code that reads it directly.
    `activations="int8"`: decode steps (up to 16 rows) round x to int8 per 32-block and use
    integer dot products (kernels/cpu/quant_gemv_q8.cpp, AVX-512 VNNI CPUs; within the bound
    stated there, not exact); prefill chunks and other CPUs keep the exact fp32 product."""

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None = None, activations: str = "float32"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"quantization.activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.act_int8 = activations == "int8"
        self.in_features, self.out_features = qw.k, qw.n
        self.bits, self.group, self.zero, self.fmt = qw.bits, qw.group, qw.zero, qw.fmt
        self.register_buffer("qs", qw.qs, persistent=False)
        self.register_buffer("scale", qw.scale, persistent=False)
        self.register_buffer("minv", qw.min, persistent=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    @property
    def qweight(self) -> QuantWeight:
        return QuantWeight(self.bits, self.group, self.zero, self.qs, self.scale, self.minv, self.in_features, self.fmt)

    @property
    def weight(self) -> torch.Tensor:
        return self.qweight.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (x, self.qs, self.scale, self.minv, self.bits, self.group, self.zero, self.in_features, self.bias,
                self.act_int8)
        if torch.compiler.is_compiling():
            return torch.ops.zooinfer.quant_linear(*args)
        return _matmul(*args)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.fmt}, bits={self.bits}, group={self.group}, activations={'int8' if self.act_int8 else 'float32'}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: its parameters and the quantized modules' buffers (not other
    buffers such as rope tables), each storage counted once (tied / shared tensors, a
    `QuantEmbedding` sharing its head's blocks)."""
    quant = [t for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding)) for t in m.buffers()]
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *quant]:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


class QuantEmbedding(nn.Module):
    """An `nn.Embedding` whose table is a `QuantWeight` (shared with a tied `QuantLinear` head):
    each looked-up row is dequantized as `QuantWeight.dequantize` does, so it equals the float
    table that weight decodes to, bit for bit. `weight` dequantizes the whole table on demand."""

    def __init__(self, qw: QuantWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = qw.n, qw.k, dtype
        self.bits, self.group, self.zero, self.fmt = qw.bits, qw.group, qw.zero, qw.fmt
        self.register_buffer("qs", qw.qs, persistent=False)
        self.register_buffer("scale", qw.scale, persistent=False)
        self.register_buffer("minv", qw.min, persistent=False)

    def _rows(self, index: torch.Tensor) -> QuantWeight:
        pick = (lambda t: None if t is None else t.index_select(0, index))
        return QuantWeight(self.bits, self.group, self.zero, pick(self.qs), pick(self.scale), pick(self.minv),
                           self.embedding_dim, self.fmt)

    @property
    def weight(self) -> torch.Tensor:
        return self._rows(torch.arange(self.num_embeddings)).dequantize().to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._rows(ids.reshape(-1).to(torch.long)).dequantize().to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt}, bits={self.bits}"
