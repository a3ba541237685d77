"""gated_deltanet: Qwen3-Next's linear attention, the gated delta rule (mixer:
models.gated_deltanet.GatedDeltaNet), sized by a `gated_deltanet:` section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from models.gated_deltanet import GatedDeltaNet
from models.kinds.base import state_kind

if TYPE_CHECKING:
    from models.spec import ModelSpec


@dataclass(slots=True)
class GatedDeltaNetSpec:
    """The `gated_deltanet:` section."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    g = spec.gated_deltanet
    return GatedDeltaNet(spec.hidden_size, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim,
                         conv_kernel_size=g.conv_kernel, rms_norm_eps=spec.norm.eps)


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from Qwen3-Next `linear_*` config fields."""
    spec["gated_deltanet"] = {"num_k_heads": cfg["linear_num_key_heads"],
                              "num_v_heads": cfg["linear_num_value_heads"],
                              "head_k_dim": cfg["linear_key_head_dim"], "head_v_dim": cfg["linear_value_head_dim"],
                              "conv_kernel": cfg.get("linear_conv_kernel_dim", 4)}


KIND = state_kind("gated_deltanet", GatedDeltaNetSpec, make_mixer, hf_prefix="linear_attn",
                  hf_layer_types=("linear_attention",), import_hf=import_hf)
