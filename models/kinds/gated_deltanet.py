"""gated_deltanet: Qwen3-Next's and Qwen3.5's linear attention, the gated delta rule (mixer:
models.gated_deltanet.GatedDeltaNet), sized by a `gated_deltanet:` section.

The two families differ only in how the checkpoint stores the input projections
(`projection`): Qwen3-Next's fused, per-key-head interleaved `in_proj_qkvz` / `in_proj_ba`
load as they are; Qwen3.5's separate `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`
are stacked by the loader into the same two fused linears (one GEMM each either way).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from models.gated_deltanet import PROJECTIONS, GatedDeltaNet
from models.kinds.base import Fail, Sources, state_kind

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
    projection: str = "interleaved"     # interleaved (Qwen3-Next) | split (Qwen3.5), see above


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    g = spec.gated_deltanet
    return GatedDeltaNet(spec.hidden_size, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim,
                         conv_kernel_size=g.conv_kernel, rms_norm_eps=spec.norm.eps, projection=g.projection)


def validate(spec: ModelSpec, fail: Fail) -> None:
    g = spec.gated_deltanet
    if g.projection not in PROJECTIONS:
        fail("gated_deltanet.projection", f"{g.projection!r} is not one of {', '.join(PROJECTIONS)}")
    if g.num_v_heads % g.num_k_heads:
        fail("gated_deltanet.num_v_heads", f"{g.num_v_heads} is not a multiple of num_k_heads {g.num_k_heads}")


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from the Qwen3-Next / Qwen3.5 `linear_*` config fields (the family sets
    `projection`)."""
    spec["gated_deltanet"] = {"num_k_heads": cfg["linear_num_key_heads"],
                              "num_v_heads": cfg["linear_num_value_heads"],
                              "head_k_dim": cfg["linear_key_head_dim"], "head_v_dim": cfg["linear_value_head_dim"],
                              "conv_kernel": cfg.get("linear_conv_kernel_dim", 4)}


_BASE = state_kind("gated_deltanet", GatedDeltaNetSpec, make_mixer, hf_prefix="linear_attn",
                   hf_layer_types=("linear_attention",), import_hf=import_hf, validate=validate)


def weight_sources(spec: ModelSpec, mixer: nn.Module, ours: str, hf: str) -> Sources:
    """Every parameter by its own name; with the split projection the two fused input linears
    are stacked from Qwen3.5's four: [in_proj_qkv | in_proj_z] and [in_proj_b | in_proj_a]."""
    src = _BASE.weight_sources(spec, mixer, ours, hf)
    if mixer.projection == "split":
        hf_mixer = f"{hf}{spec.weight_name('gated_deltanet')}."
        nv = mixer.num_v_heads
        src[ours + "in_proj_qkvz.weight"] = [(hf_mixer + "in_proj_qkv.weight", 0, mixer.conv_dim),
                                             (hf_mixer + "in_proj_z.weight", mixer.conv_dim, mixer.value_dim)]
        src[ours + "in_proj_ba.weight"] = [(hf_mixer + "in_proj_b.weight", 0, nv),
                                           (hf_mixer + "in_proj_a.weight", nv, nv)]
    return src


KIND = dataclasses.replace(_BASE, weight_sources=weight_sources)
