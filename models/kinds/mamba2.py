"""mamba2: the Mamba2 (SSD) state layer of Bamba, Granite-4.0-H and Jamba-style hybrids
(mixer: models.mamba2.Mamba2Mixer), sized by a `mamba2:` section."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from models.kinds.base import state_kind
from models.mamba2 import Mamba2Mixer

if TYPE_CHECKING:
    from models.spec import ModelSpec


@dataclass(slots=True)
class Mamba2Spec:
    """The `mamba2:` section."""
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    expand: int | None = None            # intermediate = num_heads * head_dim
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: list = field(default_factory=lambda: [0.0, float("inf")])


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    m = spec.mamba2
    return Mamba2Mixer(spec.hidden_size, m.num_heads, m.head_dim, m.state_size, n_groups=m.n_groups,
                       conv_kernel=m.conv_kernel, chunk_size=m.chunk_size, use_conv_bias=m.conv_bias,
                       use_bias=m.proj_bias, rms_norm_eps=spec.norm.eps,
                       time_step_limit=tuple(m.time_step_limit))


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from Bamba / GraniteMoeHybrid `mamba_*` config fields."""
    heads, hidden = cfg["mamba_n_heads"], cfg["hidden_size"]
    d_head = cfg.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = cfg.get("mamba_expand", 2) * hidden // heads
    spec["mamba2"] = {
        "num_heads": heads, "head_dim": d_head, "state_size": cfg["mamba_d_state"],
        "n_groups": cfg.get("mamba_n_groups", 1), "conv_kernel": cfg.get("mamba_d_conv", 4),
        "chunk_size": cfg.get("mamba_chunk_size", 256), "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "proj_bias": bool(cfg.get("mamba_proj_bias", False)),
        "time_step_limit": [float(x) for x in cfg.get("time_step_limit") or (0.0, float("inf"))]}


KIND = state_kind("mamba2", Mamba2Spec, make_mixer, hf_prefix="mamba", hf_layer_types=("mamba",),
                  import_hf=import_hf)
