"""full_attention and sliding_attention: the `Attention` mixer (models.layers) over the shared
`attention:` section; they differ in their KV cache (all blocks kept vs. a window), their rope
(`rope_local` for sliding layers) and the window they require. Their `_nope` twins
(SmolLM3's and Llama 4's NoPE layers) are the same layers with no positional rotation."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from cache.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from models.kinds.base import Fail, LayerKind, Sources, TPRule, linear_sources
from models.layers import Attention, RotaryEmbedding

if TYPE_CHECKING:
    from models.spec import ModelSpec

WEIGHT_NAMES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "sinks": "self_attn.sinks",
}


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    return Attention(spec, layer_id, rotary)


def make_nope_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    """NoPE: the rotary the layer is given is replaced by a no-op one (rope type none)."""
    nope = RotaryEmbedding(spec.attention.head_dim, dataclasses.replace(spec.rope, type="none"), 0)
    return Attention(spec, layer_id, nope)


def forward(mixer: nn.Module, layer_id: int, positions: torch.Tensor, hidden: torch.Tensor,
            kv_cache: torch.Tensor) -> torch.Tensor:
    return mixer(positions, hidden, kv_cache)


def weight_sources(spec: ModelSpec, mixer: nn.Module, ours: str, hf: str) -> Sources:
    """q, k, v stacked into qkv_proj (q doubled with Qwen3-Next's output gate), o_proj, and
    the q/k norms (per head, or over all heads) and the per-head sink logits when the spec has them."""
    a, name = spec.attention, spec.weight_name
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    qr = q * (2 if a.output_gate else 1)
    qkv = [(name("q"), 0, qr), (name("k"), qr, kv), (name("v"), qr + kv, kv)]
    src = linear_sources(ours + "qkv_proj", hf, qkv, a.bias)
    src.update(linear_sources(ours + "o_proj", hf, [(name("o"), 0, spec.hidden_size)], a.o_bias))
    if a.qk_norm:
        q_dim, k_dim = (q, kv) if a.qk_norm_all_heads else (a.head_dim, a.head_dim)
        src[ours + "q_norm.weight"] = [(hf + name("q_norm"), 0, q_dim)]
        src[ours + "k_norm.weight"] = [(hf + name("k_norm"), 0, k_dim)]
    if a.sinks:
        src[ours + "sinks"] = [(hf + name("sinks"), 0, a.num_heads)]
    return src


def full_cache_spec(spec: ModelSpec, mixer: nn.Module, block_size: int, dtype: torch.dtype) -> FullAttentionSpec:
    a = spec.attention
    return FullAttentionSpec(block_size, a.num_kv_heads, a.head_dim, dtype)


def sliding_cache_spec(spec: ModelSpec, mixer: nn.Module, block_size: int, dtype: torch.dtype) -> SlidingWindowSpec:
    a = spec.attention
    return SlidingWindowSpec(block_size, a.num_kv_heads, a.head_dim, dtype, a.sliding_window or 0)


def validate_sliding(spec: ModelSpec, fail: Fail) -> None:
    window = spec.attention.sliding_window
    if not (window and window > 0):
        fail("attention.sliding_window", "sliding_attention layers need a window > 0")


def import_sliding(cfg: dict, spec: dict) -> None:
    spec["attention"]["sliding_window"] = cfg.get("sliding_window")


def tp_check(spec: ModelSpec, tp: int) -> str | None:
    if spec.attention.qk_norm_all_heads:
        return "attention.qk_norm_all_heads: a q/k norm over all heads does not split over tensor-parallel ranks"
    return None


# Query heads split; KV heads split, or replicated when fewer than ranks (each rank then
# keeps the KV head its query heads read); o_proj is row parallel.
TP = TPRule(split=("attention.num_heads",), split_or_replicate=("attention.num_kv_heads",), check=tp_check)

_common = dict(section="attention", section_spec=None, attr="self_attn", forward=forward,
               weight_names=WEIGHT_NAMES, weight_sources=weight_sources, tp=TP)
_full = dict(cache_spec=full_cache_spec, **_common)
_sliding = dict(cache_spec=sliding_cache_spec, validate=validate_sliding, import_hf=import_sliding, **_common)

FULL = LayerKind(name="full_attention", make_mixer=make_mixer, hf_layer_types=("attention",), **_full)
SLIDING = LayerKind(name="sliding_attention", make_mixer=make_mixer, local_rope=True, **_sliding)
FULL_NOPE = LayerKind(name="full_attention_nope", make_mixer=make_nope_mixer, **_full)
SLIDING_NOPE = LayerKind(name="sliding_attention_nope", make_mixer=make_nope_mixer, **_sliding)
