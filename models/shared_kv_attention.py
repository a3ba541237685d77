"""DeepSeek-V4's attention block: shared-KV multi-query attention with a low-rank query, a
grouped low-rank output projection and per-head sinks, sized by the `compressed_attention:`
section (heads and head_dim from `attention:`).

Per token (hidden x, T tokens; h heads of head_dim d; r rope dims at the END of each head):

    q_res = rms(x Wq_a) * w_qa                 [q_lora_rank]  (also the CSA indexer's input)
    q     = rope(rms_unweighted(q_res Wq_b))   [h, d]         per head
    kv    = rope(rms(x Wkv) * w_kv)            [d]            ONE head, used as key AND value
    o     = softmax(q.kv * d^-0.5 (+ sink)) kv [h, d]         over the layer's keys
    out   = Wo_b (Wo_a_g o_g)_g                               o split into o_groups groups,
                                                              each through its own Wo_a block

Because the value is the roped key, each head's output carries rope on its last r dims; it
is rotated back by the query's own position (-theta) before the output projection, so what
a key contributes depends only on its distance to the query. The rope pairs channels
(x0, x1), (x2, x3), ... (interleaved) over the trailing r dims, as DeepSeek does.

Which keys a query sees is the kind's business: V4's sliding layers (`swa_shared_kv`) see the
last `attention.sliding_window` tokens; its compressed layers (CSA / HCA) see those plus
compressed entries. This module is the part every V4 attention layer shares: `project`
(x -> q, kv, q_res) and `finish` (o -> hidden).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from attention.compressed import rope_tail     # the compressed layers' op ropes its entries alike
from models.kinds.base import Fail, Sources, linear_sources
from models.layers import RMSNorm, RotaryEmbedding

if TYPE_CHECKING:
    from models.spec import ModelSpec


@dataclass(slots=True)
class CompressedAttentionSection:
    """The `compressed_attention:` section (DeepSeek-V4's attention sizes)."""
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    # CSA / HCA layers (their kinds): source tokens per compressed entry, by kind name
    compress_rates: dict = field(default_factory=lambda: {"compressed_sparse_attention": 4,
                                                          "heavily_compressed_attention": 128})
    index_n_heads: int = 0             # CSA's lightning indexer: query heads,
    index_head_dim: int = 0            #   their size,
    index_topk: int = 0                #   and the compressed entries each query keeps


WEIGHT_NAMES = {
    "skv_q_a": "attn.wq_a",
    "skv_q_a_norm": "attn.q_norm.weight",
    "skv_q_b": "attn.wq_b",
    "skv_kv": "attn.wkv",
    "skv_kv_norm": "attn.norm.weight",
    "skv_o_a": "attn.wo_a",
    "skv_o_b": "attn.wo_b",
    "skv_sinks": "attn.attn_sink",
}


class SharedKVAttention(nn.Module):
    """The shared part of a V4 attention layer (see the module docstring). Subclasses (the
    kinds) implement `forward(positions, x, kv_cache)` around `project` and `finish`."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        c, a, hidden = spec.compressed_attention, spec.attention, spec.hidden_size
        self.layer_id = layer_id
        self.num_heads, self.head_dim = h, d = a.num_heads, a.head_dim
        self.q_lora_rank, self.o_groups, self.o_lora_rank = c.q_lora_rank, c.o_groups, c.o_lora_rank
        self.eps = spec.norm.eps
        # q_a and kv read the same input: one GEMM
        self.qkv_a_proj = nn.Linear(hidden, c.q_lora_rank + d, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, spec.norm.eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, h * d, bias=False)
        self.kv_norm = RMSNorm(d, spec.norm.eps)
        self.o_a_proj = nn.Linear(h * d // c.o_groups, c.o_groups * c.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.fp32_params = ("sinks",)
        self.rotary = rotary
        self.scale = d ** -0.5

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos[positions].unsqueeze(1), self.rotary.sin[positions].unsqueeze(1)

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q [T, h, d], kv [T, d], q_res [T, q_lora_rank]): normed and roped."""
        t = x.shape[0]
        q_a, kv = self.qkv_a_proj(x).split([self.q_lora_rank, self.head_dim], dim=-1)
        q_res = self.q_a_norm(q_a)
        q = self.q_b_proj(q_res).view(t, self.num_heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        cos, sin = self._cos_sin(positions)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(self.kv_norm(kv).unsqueeze(1), cos, sin).squeeze(1)
        return q, kv, q_res

    def finish(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention output o [T, h, d] -> [T, hidden]: un-rope its rope dims at the query's
        position, then the grouped output projection."""
        t, g = o.shape[0], self.o_groups
        cos, sin = self._cos_sin(positions)
        o = rope_tail(o, cos, -sin).reshape(t, g, -1)
        w = self.o_a_proj.weight.view(g, self.o_lora_rank, -1)
        grouped = torch.bmm(o.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)   # [T, g, o_lora_rank]
        return self.o_b_proj(grouped.reshape(t, g * self.o_lora_rank))


def weight_sources(spec: ModelSpec, mixer: nn.Module, ours: str, hf: str) -> Sources:
    """The shared block's tensors: wq_a and wkv stacked into qkv_a_proj, the rest 1:1."""
    c, a, name = spec.compressed_attention, spec.attention, spec.weight_name
    d, h = a.head_dim, a.num_heads
    src = linear_sources(ours + "qkv_a_proj", hf, [(name("skv_q_a"), 0, c.q_lora_rank),
                                                    (name("skv_kv"), c.q_lora_rank, d)], False)
    src[ours + "q_a_norm.weight"] = [(hf + name("skv_q_a_norm"), 0, c.q_lora_rank)]
    src.update(linear_sources(ours + "q_b_proj", hf, [(name("skv_q_b"), 0, h * d)], False))
    src[ours + "kv_norm.weight"] = [(hf + name("skv_kv_norm"), 0, d)]
    src.update(linear_sources(ours + "o_a_proj", hf, [(name("skv_o_a"), 0, c.o_groups * c.o_lora_rank)], False))
    src.update(linear_sources(ours + "o_b_proj", hf, [(name("skv_o_b"), 0, spec.hidden_size)], False))
    src[ours + "sinks"] = [(hf + name("skv_sinks"), 0, h)]
    return src


def validate(spec: ModelSpec, fail: Fail) -> None:
    c, a = spec.compressed_attention, spec.attention
    for key in ("q_lora_rank", "o_groups", "o_lora_rank"):
        if getattr(c, key) <= 0:
            fail(f"compressed_attention.{key}", f"must be > 0, got {getattr(c, key)}")
    if a.num_kv_heads != 1:
        fail("attention.num_kv_heads", f"shared-KV attention has one key/value head, got {a.num_kv_heads}")
    if (a.num_heads * a.head_dim) % c.o_groups:
        fail("compressed_attention.o_groups", f"must divide num_heads * head_dim = {a.num_heads * a.head_dim}")
    if spec.rope.type == "none":
        fail("rope.type", "shared-KV attention needs a rope (its output is un-roped by the query's position)")


def import_hf(cfg: dict, spec: dict) -> None:
    """The section's shared sizes from DeepseekV4Config (the CSA / HCA kinds add theirs)."""
    spec["compressed_attention"] = {**spec.get("compressed_attention", {}), "q_lora_rank": cfg["q_lora_rank"],
                                    "o_groups": cfg["o_groups"], "o_lora_rank": cfg["o_lora_rank"]}
    spec["attention"]["num_kv_heads"] = 1
