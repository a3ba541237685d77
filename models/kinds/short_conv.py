"""short_conv: LFM2's gated short convolution (mixer: models.short_conv.ShortConv), a state
layer whose only state is its conv tail, sized by a `short_conv:` section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from models.kinds.base import state_kind
from models.short_conv import ShortConv

if TYPE_CHECKING:
    from models.spec import ModelSpec


@dataclass(slots=True)
class ShortConvSpec:
    """The `short_conv:` section (channels = hidden_size)."""
    kernel: int = 3            # HF conv_L_cache
    bias: bool = False         # HF conv_bias: biases on in_proj, conv and out_proj


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    s = spec.short_conv
    return ShortConv(spec.hidden_size, s.kernel, s.bias)


def validate(spec: ModelSpec, fail) -> None:
    if spec.short_conv.kernel < 2:
        fail("short_conv.kernel", f"must be >= 2, got {spec.short_conv.kernel}")


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from LFM2's `conv_*` config fields."""
    spec["short_conv"] = {"kernel": cfg.get("conv_L_cache", 3), "bias": bool(cfg.get("conv_bias", False))}


KIND = state_kind("short_conv", ShortConvSpec, make_mixer, hf_prefix="conv", hf_layer_types=("conv",),
                  validate=validate, import_hf=import_hf)
