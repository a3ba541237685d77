"""Builds a causal LM from a ModelSpec, and says which checkpoint tensors fill which params.

Per-layer mixers, their KV cache specs and their checkpoint names come from each layer's kind
(models.kinds); this module only loops over them."""
from __future__ import annotations

import torch
from torch import nn

from cache.kv_cache_spec import KVCacheSpec
from kernels.lm_head import GreedyHead
from models.kinds import KINDS, linear_sources
from models.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from models.spec import DTYPES, ModelSpec

__all__ = ["CausalLM", "DTYPES", "build_model"]


class CausalLM(nn.Module):
    """Embedding, a stack of layers by kind, final norm, LM head (optionally tied)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        rotary = RotaryEmbedding(spec.attention.head_dim, spec.rope, spec.max_model_len)
        local = rotary if spec.rope_local is None else \
            RotaryEmbedding(spec.attention.head_dim, spec.rope_local, spec.max_model_len)
        kinds = [KINDS[k] for k in spec.layer_kinds]
        self.layers = nn.ModuleList(DecoderLayer(spec, i, local if kind.local_rope else rotary, kind)
                                    for i, kind in enumerate(kinds))
        self.norm = RMSNorm(spec.hidden_size, spec.norm.eps, spec.norm.offset)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            x = x * self.spec.embedding_multiplier
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache)
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual, self.layers[-1].delta_multiplier)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits / self.spec.logits_scaling if self.spec.logits_scaling != 1.0 else logits

    @property
    def greedy_head(self) -> GreedyHead:
        """What picks the path of greedy tokens from this model's LM head (fused kernels
        without logits where they apply): a view of the current head, which
        `prepack_linears` may have replaced with its packed copy."""
        return GreedyHead(self.lm_head, self.spec.logits_scaling)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[int, KVCacheSpec]:
        """What cache each layer needs, by layer id (its kind's `cache_spec`)."""
        specs: dict[int, KVCacheSpec] = {}
        for i, name in enumerate(self.spec.layer_kinds):
            kind = KINDS[name]
            specs[i] = kind.cache_spec(self.spec, getattr(self.layers[i], kind.attr), block_size, dtype)
        return specs

    def weight_sources(self) -> dict[str, list[tuple[str, int, int]]]:
        """Our parameter name -> [(checkpoint tensor name, row offset, rows)].

        Fused params list several tensors stacked along dim 0; plain params list one.
        Names come from the spec's `weight_names`, so a family with other names is YAML.
        """
        s, m = self.spec, self.spec.mlp
        name = s.weight_name
        src: dict[str, list[tuple[str, int, int]]] = {
            "embed_tokens.weight": [(name("embed"), 0, s.vocab_size)],
            "norm.weight": [(name("final_norm"), 0, s.hidden_size)],
        }
        if not s.tie_word_embeddings:
            src["lm_head.weight"] = [(name("lm_head"), 0, s.vocab_size)]
        I = m.intermediate_size
        for i in range(s.num_layers):
            hf = name("layer").format(i=i)
            ours = f"layers.{i}."
            moe = s.moe is not None and s.moe.is_moe(i)
            src[ours + "input_layernorm.weight"] = [(hf + name("input_norm"), 0, s.hidden_size)]
            src[ours + "post_attention_layernorm.weight"] = [(hf + name("post_attn_norm"), 0, s.hidden_size)]
            if s.norm.sandwich:
                src[ours + "pre_feedforward_layernorm.weight"] = [(hf + name("pre_ffn_norm"), 0, s.hidden_size)]
                src[ours + "post_feedforward_layernorm.weight"] = [(hf + name("post_ffn_norm"), 0, s.hidden_size)]
            if moe:
                src.update(self._moe_sources(ours + "mlp.", hf + (name("moe") + "." if name("moe") else "")))
            else:
                gate_up = [(name("gate"), 0, I), (name("up"), I, I)]
                src.update(linear_sources(ours + "mlp.gate_up_proj", hf, gate_up, m.bias))
                src.update(linear_sources(ours + "mlp.down_proj", hf, [(name("down"), 0, s.hidden_size)], m.bias))
            kind = KINDS[s.layer_kinds[i]]
            mixer = getattr(self.layers[i], kind.attr)
            src.update(kind.weight_sources(s, mixer, f"{ours}{kind.attr}.", hf))
        return src

    def _moe_sources(self, ours: str, hf: str) -> dict[str, list[tuple[str, int, int]]]:
        """Per-expert checkpoint tensors into the fused expert params, viewed 2-D:
        gate_up [E, 2I, H] as [E*2I, H] (expert e: gate rows e*2I.., up rows e*2I+I..),
        down [E, H, I] as [E*H, I]."""
        m, H = self.spec.moe, self.spec.hidden_size
        I, E, S = m.intermediate_size, m.num_experts, m.shared_expert_intermediate_size
        if m.style == "granite":   # fused on disk already; shared MLP beside the experts
            src = {ours + "shared_mlp.input_linear.weight": [(hf + "shared_mlp.input_linear.weight", 0, 2 * S)],
                   ours + "shared_mlp.output_linear.weight": [(hf + "shared_mlp.output_linear.weight", 0, H)]}
            if E:
                moe = hf + "block_sparse_moe."
                src[ours + "block_sparse_moe.router.weight"] = [(moe + "router.layer.weight", 0, E)]
                src[ours + "block_sparse_moe.experts.gate_up_proj"] = [(moe + "input_linear.weight", 0, E)]
                src[ours + "block_sparse_moe.experts.down_proj"] = [(moe + "output_linear.weight", 0, E)]
            return src
        src = {ours + "gate.weight": [(hf + "gate.weight", 0, E)],
               ours + "shared_expert_gate.weight": [(hf + "shared_expert_gate.weight", 0, 1)],
               ours + "shared_expert.gate_proj.weight": [(hf + "shared_expert.gate_proj.weight", 0, S)],
               ours + "shared_expert.up_proj.weight": [(hf + "shared_expert.up_proj.weight", 0, S)],
               ours + "shared_expert.down_proj.weight": [(hf + "shared_expert.down_proj.weight", 0, H)]}
        src[ours + "experts.gate_up_proj"] = [
            (f"{hf}experts.{e}.{part}_proj.weight", e * 2 * I + k * I, I)
            for e in range(E) for k, part in enumerate(("gate", "up"))]
        src[ours + "experts.down_proj"] = [(f"{hf}experts.{e}.down_proj.weight", e * H, H) for e in range(E)]
        return src


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> CausalLM:
    """Instantiate the module tree on `device` in the spec's dtype (weights uninitialised)."""
    dtype = dtype or DTYPES[spec.dtype]
    with torch.device("meta"):
        model = CausalLM(spec)
    model = model.to_empty(device=device)
    # Rotary tables are computed in float32 and must survive to_empty(): rebuild them.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            cos, sin = module.tables()
            module.cos, module.sin = cos.to(device), sin.to(device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if spec.tie_word_embeddings:   # to_empty() gives each module its own storage: re-tie
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()
