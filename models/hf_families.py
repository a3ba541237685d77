"""The families of HF checkpoints: what each model_type's config.json does not spell out.

`models.import_hf` reads every config field by name for every family; this module is the
table of what it cannot read (`family(...)` lines), plus the few families' own config
fields (their `adjust` hooks). A new family that only uses mechanisms the zoo has needs no
line here at all.
"""
from __future__ import annotations

import json
from pathlib import Path

from models.activations import HF_NAMES
from models.kinds import KINDS

# model_type -> what config.json does not spell out for that family. Every other field is
# read by name, the same way for every family (`spec_dict_from_hf_config`), and each layer
# kind present reads its own (`LayerKind.import_hf`). Traits:
#   qk_norm, qkv_bias, offset_norm (norms multiply by 1 + w), gemma (Gemma norms, scales),
#   layer_types ({HF layer type: our kind} spellings beyond the kinds' own), non_attn_layers
#   (the kind of layers not in `attn_layer_indices`), every_layer (the kind of every layer,
#   for a family whose config does not list them), ffn_types ({HF layer type: mlp | moe |
#   none}: the feed-forward block follows the layer type; unlisted types have none),
#   weight_names (checkpoint names that differ from Llama's), moe (MoE fields config.json
#   does not spell out: scoring, selection bias, expert activation, style; see
#   `moe_from_hf`), adjust (fn(cfg, spec dict): a family's own config fields).
# A model_type not listed here is read with no traits: a family built only of mechanisms
# the zoo has loads as it is; a config field naming a mechanism we lack fails in one line.
_FAMILIES: dict[str, dict] = {}


def family(model_type: str, **traits) -> None:
    """Declare `model_type`'s traits (see above)."""
    _FAMILIES[model_type] = traits


def _granite_hybrid(cfg: dict, spec: dict) -> None:
    """Granite-4.0-H: muP multipliers, no rope unless asked, a shared MLP beside the MoE."""
    spec["attention"]["scale"] = float(cfg.get("attention_multiplier", 1.0))
    spec["embedding_multiplier"] = float(cfg.get("embedding_multiplier", 1.0))
    spec["residual_multiplier"] = float(cfg.get("residual_multiplier", 1.0))
    spec["logits_scaling"] = float(cfg.get("logits_scaling", 1.0))
    if cfg.get("position_embedding_type") != "rope":
        spec["rope"]["type"] = "none"
    spec["mlp"]["intermediate_size"] = cfg["shared_intermediate_size"]   # the dense shared MLP


def _qwen3_next(cfg: dict, spec: dict) -> None:
    """Qwen3-Next: gated attention output (its MoE, with a gated shared expert, is read generally)."""
    spec["attention"]["output_gate"] = True
    if _checkpoint_has(spec, "mtp.fc.weight"):      # its multi-token-prediction layer (models/mtp.py)
        spec["mtp"] = {"style": "qwen3_next", "num_layers": int(cfg.get("mtp_num_hidden_layers") or 1)}


def _checkpoint_has(spec: dict, fragment: str) -> bool:
    """Whether a tensor name of the spec's checkpoint contains `fragment` (names from the
    safetensors index or file headers; no tensor is read). An unreadable file: False, for the
    loader to report."""
    path = Path(spec["checkpoint"]["path"])
    index = path / "model.safetensors.index.json"
    try:
        if index.exists():
            names = list(json.loads(index.read_text())["weight_map"])
        else:
            from safetensors import safe_open
            names = []
            for file in sorted(path.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    names.extend(f.keys())
    except Exception:   # noqa: BLE001 (any unreadable checkpoint: the loader names the problem)
        return False
    return any(fragment in n for n in names)


def _kimi_linear(cfg: dict, spec: dict) -> None:
    """Kimi-Linear: KDA layers and MLA layers without rope (KimiLinearAttention applies none);
    the context length is `model_max_length`. A config.json as Moonshot writes it (no
    `layer_types`) names its layers in `linear_attn_config` (1-indexed `full_attn_layers`).
    Dense-or-MoE per layer (`mlp_layer_types` / `first_k_dense_replace`) is read generally."""
    n = cfg["num_hidden_layers"]
    lac = cfg.get("linear_attn_config") or {}
    if not cfg.get("layer_types") and "full_attn_layers" in lac:
        full = set(lac["full_attn_layers"])
        kinds = ["mla" if i + 1 in full else "kda" for i in range(n)]
        spec["layers"] = {**spec["layers"], "kinds": kinds}
        spec["layers"].pop("pattern", None)
        for kind in sorted(set(kinds) & set(KINDS)):
            KINDS[kind].import_hf(cfg, spec)
    # Moonshot's checkpoints keep dense MLPs under `mlp.`; transformers' save_pretrained writes
    # them under the MoE's `block_sparse_moe.` (it reverses its MoE rename on every layer).
    if _checkpoint_has(spec, ".block_sparse_moe.gate_proj."):
        spec.setdefault("weight_names", {}).update(
            {p: f"block_sparse_moe.{p}_proj" for p in ("gate", "up", "down")})
    spec["rope"]["type"] = "none"
    spec["max_model_len"] = int(cfg.get("model_max_length") or spec["max_model_len"])


def _qwen3_5(cfg: dict, spec: dict) -> None:
    """Qwen3.5: Qwen3-Next's adjustments; its checkpoint splits in_proj_qkvz / in_proj_ba and
    carries multi-token-prediction layers (mtp.*), which we do not run."""
    _qwen3_next(cfg, spec)
    spec.pop("mtp", None)                  # Qwen3.5's MTP layer is not run (yet): skipped below
    spec["checkpoint"]["ignore"] = ["mtp."]
    if "gated_deltanet" in spec:
        spec["gated_deltanet"]["layout"] = "qwen3_5"


def _minimax(cfg: dict, spec: dict) -> None:
    """MiniMax-Text-01: normed-input residuals scaled per sub-block (x = alpha * norm(x) + beta *
    f(norm(x))); HF's rope turns the whole head (a partial_rotary_factor is not read)."""
    used = set(spec["layers"].get("kinds") or spec["layers"]["pattern"])
    subs = {"full_attention": "full_attn", "lightning_attention": "linear_attn", "mlp": "mlp"}
    spec["residual"] = {p: {k: float(cfg.get(f"{v}_{p}_factor", 1.0)) for k, v in subs.items()
                            if k in used or k == "mlp"} for p in ("alpha", "beta")}
    spec["rope"].pop("partial_rotary_factor", None)


def _nemotron_h(cfg: dict, spec: dict) -> None:
    """Nemotron-H: attention without rope or biases, a non-gated MLP (relu2), its Mamba2's
    projection biases under `use_bias` and dt clamped from below at `time_step_min`; the MoE
    section only when a block is MoE (E)."""
    spec["rope"]["type"] = "none"
    spec["attention"]["bias"] = spec["attention"]["o_bias"] = False
    act = cfg.get("mlp_hidden_act", "relu2")     # an unknown one fails as mlp.activation
    spec["mlp"].update(activation=HF_NAMES.get(act, act), gated=False)
    if "mamba2" in spec:
        spec["mamba2"]["proj_bias"] = bool(cfg.get("use_bias", False))
        spec["mamba2"]["time_step_limit"] = [float(cfg.get("time_step_min", 0.0)), float("inf")]
    if "moe" not in spec["layers"]["ffn"]:      # n_routed_experts has a default: no E block, no section
        spec.pop("moe", None)
    elif "moe" in spec:                         # the shared expert and latent projections take mlp_bias
        spec["moe"]["dense_bias"] = spec["mlp"]["bias"]


def _falcon_h1(cfg: dict, spec: dict) -> None:
    """Falcon-H1's muP multipliers: embeddings and logits scaled at run time, every other
    multiplier folded into the weights it multiplies (`weight_scales`), which is exact for
    linear maps: the attention input (q, k, v), keys, the attention and SSM outputs, the SSM
    input and its in_proj segments (gate | x | B | C | dt), the MLP gate and down projections."""
    spec["embedding_multiplier"] = float(cfg.get("embedding_multiplier", 1.0))
    spec["logits_scaling"] = 1.0 / float(cfg.get("lm_head_multiplier", 1.0))
    a, mlp, m = spec["attention"], spec["mlp"], spec["mamba2"]
    attn_in, key = float(cfg.get("attention_in_multiplier", 1.0)), float(cfg.get("key_multiplier", 1.0))
    attn_out = float(cfg.get("attention_out_multiplier", 1.0))
    ssm_in, ssm_out = float(cfg.get("ssm_in_multiplier", 1.0)), float(cfg.get("ssm_out_multiplier", 1.0))
    gate_m, down_m = (float(x) for x in cfg.get("mlp_multipliers") or (1.0, 1.0))
    inter, gn = m["num_heads"] * m["head_dim"], m["n_groups"] * m["state_size"]
    segments = list(zip((inter, inter, gn, gn, m["num_heads"]), cfg.get("ssm_multipliers") or [1.0] * 5))
    # (tensor, scale, has a bias, does the bias take the scale: an output multiplier scales it)
    scales = [("self_attn.q_proj", attn_in, a["bias"], None), ("self_attn.v_proj", attn_in, a["bias"], None),
              ("self_attn.k_proj", attn_in * key, a["bias"], key), ("self_attn.o_proj", attn_out, a["o_bias"], attn_out),
              ("mamba.out_proj", ssm_out, bool(m["out_proj_bias"] if m["out_proj_bias"] is not None
                                                else m["proj_bias"]), ssm_out),
              ("feed_forward.gate_proj", gate_m, mlp["bias"], gate_m),
              ("feed_forward.down_proj", down_m, mlp["bias"], down_m)]
    out: dict = {}
    for name, scale, bias, bias_scale in scales:
        if scale != 1.0:
            out[name + ".weight"] = scale
        if bias and bias_scale is not None and bias_scale != 1.0:
            out[name + ".bias"] = bias_scale
    if any(v != 1.0 for _, v in segments) or ssm_in != 1.0:
        out["mamba.in_proj.weight"] = [[n, float(v) * ssm_in] for n, v in segments]
        if m["proj_bias"]:
            out["mamba.in_proj.bias"] = [[n, float(v)] for n, v in segments]
    spec["weight_scales"] = out


def _deepseek_mla(cfg: dict, spec: dict) -> None:
    """DeepSeek-V2/V3: MLA in every layer (its `mla:` section from the kind's reader; the MoE
    and which layers are dense, first_k_dense_replace, come from the general MoE reader)."""
    spec["layers"].pop("kinds", None)
    spec["layers"]["pattern"] = ["mla"]
    KINDS["mla"].import_hf(cfg, spec)
    n = cfg.get("num_nextn_predict_layers") or 0
    if n and _checkpoint_has(spec, f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight"):
        spec["mtp"] = {"style": "deepseek_v3", "num_layers": int(n)}    # models/mtp.py


family("llama")
family("mistral")
family("qwen2", qkv_bias=True)
family("qwen3", qk_norm=True)
# Qwen3-MoE: Qwen3 attention, softmax top-k MoE (no shared expert) on the layers that
# decoder_sparse_step / mlp_only_layers pick, dense MLPs elsewhere.
family("qwen3_moe", qk_norm=True)
# Gemma 3 text: (1 + w) norms, sandwich norms, sqrt(hidden) embedding scale, q/k norms,
# 5 sliding : 1 full layers with a local rope.
family("gemma3_text", qk_norm=True, gemma=True)
# Bamba: mamba2 layers with a few full-attention layers (attn_layer_indices).
family("bamba", non_attn_layers="mamba2",
       weight_names={"final_norm": "model.final_layernorm.weight", "post_attn_norm": "pre_ff_layernorm.weight",
                     "gate": "feed_forward.gate_proj", "up": "feed_forward.up_proj",
                     "down": "feed_forward.down_proj"})
# Qwen3-Next: gated DeltaNet layers, every n-th layer gated full attention, MoE MLPs,
# (1 + w) norms, partial rotary.
family("qwen3_next", qk_norm=True, offset_norm=True, adjust=_qwen3_next)
# Qwen3.5 text models (dense and MoE): Qwen3-Next's mechanisms, the DeltaNet input projections
# stored split per part; the text rope's mrope sections are plain rope for text-only positions.
family("qwen3_5_text", qk_norm=True, offset_norm=True, adjust=_qwen3_5)
family("qwen3_5_moe_text", qk_norm=True, offset_norm=True, moe={}, adjust=_qwen3_5)
# Granite-4.0-H: mamba2 + attention layers, MoE or dense shared MLP, muP-style multipliers;
# block_sparse_moe / shared_mlp sit on the layer.
family("granitemoehybrid", layer_types={"linear_attention": "mamba2"}, weight_names={"moe": ""},
       moe={"style": "granite"}, adjust=_granite_hybrid)
# Kimi-Linear: KDA layers, 1 in 4 an MLA layer (no rope), a dense first MLP then sigmoid-routed
# MoE (selection bias, fp32 router) with an ungated shared expert; experts' w1 / w3 / w2.
family("kimi_linear", layer_types={"linear_attention": "kda", "full_attention": "mla"},
       moe={"scoring": "sigmoid", "selection_bias": True, "router_fp32": True, "shared_expert_gate": False},
       weight_names={"moe": "block_sparse_moe", "moe_shared": "shared_experts", "moe_expert_gate": "w1",
                     "moe_expert_up": "w3", "moe_expert_down": "w2"},
       adjust=_kimi_linear)

# MiniMax-Text-01: lightning attention (HF's `linear_attention`) with every n-th layer softmax
# attention, Mixtral-style MoE (w1 / w3 / w2 experts under block_sparse_moe), normed-input residuals.
family("minimax", layer_types={"linear_attention": "lightning_attention"}, moe={},
       weight_names={"moe": "block_sparse_moe", "moe_expert_gate": "w1", "moe_expert_up": "w3",
                     "moe_expert_down": "w2"}, adjust=_minimax)


# Nemotron-H: each layer is one of Mamba2, attention, MLP or MoE (hybrid_override_pattern
# M * - E), normed by `norm` and held under `mixer`; checkpoints keep `backbone.` names. Its
# MoE is DeepSeek-V3's router (sigmoid, selection bias, groups) over non-gated relu2 experts.
family("nemotron_h", layer_types={"linear_attention": "mamba2", "mlp": "none", "moe": "none"},
       ffn_types={"mlp": "mlp", "moe": "moe"},
       weight_names={"embed": "backbone.embeddings.weight", "final_norm": "backbone.norm_f.weight",
                     "layer": "backbone.layers.{i}.",
                     "input_norm": "norm.weight", "post_attn_norm": "norm.weight", "mamba2": "mixer",
                     "q": "mixer.q_proj", "k": "mixer.k_proj", "v": "mixer.v_proj", "o": "mixer.o_proj",
                     "up": "mixer.up_proj", "down": "mixer.down_proj", "moe": "mixer",
                     "moe_shared": "shared_experts"},
       moe={"scoring": "sigmoid", "selection_bias": True, "router_fp32": True, "gated": False},
       adjust=_nemotron_h)
# Falcon-H1: attention and Mamba2 in parallel in every layer, then an MLP; muP multipliers.
family("falcon_h1", every_layer="full_attention+mamba2",
       weight_names={"final_norm": "model.final_layernorm.weight", "post_attn_norm": "pre_ff_layernorm.weight",
                     "gate": "feed_forward.gate_proj", "up": "feed_forward.up_proj",
                     "down": "feed_forward.down_proj"},
       adjust=_falcon_h1)
# DeepSeek-V3: multi-head latent attention (mla) everywhere; dense MLPs for the first
# first_k_dense_replace layers, then a sigmoid-scored, group-limited MoE (selection bias,
# float32 router) with an ungated shared expert.
family("deepseek_v3", moe={"scoring": "sigmoid", "selection_bias": True, "router_fp32": True,
                           "shared_expert_gate": False},
       weight_names={"moe_shared": "shared_experts"}, adjust=_deepseek_mla)
# DeepSeek-V2: the same attention (its complex-number rope rotates the same interleaved pairs);
# a softmax top-k MoE that never renormalises (V2-Lite's greedy routing; group_limited_greedy
# configs are refused by name), float32 router, ungated shared experts.
family("deepseek_v2", moe={"router_fp32": True, "shared_expert_gate": False, "norm_topk_prob": False,
                           "n_group": 1, "topk_group": 1},
       weight_names={"moe_shared": "shared_experts"}, adjust=_deepseek_mla)


def lfm2_intermediate_size(cfg: dict) -> int:
    """LFM2's real MLP width, as HF's Lfm2MLP computes it from the config: with
    block_auto_adjust_ff_dim, 2/3 of intermediate_size, times block_ffn_dim_multiplier and
    rounded up to block_multiple_of when a multiplier is set."""
    size = cfg["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = cfg.get("block_multiple_of", 256)
            size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    return size


def _lfm2(cfg: dict, spec: dict) -> None:
    """LFM2: `norm_eps`, the adjusted MLP width."""
    spec["norm"]["eps"] = float(cfg.get("norm_eps", 1e-5))
    spec["mlp"]["intermediate_size"] = lfm2_intermediate_size(cfg)


# LFM2: short_conv layers ("conv") and full attention with per-head q/k norms; its own
# checkpoint names (operator_norm / ffn_norm, feed_forward.w1/w3/w2, out_proj, the final norm
# called embedding_norm); tied embeddings come from config.json.
family("lfm2", qk_norm=True, adjust=_lfm2,
       weight_names={"final_norm": "model.embedding_norm.weight", "input_norm": "operator_norm.weight",
                     "post_attn_norm": "ffn_norm.weight", "o": "self_attn.out_proj",
                     "q_norm": "self_attn.q_layernorm.weight", "k_norm": "self_attn.k_layernorm.weight",
                     "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"})

# SmolLM3: Llama-style, every layer flagged 0 in `no_rope_layers` is NoPE (read for any family).
family("smollm3")



def _olmo_hybrid(cfg: dict, spec: dict) -> None:
    """OLMo-Hybrid: its attention layers are OLMo 3's (post norms, q/k norms over all heads),
    its linear-attention layers pre-norm Gated DeltaNet with separate projections and the
    output norm's eps fixed at FLA's 1e-5."""
    kinds = spec["layers"].get("kinds") or spec["layers"]["pattern"]
    spec["layers"]["norm_position"] = ["post" if k == "full_attention" else "pre" for k in kinds]
    spec["attention"].update(qk_norm=True, qk_norm_all_heads=True)
    spec["gated_deltanet"].update(layout="separate", norm_eps=1e-5)


# OLMo-Hybrid: gated DeltaNet (pre-norm) and OLMo 3 attention (post-norm) layers; the
# checkpoint keeps OLMo-core's norm names (HF renames them on load): attention_layer_norm is
# the linear layers' input norm, feedforward_layer_norm their pre-MLP norm and the attention
# layers' post-attention norm.
family("olmo_hybrid", adjust=_olmo_hybrid,
       weight_names={"input_norm": "attention_layer_norm.weight", "post_attn_norm": "feedforward_layer_norm.weight"})


def _gpt_oss(cfg: dict, spec: dict) -> None:
    """gpt-oss: a learned sink logit per attention head (`self_attn.sinks`)."""
    spec["attention"]["sinks"] = True


# gpt-oss: sliding (window 128) / full layers from layer_types, q/k/v/o biases, attention
# sinks, yarn rope; MoE of clamped-SwiGLU experts with biases, top-k-then-softmax router.
family("gpt_oss", adjust=_gpt_oss, weight_names={"moe_router": "router"},
       moe={"scoring": "topk_softmax", "router_bias": True, "expert_bias": True, "activation": "swiglu_clamped",
            "expert_layout": "fused_transposed", "gate_up_interleaved": True})


def _deepseek_v4(cfg: dict, spec: dict) -> None:
    """DeepSeek-V4: its two ropes (`main` for the sliding layers, `compress` for the CSA / HCA
    layers and their compressors), hyper-connected residual streams (mHC), hash-routed MoE on
    the `hash_moe` layers and multi-token-prediction layers (mtp.*) the model does not run."""
    from models.import_hf import _rope
    ropes = cfg.get("rope_parameters") or {}
    spec["rope"] = _rope(cfg, ropes.get("compress") or {"rope_theta": cfg.get("compress_rope_theta", 160000.0)})
    spec["rope_local"] = _rope(cfg, ropes.get("main") or {"rope_theta": cfg.get("rope_theta", 10000.0)})
    for rope in (spec["rope"], spec["rope_local"]):
        rope["partial_rotary_factor"] = float(cfg["partial_rotary_factor"])
    spec["hyper_connections"] = {"streams": cfg["hc_mult"], "sinkhorn_iters": cfg["hc_sinkhorn_iters"],
                                 "eps": float(cfg["hc_eps"])}
    spec["layers"]["ffn"] = ["moe"] * spec["layers"]["num"]
    spec["moe"]["hash_layers"] = [i for i, t in enumerate(cfg.get("mlp_layer_types") or []) if t == "hash_moe"]
    spec["checkpoint"]["ignore"] = ["mtp."]


# DeepSeek-V4: shared-KV MQA with sinks on every layer (sliding window; CSA / HCA layers add
# compressed entries), mHC residual streams, sqrt-softplus routed MoE (first layers hash-routed)
# with clamped SwiGLU experts (w1 / w3 / w2) and one shared expert; DeepSeek's own tensor
# names, as transformers' save_pretrained writes them back.
family("deepseek_v4", layer_types={"sliding_attention": "swa_shared_kv"},
       moe={"selection_bias": True, "shared_expert_gate": False, "activation": "silu_clamped"},
       weight_names={"lm_head": "head.weight", "input_norm": "attn_norm.weight", "post_attn_norm": "ffn_norm.weight",
                     "moe": "ffn", "moe_router_selection_bias": "bias", "moe_shared": "shared_experts",
                     "moe_expert_gate": "w1", "moe_expert_up": "w3", "moe_expert_down": "w2",
                     "moe_shared_gate": "w1", "moe_shared_up": "w3", "moe_shared_down": "w2"},
       adjust=_deepseek_v4)
