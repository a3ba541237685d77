"""Quantized linear weights: one integer layout for every format, and the linear that runs on it.

Why one layout: the GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; models/
quant_gguf.py) and the loader's own int8 / int4 all decode as

    w[n, k] = scale[n, k // G] * (q[n, k] - zero) + min[n, k // G]          (min optional)

with q of 4 bits (two per byte, unsigned, `zero` 8 for symmetric formats), 5 or 6 bits (the low
4 as 4-bit ones plus 1 or 2 planes of high bits, `qh`: Q5_0 / Q5_1 / Q5_K / Q6_K as they ship) or
8 bits (int8), and scale / min per group of G weights: fp16 where the format's own are (the
legacy GGUF formats), two-level where the format ships them so (the K-quants: an int8 sub-scale
per group times an fp16 super-scale `scale_d` / `min_d` per 256 weights), fp32 otherwise. So
every GGUF weight takes in memory at most the bits its file gives it (the K-quants' 6-bit
sub-scales take 8: 1/8 bit per weight more), and the kernels (zooinfer_kernels/cpu/quant_gemm.cpp, which
expand the storage a tile at a time, exactly) serve all formats. `QuantWeight.dequantize`
computes exactly what gguf's numpy `dequantize` computes (same operations in the same order;
tests/test_quant.py checks it bit for bit on every format).

`QuantEmbedding` looks rows up in a `QuantWeight` (a tied head's: models/quant_gguf.py), so a
tied model does not keep a float copy of its embedding beside the quantized head.

`QuantLinear` replaces an `nn.Linear`: its product runs on the C++ kernels (decode rows
dequantize in registers; prefill chunks dequantize panels into the blocked fp32 GEMM's layout,
zooinfer_kernels/cpu/quant_gemm_panels.cpp; with `activations="int8"` integer dot products at every row
count; with "int8_bf16" AMX-BF16 tiles for prefill chunks), or, without the kernel library, dequantizes the weight in torch and calls `F.linear`. Under
torch.compile it is the opaque custom op `zooinfer::quant_linear`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zooinfer_kernels import cpu_build, quant_gemm
from models.spec import QUANT_ACTIVATIONS as ACTIVATIONS


@dataclass(slots=True)
class QuantWeight:
    """A weight [n, k] in the layout above; K is padded to `k_pad` (zero weights) when needed."""
    bits: int                    # 4, 5, 6 (4-bit qs + `qh`) or 8
    group: int                   # G: weights per scale (a multiple of 32 for 4-bit, of 16 otherwise)
    zero: int                    # subtracted from q before scaling (8: symmetric 4-bit formats)
    qs: torch.Tensor             # uint8 [n, k_pad // 2] (4-6 bits: the low 4) or int8 [n, k_pad]
    scale: torch.Tensor          # float32 or float16 [n, k_pad // G]; int8 sub-scales with `scale_d`
    min: torch.Tensor | None     # same dtype as scale, [n, k_pad // G], or None
    k: int                       # the true in-features
    fmt: str = ""                # where it came from (Q4_1, int8, ...), for reports
    qh: torch.Tensor | None = None       # bits 5 / 6: int32 [n, k_pad // 32, bits - 4], bit j of plane p
                                         # = bit 4 + p of the 32-weight block's weight j
    scale_d: torch.Tensor | None = None  # two-level: float16 [n, k_pad // S], scale = scale_d * scale
    min_d: torch.Tensor | None = None    # likewise for min

    @property
    def n(self) -> int:
        return self.qs.shape[0]

    @property
    def k_pad(self) -> int:
        return self.scale.shape[1] * self.group

    def tensors(self) -> tuple:
        return (self.qs, self.scale, self.min, self.qh, self.scale_d, self.min_d)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    @property
    def storage(self) -> dict:
        """The storage-only tensors, as the kernel wrappers' keyword arguments (zooinfer_kernels/quant_gemm.py)."""
        return {"qh": self.qh, "scale_d": self.scale_d, "min_d": self.min_d}

    def _replace(self, **kw) -> QuantWeight:
        return dataclasses.replace(self, **kw)

    def values(self) -> torch.Tensor:
        """q as int16 [n, k_pad] (4-6 bit values unpacked, zero not subtracted)."""
        if self.bits == 8:
            return self.qs.to(torch.int16)
        b = self.qs.view(self.n, -1, 16)
        q = torch.cat((b & 15, b >> 4), dim=-1).to(torch.int16)
        if self.qh is not None:
            planes = self.qh.view(self.n, -1, self.bits - 4, 1)
            lane = torch.arange(32, dtype=torch.int32)
            for p in range(self.bits - 4):
                q = q + (((planes[:, :, p] >> lane) & 1).to(torch.int16) << (4 + p))
        return q.reshape(self.n, -1)

    def float_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, min) as fp32 [n, k_pad // G]: fp16 widened, two-level as the one product d * s."""
        def widen(t, d):
            if t is None or d is None:
                return None if t is None else t.float()
            return d.float().repeat_interleave(t.shape[1] // d.shape[1], dim=1) * t.float()
        return widen(self.scale, self.scale_d), widen(self.min, self.min_d)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [n, k]: scale * (q - zero) [+ min], unfused, as gguf's numpy does."""
        scale, minv = self.float_scales()
        q = (self.values() - self.zero).to(torch.float32)
        w = scale.repeat_interleave(self.group, dim=1) * q
        if minv is not None:
            w = w + minv.repeat_interleave(self.group, dim=1)
        return w[:, :self.k]

    def regroup(self, group: int) -> QuantWeight:
        """The same weight with groups of `group` (a divisor of G): scales repeated, exact."""
        r = self.group // group
        rep = (lambda t: None if t is None else t.repeat_interleave(r, dim=1).contiguous())
        return self._replace(group=group, scale=rep(self.scale), min=rep(self.min))

    def to_8bit(self) -> QuantWeight:
        """4-6 bit values widened to int8 with the zero folded in (q - zero, exact)."""
        if self.bits == 8:
            return self
        q = (self.values() - self.zero).to(torch.int8).contiguous()
        return self._replace(bits=8, zero=0, qs=q, qh=None)

    def with_float_scales(self) -> QuantWeight:
        """The same weight with fp32 scale / min (fp16 and two-level ones are exact in fp32)."""
        scale, minv = self.float_scales()
        return self._replace(scale=scale, min=minv, scale_d=None, min_d=None)

    def take_rows(self, index: torch.Tensor) -> QuantWeight:
        """Rows in the order `index` (a row permutation is exact on row-wise blocks)."""
        pick = (lambda t: None if t is None else t[index].contiguous())
        return self._replace(**{f: pick(getattr(self, f)) for f in ("qs", "scale", "min", "qh", "scale_d", "min_d")})


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [n, k] (k % 32 == 0) -> [n, k // 2] in the 4-bit block order."""
    b = q.to(torch.uint8).view(q.shape[0], -1, 32)
    return (b[..., :16] | (b[..., 16:] << 4)).reshape(q.shape[0], -1).contiguous()


def pack_high_bits(q: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values 0 .. 2^bits - 1 [n, k] (k % 32 == 0, bits 5 or 6) -> (the low 4 bits as `pack_nibbles`,
    qh int32 [n, k // 32, bits - 4]: bit j of plane p = bit 4 + p of the block's weight j)."""
    b = q.to(torch.int64).view(q.shape[0], -1, 32)
    lane = torch.arange(32, dtype=torch.int64)
    words = torch.stack([(((b >> (4 + p)) & 1) << lane).sum(-1) for p in range(bits - 4)], dim=-1)
    qh = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)      # uint32 bits as int32
    return pack_nibbles((b & 15).view(q.shape[0], -1)), qh.contiguous()


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack weights of one K along the rows (a fused qkv / gate_up projection). Parts of
    different formats are brought to one losslessly: the smallest group, 8-bit if the value
    widths or zeros differ, fp32 scales if their storage differs, a zero min where one part has none."""
    if len(parts) == 1:
        return parts[0]
    if len({p.k_pad for p in parts}) != 1:
        raise ValueError(f"concat_rows: parts have different K ({sorted({p.k for p in parts})})")
    group = math.gcd(*(p.group for p in parts))
    same = len({(p.bits, p.zero) for p in parts}) == 1
    parts = [p.regroup(group) if same else p.regroup(group).to_8bit() for p in parts]
    kinds = {(p.scale.dtype, None if p.scale_d is None else p.scale_d.shape[1]) for p in parts}
    if len(kinds) > 1:           # fp16 / two-level / fp32 scales mixed: fp32 (exact)
        parts = [p.with_float_scales() for p in parts]
    if any(p.min is not None for p in parts):
        parts = [p if p.min is not None else
                 p._replace(min=torch.zeros_like(p.scale),
                            min_d=None if p.scale_d is None else torch.zeros_like(p.scale_d)) for p in parts]
    cat = (lambda f: None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts]))
    fmt = "+".join(dict.fromkeys(p.fmt for p in parts))
    return parts[0]._replace(fmt=fmt, **{f: cat(f) for f in ("qs", "scale", "min", "qh", "scale_d", "min_d")})


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
            bias: torch.Tensor | None, act: int = 0, qh=None, scale_d=None, min_d=None) -> torch.Tensor:
    rows = x.numel() // k if k else 0
    n = qs.shape[0]
    x2 = x.reshape(rows, k).float()
    k_pad = scale.shape[1] * group
    if k_pad != k:
        x2 = F.pad(x2, (0, k_pad - k))
    b = None if bias is None else bias.float()
    storage = {"qh": qh, "scale_d": scale_d, "min_d": min_d}
    if x2.device.type == "cpu" and cpu_build.available():
        if act and quant_gemm.q8_available():
            out = quant_gemm.quant_linear_int8_act(x2, qs, scale, minv, bits, group, zero, b, **storage, act=act)
        else:
            out = quant_gemm.quant_linear(x2, qs, scale, minv, bits, group, zero, b, **storage)
    else:   # no kernel library: dequantize in torch (correct, slower)
        w = QuantWeight(bits, group, zero, qs, scale, minv, k_pad, "", qh, scale_d, min_d).dequantize()
        out = F.linear(x2, w, b)
    return out.to(x.dtype).view(*x.shape[:-1], n)


@torch.library.custom_op("zooinfer::quant_linear", mutates_args=())
def quant_linear_op(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None,
                    bits: int, group: int, zero: int, k: int, bias: torch.Tensor | None,
                    act: int = 0, qh: torch.Tensor | None = None, scale_d: torch.Tensor | None = None,
                    min_d: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, W, bias)` with W given quantized (`QuantWeight` fields); `act` the activations'
    code (`quant_gemm.ACT_CODES`)."""
    return _matmul(x, qs, scale, minv, bits, group, zero, k, bias, act, qh, scale_d, min_d)


@quant_linear_op.register_fake
def _(x, qs, scale, minv, bits, group, zero, k, bias, act=0, qh=None, scale_d=None, min_d=None):
    return x.new_empty((*x.shape[:-1], qs.shape[0]))


_BUFFERS = {"qs": "qs", "scale": "scale", "minv": "min", "qh": "qh", "scale_d": "scale_d", "min_d": "min_d"}


class _QuantBuffers(nn.Module):
    """A `QuantWeight` held as (non-persistent) buffers, so `.to()` and `weight_bytes` see them."""

    def _hold(self, qw: QuantWeight) -> None:
        self.bits, self.group, self.zero, self.fmt = qw.bits, qw.group, qw.zero, qw.fmt
        for buf, field in _BUFFERS.items():
            self.register_buffer(buf, getattr(qw, field), persistent=False)

    def _qweight(self, k: int, pick=None) -> QuantWeight:
        tensors = {field: getattr(self, buf) for buf, field in _BUFFERS.items()}
        if pick is not None:
            tensors = {f: None if t is None else pick(t) for f, t in tensors.items()}
        return QuantWeight(self.bits, self.group, self.zero, k=k, fmt=self.fmt, **tensors)


class QuantLinear(_QuantBuffers):
    """An `nn.Linear` whose weight is a `QuantWeight` (the float weight is dropped). `weight`
    gives the dequantized fp32 weight on demand, for the rare code that reads it directly.
    `activations="int8"`: every product (decode steps and prefill chunks) rounds x to int8 per
    32-block and uses integer dot products (zooinfer_kernels/cpu/quant_gemv_q8.cpp for a few rows,
    quant_gemm_q8.cpp past them on AVX-512 VNNI CPUs, quant_q8_avx2.cpp at every row count on
    AVX2 + FMA ones; within the bound stated there, not exact); other CPUs keep the exact fp32
    product. `activations="int8_bf16"`: the same below `quant_gemm.BF16_MIN_ROWS` rows, and from there
    on (prefill chunks) x and the weight rounded to bf16 on AMX-BF16 tiles where they run
    (zooinfer_kernels/cpu/quant_gemm_bf16.cpp), int8 elsewhere."""

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None = None, activations: str = "float32"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"quantization.activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.activations = activations
        self.act = quant_gemm.ACT_CODES[activations]
        self.in_features, self.out_features = qw.k, qw.n
        self._hold(qw)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self._run = None          # `_bind`'s call, made at the first forward

    @property
    def act_int8(self) -> bool:
        """int8 x in decode-sized products (both int8 modes)."""
        return self.act > 0

    @property
    def qweight(self) -> QuantWeight:
        return self._qweight(self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.qweight.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.zooinfer.quant_linear(*self._args(x))
        run = self._run if self._run is not None else self._bind()
        if run and x.dim() == 2 and x.dtype == torch.float32 and cpu_build.enabled():
            return run(x)         # the kernel call with its weight bound (`_bind`): what _matmul would call
        return _matmul(*self._args(x))

    def _args(self, x: torch.Tensor) -> tuple:
        return (x, self.qs, self.scale, self.minv, self.bits, self.group, self.zero, self.in_features, self.bias,
                self.act, self.qh, self.scale_d, self.min_d)

    def _bind(self):
        """`quant_gemm.bind` on this weight where `_matmul` would call the kernels on a 2-D float32 x
        as it is (CPU buffers, the library built, K not padded, a float32 bias or none), else False
        (then every call takes `_matmul`). Kept until `_apply` (`.to()`, ...) moves the buffers."""
        tensors = [t for t in (self.qs, self.scale, self.minv, self.qh, self.scale_d, self.min_d, self.bias)
                   if t is not None]
        ok = (all(t.is_cpu for t in tensors) and self.scale.shape[1] * self.group == self.in_features
              and (self.bias is None or self.bias.dtype == torch.float32) and cpu_build.available())
        self._run = ok and quant_gemm.bind(self.qs, self.scale, self.minv, self.bits, self.group, self.zero,
                                           self.bias, self.act, qh=self.qh, scale_d=self.scale_d,
                                           min_d=self.min_d)
        return self._run

    def _apply(self, fn, recurse: bool = True):
        self._run = None          # the bound call holds the old tensors
        return super()._apply(fn, recurse)

    def __setattr__(self, name: str, value) -> None:
        if name in _BUFFERS or name == "bias":
            self.__dict__["_run"] = None      # a new weight tensor: bind again
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.fmt}, bits={self.bits}, group={self.group}, activations={self.activations}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: its parameters and the quantized modules' buffers (not other
    buffers such as rope tables), each storage counted once (tied / shared tensors, a
    `QuantEmbedding` sharing its head's blocks)."""
    quant = [t for m in model.modules() if isinstance(m, _QuantBuffers) for t in m.buffers()]
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *quant]:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


class QuantEmbedding(_QuantBuffers):
    """An `nn.Embedding` whose table is a `QuantWeight` (shared with a tied `QuantLinear` head):
    each looked-up row is dequantized as `QuantWeight.dequantize` does, so it equals the float
    table that weight decodes to, bit for bit. `weight` dequantizes the whole table on demand."""

    def __init__(self, qw: QuantWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = qw.n, qw.k, dtype
        self._hold(qw)

    def _rows(self, index: torch.Tensor) -> QuantWeight:
        return self._qweight(self.embedding_dim, pick=lambda t: t.index_select(0, index))

    @property
    def weight(self) -> torch.Tensor:
        return self._rows(torch.arange(self.num_embeddings)).dequantize().to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._rows(ids.reshape(-1).to(torch.long)).dequantize().to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt}, bits={self.bits}"
