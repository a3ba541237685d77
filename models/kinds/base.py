"""What a layer kind is: one `LayerKind` entry, and the helpers state kinds share.

The spec, the builder, the decoder layer and the HF importer know nothing about any one kind:
they loop over the registry (`models.kinds.KINDS`) and call these fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch
from torch import nn

from cache.kv_cache_spec import KVCacheSpec, StateSpec

if TYPE_CHECKING:
    from models.spec import ModelSpec

Fail = Callable[[str, str], NoReturn]     # fail(field path, message) raises the one-line SpecError
Sources = dict[str, list[tuple[str, int, int]]]   # our param -> [(checkpoint tensor, row offset, rows)];
#   (name, None, None) parts: stacked in order, rows as the checkpoint has them (models.loader)


def _nothing(*args: Any) -> None:
    return None


@dataclass(frozen=True)
class TPRule:
    """How a kind's layers split over tensor-parallel ranks (applied by models/parallel.py).

    `split`: spec fields (dotted paths, e.g. "attention.num_heads") divided by the TP size (each rank a contiguous
    1/tp of them, e.g. query heads); `split_or_replicate`: divided when the TP size divides
    them, else every rank keeps one (KV heads, Mamba2 groups: fewer than ranks are
    replicated, rank r takes number r * n // tp). The rank's mixer is then built from the
    divided section, and every parameter whose shape shrank takes its rank's rows (dim 0:
    column parallel) or columns (last dims: row parallel, the linear's output all-reduced).
    `segments(mixer)`: param name -> the sizes of the independently split blocks of its
    sharded dim, for fused params whose checkpoint parts do not say it (Mamba2's
    in_proj = z | x | B | C | dt); missing params split as their checkpoint parts, or whole.
    `check(spec, tp)`: a one-line reason the kind cannot take this TP size, or None."""
    split: tuple[str, ...] = ()
    split_or_replicate: tuple[str, ...] = ()
    segments: Callable[[nn.Module], dict[str, list[int]]] = lambda mixer: {}
    check: Callable[[ModelSpec, int], str | None] = _nothing


@dataclass(frozen=True)
class LayerKind:
    """One layer kind: everything the rest of the engine needs to parse, build, cache, load and
    import a layer of it. Call signatures are in the comments."""
    name: str                       # as written in layers.pattern / layers.kinds
    section: str                    # the top-level YAML section its sizes come from
    # The section's dataclass when the kind owns it: the spec then has an optional field of
    # that name and type, required once a layer has this kind. None: a shared section the
    # spec always has (`attention`).
    section_spec: type | None
    attr: str                       # DecoderLayer attribute holding the mixer; "mixer" marks a
                                    # state layer, which the runtime updates via zooinfer::state_update
    make_mixer: Callable[[ModelSpec, int, nn.Module], nn.Module]             # (spec, layer id, rotary)
    forward: Callable[[nn.Module, int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                                    # (mixer, layer id, positions, hidden, this layer's cache) -> out
    cache_spec: Callable[[ModelSpec, nn.Module, int, torch.dtype], KVCacheSpec]  # (spec, mixer, block size, dtype)
    weight_names: dict[str, str]    # default checkpoint names it adds to `weight_names:` keys
    weight_sources: Callable[[ModelSpec, nn.Module, str, str], Sources]     # (spec, mixer, ours, hf prefix)
    validate: Callable[[ModelSpec, Fail], None] = _nothing   # checks once a layer has this kind
    hf_layer_types: tuple[str, ...] = ()   # its names in an HF config's `layer_types`
    import_hf: Callable[[dict, dict], None] = _nothing        # (HF config, derived spec dict): fill its fields
    local_rope: bool = False        # takes `rope_local` when the spec has one (Gemma 3's sliding layers)
    derived_tensors: tuple[str, ...] = ()   # checkpoint tensor name suffixes it recomputes (decay
                                    # tables HF saves as buffers): the loader skips them
    tp: TPRule | None = None        # its tensor-parallel sharding; None: tp > 1 refuses the kind
    num_caches: int = 1             # caches one mixer owns (consecutive cache ids); above 1 its
                                    # `cache_spec` returns that many specs and `forward` gets a list


def linear_sources(ours: str, hf: str, parts: list[tuple[str, int, int]], bias: bool) -> Sources:
    """A (possibly fused) linear `ours` filled from checkpoint linears `hf + name` stacked along
    dim 0: parts are (name, row offset, rows); biases likewise when `bias`."""
    src = {ours + ".weight": [(hf + p + ".weight", off, n) for p, off, n in parts]}
    if bias:
        src[ours + ".bias"] = [(hf + p + ".bias", off, n) for p, off, n in parts]
    return src


def state_forward(mixer: nn.Module, layer_id: int, positions: torch.Tensor, hidden: torch.Tensor,
                  pages: torch.Tensor) -> torch.Tensor:
    """Run a state layer on this step's requests.

    `pages` is the layer's view of the pool ([num_blocks, page elements]). The projections
    run in the graph; the state update (gather the requests' states from their pages into
    one contiguous batch, update them, write them back) is the `zooinfer::state_update`
    custom op, which finds the step's plan in the forward context by `layer_id`, so the
    model compiles with fullgraph=True and the graph never sees host-side batch facts.
    """
    return mixer.forward_paged(hidden, pages, layer_id)


def state_cache_spec(spec: ModelSpec, mixer: nn.Module, block_size: int, dtype: torch.dtype) -> StateSpec:
    """The mixer's `state_shapes()` per request, kept in float32 whatever the model dtype."""
    return StateSpec(block_size, shapes=tuple(mixer.state_shapes().items()), dtype=torch.float32)


def state_kind(name: str, section_spec: type, make_mixer, hf_prefix: str, weight_sources=None,
               **extra) -> LayerKind:
    """A state layer kind (Mamba2-like): its own section `name:`, the mixer under `mixer`
    (with `forward_paged`, `update_states`, `state_shapes`), float32 state in pool pages, and
    (unless the kind gives its own `weight_sources`) every mixer parameter loaded from
    `<layer prefix><prefix>.<param name>`, where the prefix is the `weight_names` key `name`
    (default `hf_prefix`)."""
    def one_to_one(spec: ModelSpec, mixer: nn.Module, ours: str, hf: str) -> Sources:
        prefix = spec.weight_name(name)
        return {ours + pname: [(f"{hf}{prefix}.{pname}", 0, p.shape[0])] for pname, p in mixer.named_parameters()}

    return LayerKind(name=name, section=name, section_spec=section_spec, attr="mixer", make_mixer=make_mixer,
                     forward=state_forward, cache_spec=state_cache_spec, weight_names={name: hf_prefix},
                     weight_sources=weight_sources or one_to_one, **extra)


__all__ = ["Fail", "LayerKind", "Sources", "TPRule", "linear_sources", "state_cache_spec", "state_forward",
           "state_kind"]
