"""Model specs: the YAML schema of the zoo, parsed into slotted dataclasses.

A spec declares everything the builder needs (sizes, per-layer kinds, norms, rope, MLP,
checkpoint source, HF weight names) so that a new architecture made of existing layer kinds
is YAML, not Python. The layer kinds come from the registry in `models.kinds`: it names the
kinds a spec may use, adds each kind's own section (`mamba2:`, `gated_deltanet:`) as an
optional field of `ModelSpec`, its checkpoint names to `weight_names`, and its checks.

Parsing is strict: unknown fields, wrong types and bad values raise a one-line ``SpecError``
that names the file and the field path, e.g.
``zoo/x.yaml: layers.pattern[2]: unknown layer kind 'ful'``.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from models import kinds as layer_kinds
from models.activations import ACTIVATIONS
from models.moe_spec import MoESpec, validate_moe   # the `moe:` section (re-exported here)
from models import hyper_connections   # the `hyper_connections:` section (mHC)
from models.hyper_connections import HyperConnectionSpec

# A spec's `dtype` name -> the torch dtype the builder and the engine use.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINT_SOURCES = ("hf", "embedded", "dummy")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "none")   # none: no positional rotation (Granite 4.0-H)


class SpecError(ValueError):
    """A user-fixable problem in a spec; the message is ``file: field.path: what``."""


@dataclass(slots=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool = False      # Qwen3: RMSNorm over each head of q and k before rope
    bias: bool = False         # bias on q/k/v projections (Qwen2)
    o_bias: bool = False
    output_gate: bool = False   # Qwen3-Next: q_proj also yields a per-head gate, out *= sigmoid(gate)
    scale: float | None = None  # explicit softmax scale (Granite's attention_multiplier)
    sliding_window: int | None = None          # W for sliding_attention layers
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this**-0.5, not head_dim**-0.5
    qk_norm_all_heads: bool = False   # OLMo 2/3: the q/k norms span the whole projection, not each head
    sinks: bool = False         # gpt-oss: a learned logit per head joins the softmax denominator
                                # (a virtual key with no value), loaded from `self_attn.sinks`


@dataclass(slots=True)
class MLPSpec:
    intermediate_size: int
    activation: str = "silu"   # silu -> SwiGLU, gelu_tanh -> GeGLU
    bias: bool = False
    gated: bool = True         # false: down(act(up(x))), no gate_proj (Nemotron-H's relu2 MLP)


@dataclass(slots=True)
class NormSpec:
    eps: float = 1e-6
    offset: float = 0.0        # Gemma stores w - 1: the norm multiplies by (offset + w)
    sandwich: bool = False     # Gemma 2/3: extra norms after attention and around the MLP


@dataclass(slots=True)
class RopeSpec:
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0          # llama3 scaling
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0               # yarn: the ramp between extrapolated and interpolated dims
    beta_slow: float = 1.0
    truncate: bool = True                 # yarn: round the ramp's ends to whole dims
    attention_factor: float | None = None  # yarn: cos/sin scale (None: 0.1 ln(factor) + 1, or the mscale ratio)
    mscale: float | None = None           # yarn (DeepSeek): attention_factor = mscale(factor, mscale) /
    mscale_all_dim: float | None = None   #   mscale(factor, mscale_all_dim) when both are set


@dataclass(slots=True)
class ResidualSpec:
    """Residuals that go on from the normed input (MiniMax's `postnorm`, DeepNorm-style): each
    sub-block continues the stream from its normed input, x <- alpha * norm(x) + beta * f(norm(x)),
    instead of x <- x + f(norm(x)). alpha and beta per sub-block, keyed by the layer's
    `layers` entry (e.g. lightning_attention) for the token mixer and `mlp` for the
    feed-forward block; keys left out are 1."""
    alpha: dict = field(default_factory=dict)
    beta: dict = field(default_factory=dict)

    def scales(self, key: str) -> tuple[float, float]:
        return float(self.alpha.get(key, 1.0)), float(self.beta.get(key, 1.0))


FFN_KINDS = ("mlp", "moe", "none")
NORM_POSITIONS = ("pre", "post")
NO_MIXER = "none"


@dataclass(slots=True)
class LayersSpec:
    """Per layer: its token mixer(s) and its feed-forward block.

    A `pattern` / `kinds` entry is a layer kind (`full_attention`), `none` (no token mixer:
    Nemotron-H's MLP-only and MoE-only layers) or kinds joined by `+`, which run in parallel
    on the same normed input and are summed (Falcon-H1's `full_attention+mamba2`). `ffn` is a
    pattern of `mlp`, `moe` or `none` (Nemotron-H's mixer-only layers), repeated to `num`;
    unset, a layer is `moe` where the `moe:` section selects it and `mlp` elsewhere."""
    num: int
    pattern: list = field(default_factory=lambda: ["full_attention"])  # repeated to `num`
    kinds: list | None = None  # explicit per-layer list; overrides pattern
    ffn: list | None = None
    # `pre` (norm each sub-block's input) or `post` (norm its output before the residual add,
    # OLMo 2/3), repeated to `num`; unset: every layer pre.
    norm_position: list | None = None

    def expand(self) -> list[str]:
        if self.kinds is not None:
            return list(self.kinds)
        return [self.pattern[i % len(self.pattern)] for i in range(self.num)]


def mixers_of(entry: str) -> list[str]:
    """The kinds of one `layers` entry: [] for `none`, the parts of a `+` parallel entry."""
    return [] if entry == NO_MIXER else entry.split("+")


@dataclass(slots=True)
class CheckpointSpec:
    source: str = "dummy"
    path: str | None = None    # hf: directory with *.safetensors (relative to the spec file)
    name: str | None = None    # embedded: registry name (models.embedded)
    seed: int = 0              # dummy: weights are seeded random
    init_std: float = 0.02
    # hf: tensor name prefixes of parts the model does not run (a multimodal checkpoint's
    # vision tower, multi-token-prediction layers): the loader skips them
    ignore: list = field(default_factory=list)


QUANT_METHODS = ("none", "gguf", "int8", "int4", "int4_asym")
# x of the products on quantized weights (models/quant.py): fp32 (exact), int8 per 32-block, or int8 for
# decode-sized products and bf16 on AMX tiles for prefill-sized ones (zooinfer_kernels/quant_gemm.py)
QUANT_ACTIVATIONS = ("float32", "int8", "int8_bf16")


@dataclass(slots=True)
class QuantizationSpec:
    """How linear weights are stored at run time (models/quant_load.py): `none` (the dtype),
    `gguf` (the checkpoint GGUF's blocks, kept quantized), `int8` (per output channel), `int4` /
    `int4_asym` (groups of `group_size`), the last three made by the loader from float weights."""
    method: str = "none"
    group_size: int = 32       # int4 / int4_asym
    lm_head: bool = True       # False: the head stays float (packed panels, fused greedy head)
    activations: str = "float32"   # int8: x rounded to int8 per 32; int8_bf16: bf16 prefill on AMX (models/quant.py)


# Where each of our parameters lives in an HF checkpoint. Per-layer names are relative to
# `layer` (with {i} the layer index). Defaults are the Llama family's names; each layer kind
# adds its own (attention's q/k/v/o, a state kind's mixer prefix) from models.kinds.
DEFAULT_WEIGHT_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "layer": "model.layers.{i}.",
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "pre_ffn_norm": "pre_feedforward_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
    **layer_kinds.weight_names(),
    **hyper_connections.WEIGHT_NAMES,
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    # An MoE block (models.moe): `moe` is its prefix under `layer` ("": its parts sit on the layer),
    # the others are relative to it. The `moe:` section's `style` may preset them (granite).
    "moe": "mlp",
    "moe_router": "gate",                 # {router}.weight, .bias, .e_score_correction_bias
    "moe_router_selection_bias": "e_score_correction_bias",   # {router}.{this}: the selection bias
    "moe_router_table": "tid2eid",        # {router}.{this}: a hash router's token id -> experts table
    "moe_experts": "experts",
    "moe_expert_gate": "gate_proj",       # per_expert layout: {experts}.{e}.{name}.weight (and .bias)
    "moe_expert_up": "up_proj",
    "moe_expert_down": "down_proj",       # fused layouts: {experts}.{name} (and {name}_bias)
    "moe_expert_gate_up": "gate_up_proj",  # fused layouts, gated experts
    "moe_shared": "shared_expert",        # {shared}.{name}.weight for the three below
    "moe_shared_gate": "gate_proj",
    "moe_shared_up": "up_proj",
    "moe_shared_down": "down_proj",
    "moe_shared_gate_up": "",             # set: the shared expert's gate and up are one fused linear
    "moe_shared_expert_gate": "shared_expert_gate",   # sigmoid gate of the shared expert, [1, hidden]
    "moe_latent_in": "fc1_latent_proj",   # latent_size: hidden -> latent before the experts
    "moe_latent_out": "fc2_latent_proj",  # ... and back after them
}


def _with_kind_sections(cls: type) -> type:
    """Give `cls` one optional field per layer kind that owns a section (models.kinds), in
    registry order after `rope_local`: the section is declared with its kind, and the checks
    require it once a layer has that kind."""
    annotations = {}
    for name, tp in cls.__annotations__.items():
        annotations[name] = tp
        if name == "rope_local":
            for kind in layer_kinds.sections():
                annotations[kind.section] = typing.Optional[kind.section_spec]
                setattr(cls, kind.section, None)
    cls.__annotations__ = annotations
    return cls


@dataclass(slots=True)
@_with_kind_sections
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    layers: LayersSpec
    attention: AttentionSpec
    mlp: MLPSpec
    norm: NormSpec = field(default_factory=NormSpec)
    rope: RopeSpec = field(default_factory=RopeSpec)
    rope_local: RopeSpec | None = None   # rope of sliding_attention layers (Gemma 3: theta 1e4)
    # here: one optional section per layer kind that owns one (mamba2, gated_deltanet, ...)
    moe: MoESpec | None = None            # MoE MLPs (others use `mlp`)
    embedding_multiplier: float = 1.0    # Gemma: sqrt(hidden_size)
    residual_multiplier: float = 1.0     # Granite: x + sublayer(x) * m
    residual: ResidualSpec | None = None  # MiniMax: x = alpha * norm(x) + beta * sublayer(norm(x))
    hyper_connections: HyperConnectionSpec | None = None   # DeepSeek-V4: n residual streams (mHC)
    logits_scaling: float = 1.0          # Granite: logits / s
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    max_model_len: int = 4096
    eos_token_ids: list = field(default_factory=list)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    quantization: QuantizationSpec = field(default_factory=QuantizationSpec)
    weight_names: dict = field(default_factory=dict)
    # Constant factors folded into checkpoint tensors as they load (Falcon-H1's muP multipliers):
    # tensor name (full, or relative to `layer` for every layer) -> a scale, or [[rows, scale], ...]
    # per row segment (a fused projection whose parts have their own multipliers).
    weight_scales: dict = field(default_factory=dict)
    tokenizer: str | None = None   # directory; defaults to the checkpoint directory
    tool_parser: str | None = None  # how the server finds tool calls in this model's text (e.g. hermes)
    speculative: dict | None = None  # default speculative decoding (runtime/spec_decode/config.py)
    mtp: dict | None = None          # multi-token-prediction layers in the checkpoint (models/mtp.py)
    source_file: str = ""          # set by the loader; never read from YAML

    @property
    def layer_kinds(self) -> list[str]:
        return self.layers.expand()

    @property
    def num_layers(self) -> int:
        return self.layers.num

    def layer_mixers(self, layer: int) -> list[str]:
        """The kinds of layer `layer`'s token mixers (none, one, or several in parallel)."""
        return mixers_of(self.layer_kinds[layer])

    def cache_layers(self) -> list[tuple[int, str]]:
        """(layer, kind) of every token mixer in model order: the index in this list is the
        mixer's cache id, which names its KV cache / state in the pool, its attention plan
        and its state op (a layer with no mixer has none; a parallel layer has several; a
        mixer whose kind owns several caches, `LayerKind.num_caches`, takes that many ids)."""
        return [(i, kind) for i, kind, ids in self.mixer_caches() for _ in ids]

    def mixer_caches(self) -> list[tuple[int, str, range]]:
        """(layer, kind, its cache ids) of every token mixer in model order."""
        out, next_id = [], 0
        for i in range(self.num_layers):
            for kind in self.layer_mixers(i):
                n = layer_kinds.KINDS[kind].num_caches
                out.append((i, kind, range(next_id, next_id + n)))
                next_id += n
        return out

    def ffn_kind(self, layer: int) -> str:
        """`mlp`, `moe` or `none` for layer `layer`."""
        if self.layers.ffn is not None:
            return self.layers.ffn[layer % len(self.layers.ffn)]
        return "moe" if self.moe is not None and self.moe.is_moe(layer) else "mlp"

    def post_norm(self, layer: int) -> bool:
        """Whether layer `layer` norms its sub-blocks' outputs (`layers.norm_position` post)."""
        pos = self.layers.norm_position
        return pos is not None and pos[layer % len(pos)] == "post"

    def weight_name(self, key: str) -> str:
        return self.weight_names.get(key, DEFAULT_WEIGHT_NAMES[key])

    def resolve_path(self, p: str) -> Path:
        """Paths in a spec are relative to the spec file; ``~`` expands."""
        path = Path(p).expanduser()
        if not path.is_absolute() and self.source_file:
            path = Path(self.source_file).parent / path
        return path


# ---------------------------------------------------------------- parsing

def _suggest(word: Any, options) -> str:
    """' (did you mean 'x'?)' for a likely typo (a prefix or a close spelling), else ''."""
    word = str(word)
    near = [o for o in options if word and o.startswith(word)] or difflib.get_close_matches(word, options, n=1)
    return f" (did you mean '{near[0]}'?)" if near else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_scalar(value: Any, tp: type, where: str, fail) -> Any:
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool, dict, list) and isinstance(value, tp):
        return value
    fail(where, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _build(cls: type, data: Any, where: str, fail) -> Any:
    """Dataclass from a dict: unknown keys, missing keys and wrong types are errors."""
    if not isinstance(data, dict):
        fail(where, f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source_file"}
    for key in data:
        if key not in fields:
            fail(_join(where, key), f"unknown field{_suggest(key, list(fields))}")
    kwargs = {}
    for name, f in fields.items():
        sub = _join(where, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                fail(sub, "required field is missing")
            continue
        value, tp = data[name], hints[name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and type(None) in typing.get_args(tp):
            kwargs[name] = None
            continue
        tp = args[0] if args else tp
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, sub, fail)
        else:
            kwargs[name] = _check_scalar(value, typing.get_origin(tp) or tp, sub, fail)
    return cls(**kwargs)


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _validate(spec: ModelSpec, fail) -> None:
    def positive(value: Any, where: str) -> None:
        if value <= 0:
            fail(where, f"must be > 0, got {value}")

    for where in ("vocab_size", "hidden_size", "max_model_len", "layers.num",
                  "attention.num_heads", "attention.num_kv_heads", "attention.head_dim",
                  "mlp.intermediate_size"):
        obj = spec
        for part in where.split("."):
            obj = getattr(obj, part)
        positive(obj, where)
    a = spec.attention
    if a.num_heads % a.num_kv_heads:
        fail("attention.num_kv_heads",
             f"num_heads {a.num_heads} is not a multiple of num_kv_heads {a.num_kv_heads}")
    lay = spec.layers
    kinds_field = "layers.kinds" if lay.kinds is not None else "layers.pattern"
    kinds = lay.kinds if lay.kinds is not None else lay.pattern
    if not kinds:
        fail(kinds_field, "must name at least one layer kind")
    if lay.kinds is not None and len(lay.kinds) != lay.num:
        fail("layers.kinds", f"lists {len(lay.kinds)} layers but layers.num is {lay.num}")
    used: set[str] = set()
    for i, entry in enumerate(kinds):
        if not isinstance(entry, str):
            fail(f"{kinds_field}[{i}]", f"expected a layer kind name, got {entry!r}")
        parts = mixers_of(entry)
        for kind in parts:
            if kind not in layer_kinds.KINDS:
                hint = _suggest(kind, list(layer_kinds.KINDS) + [NO_MIXER])
                fail(f"{kinds_field}[{i}]", f"unknown layer kind {kind!r}{hint}")
        attrs = [layer_kinds.KINDS[k].attr for k in parts]
        if len(set(attrs)) != len(attrs):
            fail(f"{kinds_field}[{i}]", f"{entry!r}: parallel mixers must be of different families "
                                         f"(two would share the layer attribute {attrs[0]!r})")
        used.update(parts)
    for where, values, allowed in (("layers.ffn", lay.ffn, FFN_KINDS),
                                   ("layers.norm_position", lay.norm_position, NORM_POSITIONS)):
        if values is None:
            continue
        if not values:
            fail(where, f"must name at least one of {', '.join(allowed)}")
        for i, value in enumerate(values):
            if value not in allowed:
                fail(f"{where}[{i}]", f"{value!r} is not one of {', '.join(allowed)}")
    if lay.ffn is not None and "moe" in lay.ffn and spec.moe is None:
        fail("layers.ffn", "moe layers need a 'moe:' section")
    for i in range(lay.num):
        if spec.post_norm(i) and (spec.norm.sandwich or not (spec.layer_mixers(i) and spec.ffn_kind(i) != "none")):
            fail("layers.norm_position", f"post norms need a mixer and a feed-forward block and no sandwich norms "
                                         f"(layer {i})")
        if not spec.layer_mixers(i) and spec.ffn_kind(i) == "none":
            fail(kinds_field, f"layer {i} has neither a token mixer nor a feed-forward block")
        if spec.norm.sandwich and not (spec.layer_mixers(i) and spec.ffn_kind(i) != "none"):
            fail("norm.sandwich", f"sandwich norms need a mixer and a feed-forward block in every layer (layer {i})")
    if spec.residual is not None:
        _validate_residual(spec, used_entries=set(spec.layer_kinds), fail=fail)
    if spec.hyper_connections is not None:
        hyper_connections.validate(spec.hyper_connections, fail)
        for key, clash in (("residual", spec.residual is not None), ("norm.sandwich", spec.norm.sandwich),
                           ("layers.norm_position", spec.layers.norm_position is not None),
                           ("residual_multiplier", spec.residual_multiplier != 1.0)):
            if clash:
                fail(key, "does not combine with hyper_connections (the streams replace the residual)")
        for i in range(spec.num_layers):
            if not spec.layer_mixers(i) or spec.ffn_kind(i) == "none":
                fail(kinds_field, f"hyper_connections need a token mixer and a feed-forward block in every "
                                  f"layer (layer {i})")
    choices = [("mlp.activation", spec.mlp.activation, ACTIVATIONS),
               ("dtype", spec.dtype, DTYPES),
               ("quantization.method", spec.quantization.method, QUANT_METHODS),
               ("checkpoint.source", spec.checkpoint.source, CHECKPOINT_SOURCES),
               ("rope.type", spec.rope.type, ROPE_TYPES)]
    if spec.rope_local is not None:
        choices.append(("rope_local.type", spec.rope_local.type, ROPE_TYPES))
    if spec.moe is not None:
        validate_moe(spec.moe, spec.num_layers, fail)
    for where, value, allowed in choices:
        if value not in allowed:
            fail(where, f"{value!r} is not one of {', '.join(allowed)}")
    for kind in layer_kinds.KINDS.values():
        if kind.name not in used:
            continue
        if kind.section_spec is not None and getattr(spec, kind.section) is None:
            fail(kind.section, f"layers of kind {kind.name} need a '{kind.section}:' section")
        kind.validate(spec, fail)
    if a.qk_norm_all_heads and not a.qk_norm:
        fail("attention.qk_norm_all_heads", "needs qk_norm: true")
    if a.query_pre_attn_scalar is not None and a.query_pre_attn_scalar <= 0:
        fail("attention.query_pre_attn_scalar", "must be > 0")
    if not 0 < spec.rope.partial_rotary_factor <= 1:
        fail("rope.partial_rotary_factor", "must be in (0, 1]")
    rotary = int(a.head_dim * spec.rope.partial_rotary_factor)
    if rotary % 2:
        fail("rope.partial_rotary_factor", f"rotary dim {rotary} must be even")
    if spec.quantization.activations not in QUANT_ACTIVATIONS:
        fail("quantization.activations", f"must be one of {', '.join(QUANT_ACTIVATIONS)}, "
                                         f"got {spec.quantization.activations!r}")
    if spec.quantization.group_size <= 0 or spec.quantization.group_size % 32:
        fail("quantization.group_size", f"must be a positive multiple of 32, got {spec.quantization.group_size}")
    ck = spec.checkpoint
    if ck.source == "hf" and not ck.path:
        fail("checkpoint.path", "source 'hf' needs a path to a safetensors directory")
    if ck.source == "embedded" and not ck.name:
        fail("checkpoint.name", "source 'embedded' needs a name (e.g. smollm2-135m)")
    for key, value in spec.weight_names.items():
        if key not in DEFAULT_WEIGHT_NAMES:
            fail(f"weight_names.{key}", f"unknown weight key; known: {', '.join(DEFAULT_WEIGHT_NAMES)}")
        if not isinstance(value, str):
            fail(f"weight_names.{key}", "expected a string")
    for key, value in spec.weight_scales.items():
        if not _is_scale(value):
            fail(f"weight_scales.{key}", f"expected a number or a list of [rows, scale] pairs, got {value!r}")
    if not all(isinstance(t, int) for t in spec.eos_token_ids):
        fail("eos_token_ids", "expected a list of token ids")


def _validate_residual(spec: ModelSpec, used_entries: set[str], fail) -> None:
    if spec.norm.sandwich:
        fail("residual", "normed-input residuals and sandwich norms do not combine")
    if spec.residual_multiplier != 1.0:
        fail("residual", "use residual.beta rather than residual_multiplier with normed-input residuals")
    if any(spec.post_norm(i) for i in range(spec.num_layers)):
        fail("residual", "normed-input residuals and layers.norm_position post do not combine")
    keys = sorted(used_entries - {NO_MIXER}) + ["mlp"]
    for name in ("alpha", "beta"):
        for key, value in getattr(spec.residual, name).items():
            if key not in keys:
                fail(f"residual.{name}.{key}", f"not a sub-block of this model (one of {', '.join(keys)})")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(f"residual.{name}.{key}", f"expected a number, got {value!r}")


def _is_scale(value: Any) -> bool:
    """A `weight_scales` value: a number, or [[rows > 0, number], ...]."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if number(value):
        return True
    return isinstance(value, list) and bool(value) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
        and p[0] > 0 and number(p[1]) for p in value)


def _merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else in `over` replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """Read one YAML file and resolve its `extends:` chain (relative to the file)."""
    if path in chain:
        raise SpecError(f"{path}: extends: cycle through {' -> '.join(map(str, chain + (path,)))}")
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{path}: {where}malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise SpecError(f"{path}: extends: expected a file path")
    base_path = (path.parent / parent).resolve()
    base = _read_yaml(base_path, chain + (path,))
    # The base's relative checkpoint path stays relative to the base file.
    ck = base.get("checkpoint")
    if isinstance(ck, dict) and isinstance(ck.get("path"), str) and not Path(ck["path"]).expanduser().is_absolute():
        if not (isinstance(data.get("checkpoint"), dict) and "path" in data["checkpoint"]):
            base["checkpoint"] = dict(ck, path=str(base_path.parent / ck["path"]))
    return _merge(base, data)


def spec_from_dict(data: dict, source: str = "<dict>") -> ModelSpec:
    def fail(where: str, msg: str) -> typing.NoReturn:
        raise SpecError(f"{source}: {where}: {msg}")

    spec = _build(ModelSpec, data, "", fail)
    _validate(spec, fail)
    spec.source_file = source if source != "<dict>" else ""
    return spec


def load_spec(path: str | Path) -> ModelSpec:
    """Load a zoo YAML spec (following `extends:`) and validate it."""
    path = Path(path)
    return spec_from_dict(_read_yaml(path.resolve()), str(path))


def spec_to_dict(spec: ModelSpec) -> dict:
    data = dataclasses.asdict(spec)
    data.pop("source_file")
    for key in ("kinds", "ffn", "norm_position"):
        if data["layers"][key] is None:
            data["layers"].pop(key)
    return data
