"""kda: Kimi-Linear's Kimi Delta Attention, the gated delta rule with a per-key-channel decay
(mixer: models.kda.KimiDeltaAttention), sized by a `kda:` section. A state kind: conv tails
and the recurrent state live in pool pages (float32), like gated_deltanet."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from models.kda import KimiDeltaAttention
from models.kinds.base import Fail, Sources, state_kind

if TYPE_CHECKING:
    from models.spec import ModelSpec


@dataclass(slots=True)
class KDASpec:
    """The `kda:` section (HF: linear_attn_config.num_heads / head_dim / short_conv_kernel_size)."""
    num_heads: int
    head_dim: int
    conv_kernel: int = 4


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    k = spec.kda
    return KimiDeltaAttention(spec.hidden_size, k.num_heads, k.head_dim, conv_kernel_size=k.conv_kernel,
                              rms_norm_eps=spec.norm.eps, hidden_act=spec.mlp.activation)


def weight_sources(spec: ModelSpec, mixer: nn.Module, ours: str, hf: str) -> Sources:
    """The mixer's checkpoint names (`checkpoint_sources`) under `<layer><kda prefix>.`."""
    prefix = f"{hf}{spec.weight_name('kda')}."
    return {ours + name: [(prefix + t, off, n) for t, off, n in parts]
            for name, parts in mixer.checkpoint_sources().items()}


def validate(spec: ModelSpec, fail: Fail) -> None:
    k = spec.kda
    for name in ("num_heads", "head_dim", "conv_kernel"):
        if getattr(k, name) <= 0:
            fail(f"kda.{name}", f"must be > 0, got {getattr(k, name)}")


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from Kimi-Linear's `linear_attn_config` (as the checkpoint writes it), else
    the flat `linear_*` fields transformers derives from it."""
    lac = cfg.get("linear_attn_config") or {}
    spec["kda"] = {"num_heads": lac.get("num_heads", cfg.get("linear_num_heads")),
                   "head_dim": lac.get("head_dim", cfg.get("linear_head_dim")),
                   "conv_kernel": lac.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))}


KIND = state_kind("kda", KDASpec, make_mixer, hf_prefix="self_attn", validate=validate, import_hf=import_hf,
                  weight_sources=weight_sources)
