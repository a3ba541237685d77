"""DeepSeek-V4's compressor (and, for CSA, lightning indexer) weights and per-token projections.

HF's `DeepseekV4CSACompressor` / `DeepseekV4HCACompressor` project every source token to
`kv` and `gate` rows (CSA: two series, Ca | Cb, each `head_dim` wide; HCA: one), buffer them
until a window of m tokens closes, and pool each window into one entry. Here the per-token
part runs in the graph, one fused GEMM for all of a layer's source rows:

    rows = [kv | gate]                                   (HCA, 2 * head_dim)
    rows = [kv | gate | indexer kv | indexer gate]       (CSA, 4 * head_dim + 4 * index_head_dim)

and the rows go to the pool (`SlidingRowsSpec` with the compress rate); closing windows,
the entries and the attention over them happen in `zooinfer::compressed_attention`
(attention/compressed.py), which reads the position biases and kv_norm weights given here.
The indexer's queries (`q_b_proj` of the attention's q_residual, compress-roped at the
query position) and head weights (`weights_proj(x) * index_n_heads^-0.5`) are per token too.
"""
from __future__ import annotations

import torch
from torch import nn

from attention.compressed import rope_tail


class Compressor(nn.Module):
    """One CSA (`index_heads` > 0) or HCA layer's compressor weights."""

    fp32_params = ("position_bias", "kv_norm", "index_position_bias", "index_kv_norm")   # HF keeps them float32

    def __init__(self, hidden: int, head_dim: int, compress_rate: int, q_lora_rank: int = 0,
                 index_heads: int = 0, index_dim: int = 0):
        super().__init__()
        self.csa = index_heads > 0
        series = 2 if self.csa else 1                       # CSA: Ca and Cb
        self.kv_dim = series * head_dim
        self.index_heads, self.index_dim = index_heads, index_dim
        row_dim = 2 * self.kv_dim + (4 * index_dim if self.csa else 0)
        self.rows_proj = nn.Linear(hidden, row_dim, bias=False)
        self.position_bias = nn.Parameter(torch.empty(compress_rate, self.kv_dim))
        self.kv_norm = nn.Parameter(torch.empty(head_dim))
        if self.csa:
            self.index_position_bias = nn.Parameter(torch.empty(compress_rate, 2 * index_dim))
            self.index_kv_norm = nn.Parameter(torch.empty(index_dim))
            self.index_q_b_proj = nn.Linear(q_lora_rank, index_heads * index_dim, bias=False)
            self.index_weights_proj = nn.Linear(hidden, index_heads, bias=False)

    @property
    def row_dim(self) -> int:
        return self.rows_proj.out_features

    def params(self) -> list[torch.Tensor]:
        """What the op pools with: position bias and kv_norm weight (then the indexer's)."""
        if self.csa:
            return [self.position_bias, self.kv_norm, self.index_position_bias, self.index_kv_norm]
        return [self.position_bias, self.kv_norm]

    def index_queries(self, q_residual: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CSA: roped indexer queries [t, IH, ID] and head weights [t, IH]; cos / sin are
        the compress rope at the query positions [t, rope/2]."""
        q = self.index_q_b_proj(q_residual).view(-1, self.index_heads, self.index_dim)
        q = rope_tail(q, cos[:, None], sin[:, None])
        return q, self.index_weights_proj(x) * self.index_heads ** -0.5


def compressor_sources(ours: str, compressor: str, indexer: str | None, head_dim: int, index_dim: int) -> dict:
    """The checkpoint's compressor tensors under `compressor` (DeepSeek's names: wkv, wgate,
    ape = the position bias, norm) and, for CSA, the indexer's under `indexer` (its own
    compressor, wq_b, weights_proj): the kv / gate projections stacked into rows_proj in
    row order, the rest 1:1."""
    kv = (2 if indexer else 1) * head_dim
    c = compressor + "."
    parts = [(c + "wkv.weight", 0, kv), (c + "wgate.weight", kv, kv)]
    src = {ours + "position_bias": [(c + "ape", None, None)],
           ours + "kv_norm": [(c + "norm.weight", 0, head_dim)]}
    if indexer:
        i, ic = indexer + ".", indexer + ".compressor."
        parts += [(ic + "wkv.weight", 2 * kv, 2 * index_dim), (ic + "wgate.weight", 2 * kv + 2 * index_dim, 2 * index_dim)]
        src[ours + "index_position_bias"] = [(ic + "ape", None, None)]
        src[ours + "index_kv_norm"] = [(ic + "norm.weight", 0, index_dim)]
        src[ours + "index_q_b_proj.weight"] = [(i + "wq_b.weight", None, None)]
        src[ours + "index_weights_proj.weight"] = [(i + "weights_proj.weight", None, None)]
    src[ours + "rows_proj.weight"] = parts
    return src


__all__ = ["Compressor", "compressor_sources"]
