"""mla: multi-head latent attention (DeepSeek-V2/V3; Kimi-Linear's full-attention layers),
sized by an `mla:` section, heads from `attention.num_heads`.

Per token the layer projects hidden states to a compressed KV latent (`kv_lora_rank`,
RMS-normed) plus one key part shared by every head (`qk_rope_head_dim`, roped), and caches
only that `[latent | k_pe]` row (`MLASpec`: no per-head keys or values in the pool). Queries
come from hidden states directly (`q_lora_rank` null) or through a low-rank bottleneck with
its own norm. Attention runs absorbed, in every regime (decode and prefill alike): each
head's no-rope query is multiplied into latent space by its slice of `kv_b_proj`'s key part,
so scores are `[q_latent | q_pe] . [latent | k_pe]` over the cached rows (multi-query, one
kv head), and the attended latents go back out through `kv_b_proj`'s value part before
`o_proj`. That equals HF's expanded `DeepseekV3Attention` up to float rounding, reads each
cached byte once per step and never materialises per-head keys.

Variants: `rope_interleave` (DeepSeek's checkpoints pair rope dims as (x0, x1), (x2, x3), ...:
the pairs are de-interleaved before the engine's neox rotation, which is HF's own
formulation), `rope.type: none` (Kimi: the shared key part is used unrotated), yarn rope
(its mscale also scales the softmax, as in HF). The rope tables are the model's
(`attention.head_dim` must be `qk_rope_head_dim`, as in HF's config).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from attention.mla import mla_attention_op
from cache.kv_cache_spec import MLASpec
from models.kinds.attention import forward      # mixer(positions, hidden, kv_cache), as attention's
from models.kinds.base import Fail, LayerKind, Sources, TPRule, linear_sources
from models.layers import RMSNorm, RotaryEmbedding, yarn_mscale

if TYPE_CHECKING:
    from models.spec import ModelSpec


@dataclass(slots=True)
class MLASection:
    """The `mla:` section."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None    # null: q_proj straight from hidden states
    rope_interleave: bool = True      # rope dims stored in interleaved pairs (DeepSeek)
    bias: bool = False                # HF attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj
    norm_eps: float = 1e-6            # q_a_layernorm / kv_a_layernorm (HF builds them with the default)


WEIGHT_NAMES = {
    "mla_q": "self_attn.q_proj",
    "mla_q_a": "self_attn.q_a_proj",
    "mla_q_a_norm": "self_attn.q_a_layernorm.weight",
    "mla_q_b": "self_attn.q_b_proj",
    "mla_kv_a": "self_attn.kv_a_proj_with_mqa",
    "mla_kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "mla_kv_b": "self_attn.kv_b_proj.weight",
    "mla_o": "self_attn.o_proj",
}


class _Weight(nn.Module):
    """A bare weight (kv_b_proj's): the layer only ever slices it per head, so it is no
    `nn.Linear` and weight packing leaves it alone."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class MLAttention(nn.Module):
    """One MLA layer on the flattened token dimension (see the module docstring)."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        m, hidden = spec.mla, spec.hidden_size
        self.layer_id = layer_id
        self.num_heads = h = spec.attention.num_heads
        self.latent, self.rope_dim = m.kv_lora_rank, m.qk_rope_head_dim
        self.nope, self.v_dim = m.qk_nope_head_dim, m.v_head_dim
        self.q_lora_rank = m.q_lora_rank
        q_out = h * (self.nope + self.rope_dim)
        kv_a = self.latent + self.rope_dim
        if m.q_lora_rank:       # q_a_proj and kv_a_proj_with_mqa read the same input: one GEMM
            self.qkv_a_proj = nn.Linear(hidden, m.q_lora_rank + kv_a, bias=m.bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_a, bias=m.bias)
        self.kv_a_layernorm = RMSNorm(self.latent, m.norm_eps)
        self.kv_b_proj = _Weight(h * (self.nope + self.v_dim), self.latent)
        self.o_proj = nn.Linear(h * self.v_dim, hidden, bias=m.bias)
        self.rotary = rotary if rotary.rotary_dim else None
        self.interleave = m.rope_interleave
        self.scale = softmax_scale(spec)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_lora_rank:
            q_a, kv = self.qkv_a_proj(x).split([self.q_lora_rank, self.latent + self.rope_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q, kv = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_nope, q_pe = q.view(t, h, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = kv.split([self.latent, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.reshape(t, 1, self.rope_dim)
        if self.rotary is not None:
            if self.interleave:     # (x0, x1), (x2, x3), ... -> evens | odds, then neox rotation
                q_pe = torch.cat((q_pe[..., 0::2], q_pe[..., 1::2]), dim=-1)
                k_pe = torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)
            q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.latent)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :self.nope]).transpose(0, 1)    # [t, h, latent]
        queries = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)
        rows = torch.cat((latent, k_pe.view(t, self.rope_dim).to(latent.dtype)), dim=-1)  # what the cache keeps
        o = mla_attention_op()(queries, rows, kv_cache, self.layer_id, self.latent, self.scale)
        o = torch.bmm(o.transpose(0, 1), w[:, self.nope:].transpose(1, 2))               # [h, t, v_dim]
        return self.o_proj(o.transpose(0, 1).reshape(t, h * self.v_dim))


def softmax_scale(spec: ModelSpec) -> float:
    """`attention.scale`, else (qk_nope + qk_rope)^-0.5, times yarn's mscale(factor,
    mscale_all_dim)^2 when the rope is scaled and sets mscale_all_dim (HF's yarn_apply_mscale)."""
    if spec.attention.scale is not None:
        return spec.attention.scale
    m, rope = spec.mla, spec.rope
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    if rope.type not in ("default", "none") and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def cache_spec(spec: ModelSpec, mixer: nn.Module, block_size: int, dtype: torch.dtype) -> MLASpec:
    return MLASpec(block_size, kv_lora_rank=spec.mla.kv_lora_rank, rope_dim=spec.mla.qk_rope_head_dim, dtype=dtype)


def weight_sources(spec: ModelSpec, mixer: nn.Module, ours: str, hf: str) -> Sources:
    """HF's MLA tensors 1:1, except q_a_proj and kv_a_proj_with_mqa stacked into qkv_a_proj."""
    m, name, h = spec.mla, spec.weight_name, spec.attention.num_heads
    kv_a = m.kv_lora_rank + m.qk_rope_head_dim
    q_out = h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    if m.q_lora_rank:
        src = linear_sources(ours + "qkv_a_proj", hf, [(name("mla_q_a"), 0, m.q_lora_rank),
                                                        (name("mla_kv_a"), m.q_lora_rank, kv_a)], m.bias)
        src[ours + "q_a_layernorm.weight"] = [(hf + name("mla_q_a_norm"), 0, m.q_lora_rank)]
        src.update(linear_sources(ours + "q_b_proj", hf, [(name("mla_q_b"), 0, q_out)], False))
    else:
        src = linear_sources(ours + "q_proj", hf, [(name("mla_q"), 0, q_out)], False)
        src.update(linear_sources(ours + "kv_a_proj_with_mqa", hf, [(name("mla_kv_a"), 0, kv_a)], m.bias))
    src[ours + "kv_a_layernorm.weight"] = [(hf + name("mla_kv_a_norm"), 0, m.kv_lora_rank)]
    src[ours + "kv_b_proj.weight"] = [(hf + name("mla_kv_b"), 0, h * (m.qk_nope_head_dim + m.v_head_dim))]
    src.update(linear_sources(ours + "o_proj", hf, [(name("mla_o"), 0, spec.hidden_size)], m.bias))
    return src


def validate(spec: ModelSpec, fail: Fail) -> None:
    m = spec.mla
    for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if getattr(m, field) <= 0:
            fail(f"mla.{field}", f"must be > 0, got {getattr(m, field)}")
    if m.qk_rope_head_dim < 0 or m.qk_rope_head_dim % 2:
        fail("mla.qk_rope_head_dim", f"must be even and >= 0, got {m.qk_rope_head_dim}")
    if m.q_lora_rank is not None and m.q_lora_rank <= 0:
        fail("mla.q_lora_rank", f"must be > 0 or null, got {m.q_lora_rank}")
    rotary = int(spec.attention.head_dim * spec.rope.partial_rotary_factor)
    if spec.rope.type != "none" and rotary != m.qk_rope_head_dim:
        fail("attention.head_dim", f"mla layers rotate qk_rope_head_dim = {m.qk_rope_head_dim} dims with the "
                                   f"model's rope, which spans {rotary}: set head_dim to {m.qk_rope_head_dim}")


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from DeepSeek-style config fields (DeepseekV3Config, KimiLinearConfig)."""
    spec["mla"] = {"kv_lora_rank": cfg["kv_lora_rank"], "q_lora_rank": cfg.get("q_lora_rank"),
                   "qk_nope_head_dim": cfg["qk_nope_head_dim"], "qk_rope_head_dim": cfg["qk_rope_head_dim"],
                   "v_head_dim": cfg["v_head_dim"], "rope_interleave": bool(cfg.get("rope_interleave", True)),
                   "bias": bool(cfg.get("attention_bias", False))}
    spec["attention"]["head_dim"] = cfg["qk_rope_head_dim"]


# Heads split (q_b_proj, kv_b_proj rows per head; o_proj row parallel); the latent cache
# and the low-rank down projections are replicated, so every rank's pages hold the same rows.
TP = TPRule(split=("attention.num_heads",))

KIND = LayerKind(name="mla", tp=TP, section="mla", section_spec=MLASection, attr="self_attn", make_mixer=MLAttention,
                 forward=forward, cache_spec=cache_spec, weight_names=WEIGHT_NAMES, weight_sources=weight_sources,
                 validate=validate, import_hf=import_hf)
