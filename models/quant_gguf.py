"""GGUF block formats kept quantized: raw blocks -> `QuantWeight`, and a model's linears from a GGUF.

`from_blocks` repacks one tensor's blocks (as `gguf.GGUFReader` maps them, never dequantized)
into the layout of models/quant.py at the file's own bits: Q4_0 / Q4_1 / Q5_0 / Q5_1 keep their
nibble bytes as they are (Q5's fifth bits become one high-bit plane), Q4_K / Q5_K / Q6_K's
values are reordered into 32-weight blocks (5 / 6 bits: the low 4 plus 1 / 2 planes), Q8_0 is
int8. Scales stay as the file holds them: fp16 for the legacy formats, two-level for the
K-quants (sub-scales sc / m as int8 with fp16 d / -dmin per 256 weights, so d * sc and
-(dmin * m) are the one fp32 product gguf's numpy computes). So `dequantize()` equals
`gguf.quants.dequantize` bit for bit (tests/test_quant.py).

`quantize_from_gguf` swaps each `nn.Linear` of a built model whose checkpoint tensors are
quantized in the GGUF for a `QuantLinear`. The model's float weights must already be loaded
(the embedded checkpoints are this GGUF dequantized once, models/embedded.py): every quantized
weight is checked to decode to exactly them, which proves the name mapping (gguf's own
`TensorNameMap`) and the row order (llama's q/k permutation, undone as transformers does).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from models.quant import QuantEmbedding, QuantLinear, QuantWeight, concat_rows, pack_high_bits, pack_nibbles

QK = 32       # weights per block of the legacy formats
QK_K = 256    # per super-block of the K-quants


def _h16(b: np.ndarray) -> np.ndarray:
    """A block's fp16 field kept as fp16 (the kernels widen it exactly)."""
    return np.ascontiguousarray(b).view(np.float16)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def from_blocks(raw: np.ndarray, qtype: int, k: int, fmt: str = "") -> QuantWeight | None:
    """One tensor's GGUF blocks, uint8 [n, bytes per row], as a `QuantWeight` [n, k]; None for a
    type this module does not handle (float tensors, other quant types: the caller keeps float)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
    qtype = T(qtype)
    fmt = fmt or qtype.name
    if qtype not in _repack_table():
        return None
    block, size = GGML_QUANT_SIZES[qtype]
    n = raw.shape[0]
    if k % block or raw.shape[1] != k // block * size:
        raise ValueError(f"{fmt}: {raw.shape[1]} bytes per row do not hold {k} weights")
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    bits, group, zero, q, scale, minv, *two = _repack_table()[qtype](blocks)
    rows = (lambda a: None if a is None else _t(a.reshape(n, -1)))
    qh = None
    if bits <= 6 and q.shape[-1] == 16:   # nibble bytes already in the 32-weight block order
        qs = _t(q.reshape(n, k // 2))
        if bits == 5:                      # the legacy Q5's fifth bits: one uint32 per block as it is
            qh = _t(np.ascontiguousarray(two.pop(0)).view(np.int32).reshape(n, k // 32, 1))
    elif bits == 8:
        qs = _t(q.reshape(n, k)).view(torch.int8)
    else:
        q = _t(q.reshape(n, k))
        qs, qh = (pack_nibbles(q), None) if bits == 4 else pack_high_bits(q, bits)
    scale_d, min_d = (rows(two[0]), rows(two[1])) if two else (None, None)
    return QuantWeight(bits, group, zero, qs.contiguous(), rows(scale), rows(minv), k, fmt, qh, scale_d, min_d)


def _q4_0(b):   # nibble bytes kept as they are: Q4_0's order is ours
    return 4, QK, 8, b[:, 2:], _h16(b[:, :2]), None


def _q4_1(b):
    return 4, QK, 0, b[:, 4:], _h16(b[:, :2]), _h16(b[:, 2:4])


def _q5_0(b):   # Q4_0's nibbles and a uint32 of fifth bits (bit j: weight j), zero 16
    return 5, QK, 16, b[:, 6:], _h16(b[:, :2]), None, b[:, 2:6]


def _q5_1(b):
    return 5, QK, 0, b[:, 8:], _h16(b[:, :2]), _h16(b[:, 2:4]), b[:, 4:8]


def _q8_0(b):
    return 8, QK, 0, b[:, 2:], _h16(b[:, :2]), None


def _k_scales(b):
    """Q4_K / Q5_K, two-level as shipped: (sc, m) int8 per 32 weights, (d, -dmin) fp16 per 256,
    so that d * sc and -dmin * m = -(dmin * m) are what gguf computes."""
    from gguf.quants import Q4_K
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return sc.astype(np.int8), m.astype(np.int8), _h16(b[:, :2]), -_h16(b[:, 2:4])


def _k_nibbles(qs):
    """K-quants: per 64 weights 32 bytes, low nibbles = weights 0..31, high = 32..63; [nb, 256]."""
    qs = qs.reshape(qs.shape[0], -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(qs.shape[0], -1)


def _q4_k(b):
    sc, m, d, dmin = _k_scales(b)
    return 4, QK, 0, _k_nibbles(b[:, 16:]), sc, m, d, dmin


def _q5_k(b):
    sc, m, d, dmin = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _k_nibbles(b[:, 48:]) | ((qh & 1).reshape(b.shape[0], -1) << 4)
    return 5, QK, 0, q, sc, m, d, dmin


def _q6_k(b):   # values 0..63 with zero 32; int8 scales per 16 and d per 256, as shipped
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    ql = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    qh = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = ql.reshape(n, -1, 32) | (qh.reshape(n, -1, 32) << 4)
    return 6, 16, 32, q.reshape(n, -1), scales, None, _h16(b[:, 208:210]), None


@functools.cache
def _repack_table() -> dict:
    """GGMLQuantizationType -> its block repacker."""
    from gguf import GGMLQuantizationType as T
    return {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
            T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def _llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row permutation transformers undoes for llama's q / k (`_reverse_permute_weights`)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


class GGUFLinears:
    """The quantized tensors of one GGUF file, found by checkpoint (HF) tensor name."""

    def __init__(self, path):
        import gguf
        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.reader.fields["general.architecture"].contents()
        blocks = self.reader.fields[f"{self.arch}.block_count"].contents()
        archs = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}
        if self.arch not in archs:
            raise ValueError(f"{path}: GGUF architecture {self.arch!r} is not known to the gguf package")
        self.names = gguf.get_tensor_name_map(archs[self.arch], blocks)
        heads = f"{self.arch}.attention.head_count"
        self.heads = self.reader.fields[heads].contents() if heads in self.reader.fields else None
        kv = f"{self.arch}.attention.head_count_kv"
        self.kv_heads = self.reader.fields[kv].contents() if kv in self.reader.fields else self.heads

    def gguf_name(self, hf_name: str) -> str | None:
        if hf_name == "lm_head.weight" and "output.weight" not in self.tensors:
            return "token_embd.weight"     # a tied head: the GGUF keeps only the embedding
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return name if name in self.tensors else None

    def weight(self, hf_name: str) -> QuantWeight | None:
        """The tensor as a `QuantWeight` in the checkpoint's row order; None if absent or float."""
        name = self.gguf_name(hf_name)
        if name is None:
            return None
        t = self.tensors[name]
        k = int(t.shape[0])     # ggml dims are innermost first: [K, N]
        qw = from_blocks(np.asarray(t.data).reshape(int(t.shape[1]), -1), int(t.tensor_type), k)
        if qw is not None and self.arch == "llama" and self.heads and name.endswith((".attn_q.weight", ".attn_k.weight")):
            qw = qw.take_rows(_llama_row_order(qw.n, self.heads if "attn_q" in name else self.kv_heads))
        return qw


@torch.no_grad()
def quantize_from_gguf(model: nn.Module, path, lm_head: bool = True, activations: str = "float32") -> dict[str, str]:
    """Replace the linears whose checkpoint tensors are quantized in the GGUF at `path` by
    `QuantLinear`s (a tied embedding becomes a `QuantEmbedding` on the head's blocks); returns
    {linear's module name: format}. Raises ValueError, leaving the model as it was,
    when a quantized tensor does not decode to exactly the loaded float weight (a wrong mapping
    would otherwise run silently)."""
    src = GGUFLinears(path)
    sources = dict(model.weight_sources())
    if lm_head and "lm_head.weight" not in sources:
        sources["lm_head.weight"] = [("lm_head.weight", 0, model.lm_head.weight.shape[0])]
    done: dict[str, str] = {}
    swaps: list[tuple[str, QuantLinear]] = []
    for param, parts in sources.items():
        module_name = param.removesuffix(".weight")
        if not param.endswith(".weight") or (module_name == "lm_head" and not lm_head):
            continue
        module = model.get_submodule(module_name)
        if type(module) is not nn.Linear or any(len(part) > 3 and part[3] for part in parts):
            continue
        pieces = [src.weight(part[0]) for part in parts]
        if any(p is None for p in pieces):
            continue
        for (hf_name, offset, rows, *_), qw in zip(parts, pieces):
            # ~64 rows spread over the tensor: any wrong name or row order shows there
            sample = torch.arange(0, rows, max(1, rows // 64))
            want = module.weight[offset: offset + rows][sample].float()
            if (qw.n != rows or qw.k != want.shape[1]
                    or not torch.equal(qw.take_rows(sample).dequantize(), want)):
                raise ValueError(f"{path}: GGUF tensor {src.gguf_name(hf_name)} ({qw.fmt}) does not decode to the "
                                 f"checkpoint's {hf_name}; the name mapping or row order is wrong")
        qw = concat_rows(pieces)
        bias = module.bias.detach() if module.bias is not None else None
        swaps.append((module_name, QuantLinear(qw, bias, activations)))
    tied = getattr(model, "embed_tokens", None)
    tied = tied if type(tied) is nn.Embedding and tied.weight is getattr(model, "lm_head", tied).weight else None
    for module_name, linear in swaps:   # only once every tensor checked: a refused GGUF changes nothing
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)
        done[module_name] = linear.fmt
        if module_name == "lm_head" and tied is not None:
            # the tied table's rows come from the head's blocks (checked equal above): no float copy
            model.embed_tokens = QuantEmbedding(linear.qweight, tied.weight.dtype)
    return done
