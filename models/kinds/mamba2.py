"""mamba2: the Mamba2 (SSD) state layer of Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1 and
Jamba-style hybrids (mixer: models.mamba2.Mamba2Mixer), sized by a `mamba2:` section."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from models.kinds.base import Fail, TPRule, state_kind
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
    proj_bias: bool = False              # in_proj (and out_proj unless out_proj_bias says)
    out_proj_bias: bool | None = None    # Falcon-H1's projectors_bias; None: proj_bias
    time_step_limit: list = field(default_factory=lambda: [0.0, float("inf")])
    gated_norm: str = "gate_then_norm"   # or norm_then_gate / none (Mamba2Mixer.GATED_NORMS)


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    m = spec.mamba2
    return Mamba2Mixer(spec.hidden_size, m.num_heads, m.head_dim, m.state_size, n_groups=m.n_groups,
                       conv_kernel=m.conv_kernel, chunk_size=m.chunk_size, use_conv_bias=m.conv_bias,
                       use_bias=m.proj_bias, rms_norm_eps=spec.norm.eps,
                       time_step_limit=tuple(m.time_step_limit), gated_norm=m.gated_norm,
                       out_bias=m.out_proj_bias)


def validate(spec: ModelSpec, fail: Fail) -> None:
    m = spec.mamba2
    if m.gated_norm not in Mamba2Mixer.GATED_NORMS:
        fail("mamba2.gated_norm", f"{m.gated_norm!r} is not one of {', '.join(Mamba2Mixer.GATED_NORMS)}")
    if m.num_heads % m.n_groups:
        fail("mamba2.n_groups", f"num_heads {m.num_heads} is not a multiple of n_groups {m.n_groups}")


_REQUIRED = object()


def _first(cfg: dict, names: tuple[str, ...], default: Any = _REQUIRED) -> Any:
    """The value of the first of `names` the config has (not None), else `default`; a
    required field missing raises KeyError naming its first spelling."""
    value = next((cfg[n] for n in names if cfg.get(n) is not None), default)
    if value is _REQUIRED:
        raise KeyError(names[0])
    return value


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from the Mamba2 config fields, in each family's spelling: Bamba /
    GraniteMoeHybrid / Falcon-H1 `mamba_*`, Nemotron-H `mamba_num_heads`, `ssm_state_size`,
    `n_groups`, ...; Falcon-H1's `mamba_d_ssm` (intermediate size), `projectors_bias`
    (out_proj) and `mamba_rms_norm` / `mamba_norm_before_gate` (the gated norm's order)."""
    heads, hidden = _first(cfg, ("mamba_n_heads", "mamba_num_heads")), cfg["hidden_size"]
    d_head = _first(cfg, ("mamba_d_head", "mamba_head_dim"), "auto")
    if d_head == "auto":
        d_head = (cfg.get("mamba_d_ssm") or _first(cfg, ("mamba_expand", "expand"), 2) * hidden) // heads
    gated_norm = "gate_then_norm"
    if cfg.get("mamba_rms_norm") is False:
        gated_norm = "none"
    elif cfg.get("mamba_rms_norm") and cfg.get("mamba_norm_before_gate"):
        gated_norm = "norm_then_gate"
    spec["mamba2"] = {
        "num_heads": heads, "head_dim": d_head, "state_size": _first(cfg, ("mamba_d_state", "ssm_state_size")),
        "n_groups": _first(cfg, ("mamba_n_groups", "n_groups"), 1),
        "conv_kernel": _first(cfg, ("mamba_d_conv", "conv_kernel"), 4),
        "chunk_size": _first(cfg, ("mamba_chunk_size", "chunk_size"), 256),
        "conv_bias": bool(_first(cfg, ("mamba_conv_bias", "use_conv_bias"), True)),
        "proj_bias": bool(cfg.get("mamba_proj_bias", False)),
        "out_proj_bias": cfg.get("projectors_bias"),
        "time_step_limit": [float(x) for x in cfg.get("time_step_limit") or (0.0, float("inf"))],
        "gated_norm": gated_norm}


def tp_segments(mixer: nn.Module) -> dict[str, list[int]]:
    """in_proj = z | x | B | C | dt and the conv over x | B | C: each block splits alone."""
    i, gn, h = mixer.intermediate_size, mixer.n_groups * mixer.state_size, mixer.num_heads
    proj, conv = [i, i, gn, gn, h], [i, gn, gn]
    return {"in_proj.weight": proj, "in_proj.bias": proj, "conv1d.weight": conv, "conv1d.bias": conv}


def tp_check(spec: ModelSpec, tp: int) -> str | None:
    g = spec.mamba2.n_groups
    if g % tp and g != 1:
        return f"mamba2.n_groups: {g} groups neither split over nor replicate to {tp} tensor-parallel ranks " \
               "(one group, or a multiple of the TP size)"
    return None


# Heads split; B and C groups split, or (one group) replicated, the gated norm then reduced
# over all ranks (models/parallel.py); the state pages hold the rank's heads.
TP = TPRule(split=("mamba2.num_heads",), split_or_replicate=("mamba2.n_groups",), segments=tp_segments,
            check=tp_check)

KIND = state_kind("mamba2", Mamba2Spec, make_mixer, hf_prefix="mamba", hf_layer_types=("mamba",),
                  validate=validate, import_hf=import_hf, tp=TP)
