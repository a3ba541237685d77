"""Builds a causal LM from a ModelSpec, and says which checkpoint tensors fill which params.

Per-layer mixers, their KV cache specs and their checkpoint names come from each layer's kind
(models.kinds); this module only loops over them."""
from __future__ import annotations

import torch
from torch import nn

from cache.kv_cache_spec import KVCacheSpec
from zooinfer_kernels.lm_head import GreedyHead
from models.kinds import KINDS, linear_sources
from models.hyper_connections import HyperConnectedLayer, HyperHead, hyper_sources
from models.moe import moe_sources
from models import lean_layers, lean_stack
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
        mixers: list[list] = [[] for _ in range(spec.num_layers)]
        for i, name, cache_ids in spec.mixer_caches():
            kind = KINDS[name]
            mixers[i].append((kind, cache_ids.start, local if kind.local_rope else rotary))
        # With hyper-connections (mHC) the residual is `streams` parallel streams, collapsed by
        # hc_head before the final norm; otherwise one stream, added inside the next norm.
        hc = spec.hyper_connections
        layer_cls = DecoderLayer if hc is None else HyperConnectedLayer
        self.layers = nn.ModuleList(layer_cls(spec, i, m) for i, m in enumerate(mixers))
        self.hc_head = None if hc is None else HyperHead(spec)
        self.norm = RMSNorm(spec.hidden_size, spec.norm.eps, spec.norm.offset)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._lean = None         # per layer its lean eager forward or None (models/lean_layers.py), built at first use
        self._stack = None        # all layers in one C++ call where they fit (models/lean_stack.py), built with _lean

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_caches by cache id (`ModelSpec.cache_layers`).
        Returns final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            x = x * self.spec.embedding_multiplier
        if self.hc_head is not None:
            streams = x.unsqueeze(1).expand(-1, self.spec.hyper_connections.streams, -1)
            for layer in self.layers:
                streams, _ = layer(positions, streams, None, [kv_caches[c] for c in layer.cache_ids], input_ids)
            return self.norm(self.hc_head(streams))
        residual = None
        if lean_layers.usable(x):   # eager on the CPU kernels: the layers' bound kernel calls, the same values
            if self._lean is None:
                self._lean = [lean_layers.lean_forward(layer) or layer for layer in self.layers]
                self._stack = lean_stack.build(self.layers, self._lean)
            out = self._stack.run(positions, x, kv_caches) if self._stack is not None else None
            if out is not None:     # every layer in one C++ call (models/lean_stack.py), the same values
                x, residual = out
            else:
                for layer, run in zip(self.layers, self._lean):
                    x, residual = run(positions, x, residual, [kv_caches[c] for c in layer.cache_ids])
        else:
            for layer in self.layers:
                x, residual = layer(positions, x, residual, [kv_caches[c] for c in layer.cache_ids])
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual, self.layers[-1].delta_multiplier)[0]

    def _apply(self, fn, recurse: bool = True):
        self._lean = self._stack = None   # built again (hooks checked again) at the next eager forward
        return super()._apply(fn, recurse)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits / self.spec.logits_scaling if self.spec.logits_scaling != 1.0 else logits

    @property
    def greedy_head(self) -> GreedyHead:
        """What picks the path of greedy tokens from this model's LM head (fused kernels
        without logits where they apply): a view of the current head, which
        `prepack_linears` may have replaced with its packed copy."""
        return GreedyHead(self.lm_head, self.spec.logits_scaling)

    def mixers(self):
        """(first cache id, kind, mixer module) of every token mixer, in cache-id order."""
        for i, name, cache_ids in self.spec.mixer_caches():
            kind = KINDS[name]
            yield cache_ids.start, kind, getattr(self.layers[i], kind.attr)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[int, KVCacheSpec]:
        """What cache each token mixer needs, by cache id (its kind's `cache_spec`; one spec
        per cache for a kind whose mixer owns several)."""
        specs: dict[int, KVCacheSpec] = {}
        for cid, kind, mixer in self.mixers():
            spec = kind.cache_spec(self.spec, mixer, block_size, dtype)
            specs.update(zip(range(cid, cid + kind.num_caches), spec) if kind.num_caches > 1 else [(cid, spec)])
        return specs

    def state_mixers(self) -> dict[int, nn.Module]:
        """State-layer mixers by cache id: `zooinfer::state_update` finds its module here."""
        return {cid: mixer for cid, kind, mixer in self.mixers() if kind.attr == "mixer"}

    def weight_sources(self) -> dict[str, list[tuple]]:
        """Our parameter name -> [(checkpoint tensor name, row offset, rows[, transforms])].

        Fused params list several tensors stacked along dim 0; plain params list one. A
        tensor stored in another layout names the loader's transforms to apply first
        (models.loader.TRANSFORMS: GPT-OSS's transposed, interleaved experts).
        Names come from the spec's `weight_names`, so a family with other names is YAML.
        """
        s, m = self.spec, self.spec.mlp
        name = s.weight_name
        src: dict[str, list[tuple]] = {
            "embed_tokens.weight": [(name("embed"), 0, s.vocab_size)],
            "norm.weight": [(name("final_norm"), 0, s.hidden_size)],
        }
        if not s.tie_word_embeddings:
            src["lm_head.weight"] = [(name("lm_head"), 0, s.vocab_size)]
        for i in range(s.num_layers):
            src.update(self.layer_sources(i, self.layers[i], f"layers.{i}.", name("layer").format(i=i)))
        if s.hyper_connections is not None:
            src.update(hyper_sources(s, s.num_layers))
        return src

    def layer_sources(self, i: int, layer: nn.Module, ours: str, hf: str) -> dict[str, list[tuple]]:
        """`weight_sources` of one decoder layer built as layer `i`: our names under `ours`,
        the checkpoint's under `hf` (an MTP layer reuses it under its own prefix, models/mtp.py)."""
        s, m = self.spec, self.spec.mlp
        name = s.weight_name
        src: dict[str, list[tuple]] = {}
        I = m.intermediate_size
        ffn = s.ffn_kind(i)
        if layer.cache_ids and not layer.post_norm:
            src[ours + "input_layernorm.weight"] = [(hf + name("input_norm"), 0, s.hidden_size)]
        if ffn != "none":
            src[ours + "post_attention_layernorm.weight"] = [(hf + name("post_attn_norm"), 0, s.hidden_size)]
        if s.norm.sandwich:
            src[ours + "pre_feedforward_layernorm.weight"] = [(hf + name("pre_ffn_norm"), 0, s.hidden_size)]
        if s.norm.sandwich or layer.post_norm:
            src[ours + "post_feedforward_layernorm.weight"] = [(hf + name("post_ffn_norm"), 0, s.hidden_size)]
        if ffn == "moe":
            src.update(moe_sources(s, ours + "mlp.", hf + (name("moe") + "." if name("moe") else ""), i))
        elif ffn == "mlp":
            if m.gated:
                gate_up = [(name("gate"), 0, I), (name("up"), I, I)]
                src.update(linear_sources(ours + "mlp.gate_up_proj", hf, gate_up, m.bias))
            else:
                src.update(linear_sources(ours + "mlp.up_proj", hf, [(name("up"), 0, I)], m.bias))
            src.update(linear_sources(ours + "mlp.down_proj", hf, [(name("down"), 0, s.hidden_size)], m.bias))
        for kind_name in s.layer_mixers(i):
            kind = KINDS[kind_name]
            src.update(kind.weight_sources(s, getattr(layer, kind.attr), f"{ours}{kind.attr}.", hf))
        return src


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                cls: type[CausalLM] = CausalLM) -> CausalLM:
    """Instantiate the module tree on `device` in the spec's dtype (weights uninitialised);
    `cls`: a CausalLM subclass (models/parallel.py's tensor-parallel shard)."""
    dtype = dtype or DTYPES[spec.dtype]
    with torch.device("meta"):
        model = cls(spec)
    model = model.to_empty(device=device)
    # Rotary tables are computed in float32 and must survive to_empty(): rebuild them.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            cos, sin = module.tables()
            module.cos, module.sin = cos.to(device), sin.to(device)
    # A module may name params that stay float32 (`fp32_params`: an MoE router's selection bias).
    keep = {id(p) for m in model.modules() for n in getattr(m, "fp32_params", ())
            if (p := getattr(m, n, None)) is not None}
    for p in model.parameters():
        if id(p) not in keep and p.is_floating_point():     # integer tables (a hash router's) stay as they are
            p.data = p.data.to(dtype)
    if spec.tie_word_embeddings:   # to_empty() gives each module its own storage: re-tie
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()
