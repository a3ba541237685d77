"""gated_deltanet: linear attention by the gated delta rule, sized by a `gated_deltanet:`
section. Three checkpoint layouts share the conv and delta-rule code (models.gated_deltanet):
Qwen3-Next's fused, per-key-head interleaved projections (`GatedDeltaNet`), OLMo-Hybrid's
separate q/k/v/g/b/a projections with beta in [0, 2] (`SeparateGatedDeltaNet`), and Qwen3.5's
in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (`Qwen3_5GatedDeltaNet`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from models.gated_deltanet import GatedDeltaNet, Qwen3_5GatedDeltaNet, SeparateGatedDeltaNet
from models.kinds.base import Sources, TPRule, state_kind

if TYPE_CHECKING:
    from models.spec import ModelSpec

LAYOUTS = {"qwen3_next": GatedDeltaNet, "separate": SeparateGatedDeltaNet, "qwen3_5": Qwen3_5GatedDeltaNet}


@dataclass(slots=True)
class GatedDeltaNetSpec:
    """The `gated_deltanet:` section."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    layout: str = "qwen3_next"        # projections: qwen3_next (fused, interleaved) | separate (OLMo-Hybrid)
    #                                   | qwen3_5 (split per part)
    allow_neg_eigval: bool = False    # beta = 2 * sigmoid(b) (OLMo-Hybrid's linear_allow_neg_eigval)
    norm_eps: float | None = None     # the gated output norm's eps; None: norm.eps


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    g = spec.gated_deltanet
    return LAYOUTS[g.layout](spec.hidden_size, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim,
                             conv_kernel_size=g.conv_kernel, allow_neg_eigval=g.allow_neg_eigval,
                             rms_norm_eps=spec.norm.eps if g.norm_eps is None else g.norm_eps)


def weight_sources(spec: ModelSpec, mixer: nn.Module, ours: str, hf: str) -> Sources:
    """The layout's checkpoint names (`checkpoint_sources`) under `<layer><gated_deltanet prefix>.`."""
    prefix = f"{hf}{spec.weight_name('gated_deltanet')}."
    return {ours + name: [(prefix + t, off, n) for t, off, n in parts]
            for name, parts in mixer.checkpoint_sources().items()}


def validate(spec: ModelSpec, fail) -> None:
    g = spec.gated_deltanet
    if g.layout not in LAYOUTS:
        fail("gated_deltanet.layout", f"{g.layout!r} is not one of {', '.join(LAYOUTS)}")
    if g.num_v_heads % g.num_k_heads:
        fail("gated_deltanet.num_v_heads", f"{g.num_v_heads} is not a multiple of num_k_heads {g.num_k_heads}")


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from the `linear_*` config fields (Qwen3-Next, OLMo-Hybrid); the layout and
    the norm's eps are the family's (its adjust hook)."""
    spec["gated_deltanet"] = {"num_k_heads": cfg["linear_num_key_heads"],
                              "num_v_heads": cfg["linear_num_value_heads"],
                              "head_k_dim": cfg["linear_key_head_dim"], "head_v_dim": cfg["linear_value_head_dim"],
                              "conv_kernel": cfg.get("linear_conv_kernel_dim", 4),
                              "allow_neg_eigval": bool(cfg.get("linear_allow_neg_eigval", False))}


def tp_segments(mixer: nn.Module) -> dict[str, list[int]]:
    """The conv over q | k | v; the separate / qwen3_5 in_proj = q | k | v | z | b | a (qwen3_next's
    fused projections interleave per key head, so a contiguous split is a split by key heads)."""
    kd, vd, hv = mixer.key_dim, mixer.value_dim, mixer.num_v_heads
    seg = {"conv1d.weight": [kd, kd, vd]}
    if hasattr(mixer, "in_proj"):
        seg["in_proj.weight"] = [kd, kd, vd, vd, hv, hv]
    return seg


# Key and value heads split (value heads stay grouped with their key head); the state pages
# hold the rank's heads; out_proj is row parallel.
TP = TPRule(split=("gated_deltanet.num_k_heads", "gated_deltanet.num_v_heads"), segments=tp_segments)

KIND = state_kind("gated_deltanet", GatedDeltaNetSpec, make_mixer, hf_prefix="linear_attn",
                  hf_layer_types=("linear_attention",), import_hf=import_hf, validate=validate,
                  weight_sources=weight_sources, tp=TP)
