"""The registry of layer kinds: one `LayerKind` entry per kind (see models/kinds/base.py).

`KINDS` maps each name a spec may write in `layers.pattern` / `layers.kinds` to its entry, in
the order error messages and suggestions list them. A new kind is one module here (its
section dataclass if it has one, its mixer factory, cache spec, weight names and importer
hook, gathered in one `LayerKind`, or `state_kind(...)` for a state layer) and one line below.
"""
from __future__ import annotations

from models.kinds import (attention, compressed_attention, gated_deltanet, kda, lightning_attention, mamba2, mla,
                          short_conv, swa_shared_kv)
from models.kinds.base import Fail, LayerKind, Sources, linear_sources, state_kind

KINDS: dict[str, LayerKind] = {k.name: k for k in (
    attention.FULL,
    attention.SLIDING,
    attention.FULL_NOPE, attention.SLIDING_NOPE,
    mamba2.KIND,
    gated_deltanet.KIND,
    short_conv.KIND,
    kda.KIND,
    mla.KIND,
    lightning_attention.KIND,
    swa_shared_kv.KIND,
    compressed_attention.CSA, compressed_attention.HCA,
)}


def sections() -> list[LayerKind]:
    """The kinds that own a section, in registry order, one per section (kinds may share
    theirs: DeepSeek-V4's attention kinds all read `compressed_attention:`); each section is
    one optional spec field."""
    seen: dict[str, LayerKind] = {}
    for k in KINDS.values():
        if k.section_spec is not None:
            seen.setdefault(k.section, k)
    return list(seen.values())


def weight_names() -> dict[str, str]:
    """Every kind's default checkpoint names (`weight_names:` keys), in registry order."""
    names: dict[str, str] = {}
    for kind in KINDS.values():
        names.update(kind.weight_names)
    return names


def from_hf_layer_type(layer_type: str) -> str:
    """Our kind for a name in an HF config's `layer_types` (unknown names pass through, for the
    spec to reject)."""
    for kind in KINDS.values():
        if layer_type in kind.hf_layer_types:
            return kind.name
    return layer_type


__all__ = ["Fail", "KINDS", "LayerKind", "Sources", "from_hf_layer_type", "linear_sources", "sections",
           "state_kind", "weight_names"]
