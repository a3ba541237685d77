"""Derive a ModelSpec from an HF checkpoint directory's config.json: one reader for every
model_type, the families' traits from `models.hf_families`.

`LLM(hf_dir)` uses this directly; `python -m models.import_hf <hf_dir> -o spec.yaml`
writes the derived spec so it can be edited, extended and kept in the zoo.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from models.activations import HF_NAMES
from models.hf_families import _FAMILIES
from models.kinds import KINDS, from_hf_layer_type
from models.spec import DEFAULT_WEIGHT_NAMES, DTYPES, ModelSpec, SpecError, mixers_of, spec_from_dict, spec_to_dict

# Config fields that name a mechanism the zoo does not have: a value other than the listed
# harmless ones fails, naming the field.
_UNSUPPORTED = {
    "final_logit_softcapping": (None,), "attn_logit_softcapping": (None,),
    "use_post_attention_norm": (None, False), "use_qk_layernorm": (None, False),
    "use_parallel_residual": (None, False), "alibi": (None, False),
    # DeepSeek-V2's group_limited_greedy ranks groups by their best expert, not their best two
    "topk_method": (None, "greedy", "noaux_tc"), "scoring_func": (None, "softmax", "sigmoid", "sqrtsoftplus"),
}


def moe_from_hf(cfg: dict, fixed: dict | None = None) -> dict | None:
    """The `moe:` section from an HF config's MoE fields, read under the spellings families use
    (num_experts / num_local_experts / n_routed_experts, moe_intermediate_size, shared sizes,
    n_group, routed_scaling_factor, ...). `fixed`: the family's traits config.json does not
    spell out (scoring, selection bias, expert activation, style); they win."""
    def first(*keys, default=None):
        return next((cfg[k] for k in keys if cfg.get(k) is not None), default)

    moe_inter = first("moe_intermediate_size", "intermediate_size")
    shared = first("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                   "shared_intermediate_size")
    if shared is None:
        shared = first("n_shared_experts", "num_shared_experts", default=0) * (moe_inter or 0)
    moe = {"num_experts": first("num_experts", "num_local_experts", "n_routed_experts", default=0),
           "num_experts_per_tok": first("num_experts_per_tok", "num_experts_per_token", default=0),
           "intermediate_size": moe_inter,
           "shared_expert_intermediate_size": shared,
           "norm_topk_prob": bool(first("norm_topk_prob", "moe_renormalize", default=True)),
           "decoder_sparse_step": cfg.get("decoder_sparse_step") or 1,
           "mlp_only_layers": list(cfg.get("mlp_only_layers") or []),
           "n_group": first("n_group", "num_expert_group", default=1),
           "topk_group": cfg.get("topk_group") or 1,
           "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
           "dense_bias": bool(cfg.get("mlp_bias", False))}   # Nemotron-H: its shared expert is an MLP too
    if shared:   # Qwen's spelling comes with a sigmoid gate; n_shared_experts & co (DeepSeek, Nemotron-H) do not
        moe["shared_expert_gate"] = cfg.get("shared_expert_intermediate_size") is not None
    if cfg.get("scoring_func"):                     # DeepSeek-V2/V3 style configs spell it out
        moe["scoring"] = cfg["scoring_func"]
    if cfg.get("topk_method") == "noaux_tc":         # ... and the selection bias
        moe["selection_bias"] = True
    if cfg.get("moe_latent_size"):
        moe["latent_size"] = cfg["moe_latent_size"]
    for key in ("swiglu_alpha", "swiglu_limit"):
        if cfg.get(key) is not None:
            moe[key] = float(cfg[key])
    moe.update(fixed or {})
    # no routed experts: a dense MLP, except where the style makes every layer this block
    # (granite: then just the shared MLP)
    if not moe["num_experts"] and (moe.get("style") != "granite" or not moe["shared_expert_intermediate_size"]):
        return None
    return moe


def ffn_from_hf(cfg: dict, num_layers: int) -> list[str] | None:
    """`layers.ffn` where the config says which layers are dense: Kimi's mlp_layer_types
    (dense / sparse), DeepSeek's first_k_dense_replace (with V2's moe_layer_freq). None: the
    `moe:` section's decoder_sparse_step / mlp_only_layers decide (Qwen)."""
    if cfg.get("mlp_layer_types"):
        return ["mlp" if t == "dense" else "moe" for t in cfg["mlp_layer_types"]]
    if cfg.get("first_k_dense_replace") is not None:
        k, freq = cfg["first_k_dense_replace"], cfg.get("moe_layer_freq") or 1
        return ["moe" if i >= k and i % freq == 0 else "mlp" for i in range(num_layers)]
    return None


def _rope(cfg: dict, params: dict | None = None) -> dict:
    if params is None:
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = params["rope_theta"] if "rope_theta" in params else cfg.get("rope_theta", 10000.0)
    if theta is None:     # OLMo-Hybrid's released checkpoints: rope_theta null means no rope
        return {"type": "none"}
    rope = {"theta": float(theta), "type": params.get("rope_type", params.get("type", "default"))}
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf is not None:
        rope["partial_rotary_factor"] = float(prf)
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "beta_fast", "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            rope[key] = params[key]
    if rope["type"] == "yarn" and "factor" not in rope and "original_max_position_embeddings" in rope:
        rope["factor"] = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]   # as HF
    return rope


def _hf_layer_types(cfg: dict) -> list[str]:
    """The config's per-layer type list: `layer_types`, or `layers_block_type` (Nemotron-H,
    whose `hybrid_override_pattern` transformers expands into it)."""
    return list(cfg.get("layer_types") or cfg.get("layers_block_type") or [])


def _num_layers(cfg: dict) -> int:
    """num_hidden_layers, or the length of the layer type list (Nemotron-H has no count)."""
    if cfg.get("num_hidden_layers") is None and _hf_layer_types(cfg):
        return len(_hf_layer_types(cfg))
    return cfg["num_hidden_layers"]


def _layer_kinds(cfg: dict, traits: dict, where: Path) -> list[str]:
    """Our kind per layer: from attn_layer_indices (Bamba), else from `layer_types` (the
    family's own spellings first, then each kind's `hf_layer_types`), else all attention
    (sliding when the config has a window and no per-layer types, as Mistral)."""
    num_layers = _num_layers(cfg)
    if traits.get("every_layer"):
        return [traits["every_layer"]] * num_layers
    if traits.get("non_attn_layers"):
        attn = set(cfg.get("attn_layer_indices") or [])
        return ["full_attention" if i in attn else traits["non_attn_layers"] for i in range(num_layers)]
    aliases = traits.get("layer_types", {})
    kinds = [aliases.get(t) or from_hf_layer_type(t) for t in _hf_layer_types(cfg)]
    for i, kind in enumerate(kinds):
        if not all(k in KINDS for k in mixers_of(kind)):
            raise SpecError(f"{where}: layer_types[{i}]: {_hf_layer_types(cfg)[i]!r} is not a layer kind we have "
                            f"(known: {', '.join(KINDS)})")
    if kinds:
        return kinds
    windowed = cfg.get("sliding_window") and cfg.get("use_sliding_window", True) is not False
    return ["sliding_attention" if windowed else "full_attention"] * num_layers


def _no_rope(cfg: dict, kinds: list[str], where: Path) -> list[str]:
    """`no_rope_layers` (SmolLM3, Llama 4): a 0 at layer i makes its attention kind the `_nope`
    twin (no rotary), a 1 keeps rope."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        return kinds
    if len(flags) < len(kinds):
        raise SpecError(f"{where}: no_rope_layers: lists {len(flags)} layers but num_hidden_layers is {len(kinds)}")
    out = []
    for i, (kind, rope) in enumerate(zip(kinds, flags)):
        if not rope and kind + "_nope" not in KINDS:
            raise SpecError(f"{where}: no_rope_layers[{i}]: layer {i} is {kind!r}, which has no NoPE variant")
        out.append(kind if rope else kind + "_nope")
    return out


def _eos(cfg: dict, hf_dir: Path) -> list[int]:
    """eos_token_id of config.json, then generation_config.json's extra ones."""
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    gen = hf_dir / "generation_config.json"
    if gen.exists():
        g_eos = json.loads(gen.read_text()).get("eos_token_id")
        for t in [g_eos] if isinstance(g_eos, int) else (g_eos or []):
            if t not in eos:
                eos.append(t)
    return eos


def spec_dict_from_hf_config(cfg: dict, hf_dir: Path) -> dict:
    """The spec dict of an HF config: every field read by name, the family's traits on top."""
    where = hf_dir / "config.json"
    model_type = cfg.get("model_type")
    traits = _FAMILIES.get(model_type, {})
    for key, harmless in _UNSUPPORTED.items():
        if cfg.get(key) not in harmless:
            raise SpecError(f"{where}: {key}: {cfg[key]!r}: this mechanism is not supported yet")
    kinds = _no_rope(cfg, _layer_kinds(cfg, traits, where), where)
    rope_params = cfg.get("rope_parameters") or {}
    per_kind = isinstance(rope_params.get("full_attention"), dict)
    heads = cfg["num_attention_heads"]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in HF_NAMES:
        raise SpecError(f"{where}: hidden_act: {act!r} is not supported (known: {', '.join(HF_NAMES)})")
    attn_bias = bool(cfg.get("attention_bias", False))
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    gemma = traits.get("gemma", False)
    num_layers = _num_layers(cfg)
    spec = {
        "name": hf_dir.name,
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "layers": ({"num": num_layers, "pattern": [kinds[0]]} if len(set(kinds)) == 1
                   else {"num": num_layers, "kinds": list(kinds)}),
        "attention": {
            "num_heads": heads,
            "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "qk_norm": traits.get("qk_norm", False),
            "bias": traits.get("qkv_bias", attn_bias),
            "o_bias": bool(cfg.get("attention_out_bias", attn_bias and not traits.get("qkv_bias", False))),
            "sliding_window": None,     # the sliding_attention kind's importer sets it
            "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar") if gemma else None,
        },
        # MoE-only models (Qwen3.5-MoE) have no dense MLP size: the unused section takes the experts'
        "mlp": {"intermediate_size": cfg.get("intermediate_size") or cfg.get("moe_intermediate_size")
                or cfg["intermediate_size"], "activation": HF_NAMES[act],
                "bias": bool(cfg.get("mlp_bias", False))},
        "norm": {"eps": float(cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", 1e-6))),
                 "offset": 1.0 if gemma or traits.get("offset_norm") else 0.0,
                 "sandwich": gemma},
        "rope": _rope(cfg, rope_params["full_attention"] if per_kind else None),
        "rope_local": _rope(cfg, rope_params["sliding_attention"]) if per_kind else None,
        "embedding_multiplier": float(cfg["hidden_size"]) ** 0.5 if gemma else 1.0,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "dtype": dtype if dtype in DTYPES else "float32",
        "max_model_len": int(cfg.get("max_position_embeddings", 4096)),
        "eos_token_ids": _eos(cfg, hf_dir),
        "checkpoint": {"source": "hf", "path": str(hf_dir.resolve())},
    }
    if traits.get("ffn_types"):
        spec["layers"]["ffn"] = [traits["ffn_types"].get(t, "none") for t in _hf_layer_types(cfg)]
    used = {k for entry in kinds for k in mixers_of(entry)}
    for kind in KINDS.values():     # each kind present reads its own fields (its section, a window)
        if kind.name in used:
            kind.import_hf(cfg, spec)
    moe = moe_from_hf(cfg, traits.get("moe"))
    if moe is not None:
        spec["moe"] = moe
        ffn = ffn_from_hf(cfg, num_layers)
        if ffn is not None:
            spec["layers"]["ffn"] = ffn
    if traits.get("weight_names"):
        spec["weight_names"] = dict(traits["weight_names"])
    if traits.get("adjust"):
        traits["adjust"](cfg, spec)
    return spec


def _with_defaults(cfg: dict, hf_dir: Path) -> dict:
    """config.json omits fields left at their class defaults (transformers writes diffs):
    let transformers fill them in, for the families it knows. A multimodal config (Gemma 3,
    Qwen3.5) yields its text part."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig
    try:
        full = AutoConfig.from_pretrained(str(hf_dir)).to_dict()
    except (ValueError, KeyError, OSError):     # a model_type transformers does not know: as written
        return cfg
    text_type = _TEXT_PARTS.get(full.get("model_type"))
    if text_type and isinstance(full.get("text_config"), dict):
        full = {**full["text_config"], "model_type": text_type}
    return full


# Multimodal model_type -> the model_type of its text_config.
_TEXT_PARTS = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def spec_from_hf_dir(hf_dir: str | Path) -> ModelSpec:
    hf_dir = Path(hf_dir)
    config = hf_dir / "config.json"
    if not config.exists():
        raise SpecError(f"{hf_dir}: not a spec file and no config.json in it")
    try:
        cfg = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{config}: malformed JSON: {e}") from None
    outer = cfg.get("model_type")
    cfg = _with_defaults(cfg, hf_dir)
    try:
        data = spec_dict_from_hf_config(cfg, hf_dir)
    except KeyError as e:
        hint = "" if cfg.get("model_type") in _FAMILIES else \
            f" (model_type {cfg.get('model_type')!r} is read as a Llama-style config; known families: {', '.join(_FAMILIES)})"
        raise SpecError(f"{config}: {e.args[0]}: required field is missing{hint}") from None
    if outer in _TEXT_CHECKPOINTS:
        _as_text_part(data, *_TEXT_CHECKPOINTS[outer])
    return spec_from_dict(data, str(config))


# Multimodal model_type -> where its checkpoint keeps the text model, and the prefixes of the
# parts it holds besides (skipped).
_TEXT_CHECKPOINTS = {"qwen3_5": ("model.language_model.", ["model.visual."]),
                     "qwen3_5_moe": ("model.language_model.", ["model.visual."])}


def _as_text_part(spec: dict, prefix: str, others: list[str]) -> None:
    """Point the text model's names under `prefix` (model.X -> prefix + X) and skip the rest."""
    names = spec.setdefault("weight_names", {})
    for key in ("embed", "final_norm", "layer"):
        names[key] = prefix + names.get(key, DEFAULT_WEIGHT_NAMES[key]).removeprefix("model.")
    spec["checkpoint"]["ignore"] = spec["checkpoint"].get("ignore", []) + others


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a zoo spec derived from an HF checkpoint dir.")
    ap.add_argument("hf_dir")
    ap.add_argument("-o", "--output", required=True, help="spec YAML to write")
    args = ap.parse_args(argv)
    try:
        spec = spec_from_hf_dir(args.hf_dir)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = spec_to_dict(spec)
    out = Path(args.output)
    ck_path = Path(data["checkpoint"]["path"])
    try:  # keep the checkpoint path relative to the spec when it can be
        data["checkpoint"]["path"] = os.path.relpath(ck_path, out.resolve().parent)
    except ValueError:
        pass
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
