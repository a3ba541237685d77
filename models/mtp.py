"""Multi-token-prediction (MTP) layers: the draft head some checkpoints ship beside the model.

Qwen3-Next (`mtp.*`) and DeepSeek-V3 (`model.layers.{num_hidden_layers}.*`, from
`num_nextn_predict_layers`) add one extra decoder layer that predicts the token after next
from the target's final hidden state at position i and the embedding of token i+1:

    x   = fc(cat(norm_e(embed(t[i+1])), norm_h(h[i])))      # [2H] -> [H]
    y   = decoder_layer(x)                                  # the model's own full-attention
                                                            # kind and MoE, own KV cache
    h'  = norm(y)                                           # logits = lm_head(h') -> t[i+2]

The embedding and LM head are the target's (shared); drafts beyond the first feed h' back in
as the next position's hidden state (vLLM's chaining). The layer's KV is one more cache group
in the target's pool (runtime/spec_decode/mtp_proposer.py).

A spec declares the layers in its `mtp:` section, `{"style": "qwen3_next" | "deepseek_v3",
"num_layers": n}` (written by the HF import when the checkpoint carries them). The target
model never loads them: the section adds their prefix to what the target's loader skips, so
the checkpoint loads whether or not MTP speculation is on; `MTPHead.load` reads them when it is.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from models.kinds import KINDS
from models.layers import DecoderLayer, RMSNorm, RotaryEmbedding

# Per style: the layer's checkpoint prefix ({n}: the target's layer count) and the names of
# the two input norms, the input projection and the output norm under it.
STYLES = {
    "qwen3_next": {"prefix": "mtp.", "layer": "mtp.layers.0.", "norm_e": "pre_fc_norm_embedding",
                   "norm_h": "pre_fc_norm_hidden", "fc": "fc", "norm": "norm"},
    "deepseek_v3": {"prefix": "model.layers.{n}.", "layer": "model.layers.{n}.", "norm_e": "enorm",
                    "norm_h": "hnorm", "fc": "eh_proj", "norm": "shared_head.norm"},
}


def check_mtp(spec, where: str = "mtp") -> dict:
    """The spec's `mtp:` section, checked: one line naming the field otherwise."""
    m = spec.mtp
    if not isinstance(m, dict) or m.get("style") not in STYLES:
        raise ValueError(f"{where}.style: must be one of {', '.join(STYLES)}, got "
                         f"{m.get('style') if isinstance(m, dict) else m!r}")
    unknown = set(m) - {"style", "num_layers"}
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown field; known: num_layers, style")
    n = m.get("num_layers", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}.num_layers: must be a positive integer, got {n!r}")
    return m


def skip_prefix(spec) -> str:
    """The checkpoint prefix of the spec's MTP layers (what the target's loader skips)."""
    return STYLES[spec.mtp["style"]]["prefix"].format(n=spec.num_layers)


def _attention_layer(spec) -> tuple[int, str]:
    """(layer index, kind) of the target's last full-attention layer: the MTP layer is one of
    those (same mixer kind, same FFN: MoE where the model's last layers are)."""
    for i in reversed(range(spec.num_layers)):
        kinds = spec.layer_mixers(i)
        if len(kinds) == 1 and KINDS[kinds[0]].attr == "self_attn":
            return i, kinds[0]
    raise ValueError(f"{spec.name}: mtp needs a full-attention layer kind to copy, found none")


class MTPHead(nn.Module):
    """One MTP layer over the target's embedding and LM head (module docstring)."""

    def __init__(self, spec, target):
        super().__init__()
        self.spec, self.style = spec, STYLES[check_mtp(spec)["style"]]
        self.target = [target]               # not a submodule: its weights are the target's
        h, n = spec.hidden_size, spec.norm
        self.norm_e = RMSNorm(h, n.eps, n.offset)
        self.norm_h = RMSNorm(h, n.eps, n.offset)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.src, kind = _attention_layer(spec)
        rotary = RotaryEmbedding(spec.attention.head_dim, spec.rope, spec.max_model_len)
        self.layer = DecoderLayer(spec, self.src, [(KINDS[kind], 0, rotary)])
        self.norm = RMSNorm(h, n.eps, n.offset)
        self.kind = KINDS[kind]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (token i+1), hidden [T, H] (the target's, or the last MTP output, at
        position i); returns h' [T, H], whose logits predict token i+2."""
        e = self.target[0].embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            e = e * self.spec.embedding_multiplier
        x = self.fc(torch.cat([self.norm_e(e), self.norm_h(hidden)], dim=-1))
        x, residual = self.layer(positions, x, None, [kv_caches[c] for c in self.layer.cache_ids])
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def state_mixers(self) -> dict:
        return {}                            # one attention layer: no state

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict:
        spec = self.kind.cache_spec(self.spec, getattr(self.layer, self.kind.attr), block_size, dtype)
        return {0: spec}

    def weight_sources(self) -> dict[str, list[tuple]]:
        """Our parameter names -> checkpoint tensors: the layer's by the target's own rules
        (CausalLM.layer_sources) under the MTP prefix, then the input and output parts."""
        s, st, n = self.spec, self.style, self.spec.num_layers
        hf = st["layer"].format(n=n)
        base = st["prefix"].format(n=n)
        h = s.hidden_size
        src = {f"layer.{k}": v for k, v in self.target[0].layer_sources(self.src, self.layer, "", hf).items()}
        src["norm_e.weight"] = [(f"{base}{st['norm_e']}.weight", 0, h)]
        src["norm_h.weight"] = [(f"{base}{st['norm_h']}.weight", 0, h)]
        src["fc.weight"] = [(f"{base}{st['fc']}.weight", 0, h)]
        src["norm.weight"] = [(f"{base}{st['norm']}.weight", 0, h)]
        return src

    def load(self, path: Path | None) -> None:
        """Fill the layer from the checkpoint (random init without one, as the target's
        dummy init); the checkpoint's other tensors are the target's."""
        from models.loader import fill_from_safetensors
        if path is None:
            g = torch.Generator().manual_seed(self.spec.checkpoint.seed + 1)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * self.spec.checkpoint.init_std)
            return
        fill_from_safetensors(dict(self.named_parameters()), self.weight_sources(), path)
