"""lightning_attention: MiniMax-Text-01's linear attention (HF `MiniMaxLightningAttention`),
a state layer sized by a `lightning_attention:` section.

Per head h, with silu-activated projections q, k, v (no scaling, no normalisation) and a
fixed decay lambda_h = exp(-slope_h), the state S [head_dim, head_dim] follows

    S_t = lambda_h * S_{t-1} + k_t^T v_t,        o_t = q_t S_t

and the layer returns out_proj(sigmoid(output_gate(x)) * RMSNorm(o)), the norm over all heads
at once. The slopes are ALiBi-like, 2^(-8 (h + 1) / H), scaled down linearly with depth:
slope_h * (1 - l / (L - 1) + 1e-5) for decoder layer l of L (HF's `get_slope_rate`).

Engine form: the state [H, dk, dv] (float32) lives in pool pages like every state kind's
(`state_kind`), updated by the `zooinfer::state_update` op. A decode step is one vectorised
recurrence over all requests; a prefill chunk runs from the request's stored state in blocks
of 64 tokens (HF's block-wise form: an intra-block causal product with pairwise decays, plus
the carried state read with per-position decays), looping over blocks, never over tokens.
The block length does not change the math (HF uses `block_size` 256), so it is not a spec field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

import attention.ops  # noqa: F401  (registers zooinfer::state_update)
from attention.state import StateMetadata, run_by_request
from models.activations import ACTIVATIONS
from models.kinds.base import Fail, state_kind
from models.layers import RMSNorm

if TYPE_CHECKING:
    from models.spec import ModelSpec

BLOCK = 64


@dataclass(slots=True)
class LightningAttentionSpec:
    """The `lightning_attention:` section."""
    num_heads: int
    head_dim: int
    activation: str = "silu"       # applied to the fused q|k|v projection (HF hidden_act)
    norm_eps: float = 1e-6         # the output RMSNorm's eps (HF keeps its default, not rms_norm_eps)


def slopes(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates [H] of decoder layer `layer` (HF MiniMax `get_slope_rate`, same ops)."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(num_heads, device="cpu") + 1) * factor   # cpu: also under a meta-device build


def lightning_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                    state: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens from its state, block-wise. q, k, v: [L, H, d] float32; slope [H];
    state [H, dk, dv]. Returns (out [L, H, dv], final state)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))              # [H, L, d]
    s = slope.view(-1, 1, 1)
    L, outs = q.shape[1], []
    for start in range(0, L, block):
        qb, kb, vb = q[:, start:start + block], k[:, start:start + block], v[:, start:start + block]
        n = qb.shape[1]
        pos = torch.arange(n, device=q.device, dtype=torch.float32).view(1, -1, 1) + 1   # 1..n
        diff = pos - pos.transpose(1, 2)                            # [1, n, n]: i - j
        pair = torch.where(diff >= 0, torch.exp(-s * diff), torch.zeros((), device=q.device))
        outs.append(((qb @ kb.transpose(-1, -2)) * pair) @ vb + (qb * torch.exp(-s * pos)) @ state)
        state = state * torch.exp(-s * n) + (kb * torch.exp(-s * (n - pos))).transpose(-1, -2) @ vb
    return torch.cat(outs, dim=1).transpose(0, 1), state


def lightning_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, vectorised: q, k, v [R, H, d]; state [R, H, dk, dv]."""
    state = torch.exp(-slope).view(1, -1, 1, 1) * state + k.unsqueeze(-1) * v.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


class LightningAttention(nn.Module):
    """The mixer: parameter names as HF's (`qkv_proj` rows per head [q | k | v], `output_gate`,
    `norm`, `out_proj`), so a checkpoint's tensors load by name; the decay tables HF stores as
    buffers are recomputed (the kind lists them as derived)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, slope: torch.Tensor,
                 activation: str = "silu", norm_eps: float = 1e-6):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, 3 * inner, bias=False)
        self.output_gate = nn.Linear(hidden_size, inner, bias=False)
        self.norm = RMSNorm(inner, norm_eps)
        self.out_proj = nn.Linear(inner, hidden_size, bias=False)
        self.act = ACTIVATIONS[activation]
        # Kept as floats, not a buffer: the builder makes modules on the meta device, and the
        # op body (never traced) makes the tensor on first use per device.
        self.slope_values = tuple(slope.float().tolist())
        self._slope: torch.Tensor | None = None

    def slope(self, device: torch.device) -> torch.Tensor:
        """The per-head decay rates [H] (float32) on `device`."""
        if self._slope is None or self._slope.device != device:
            self._slope = torch.tensor(self.slope_values, dtype=torch.float32, device=device)
        return self._slope

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per request: the state S (o = q S), [num_heads, head_dim, head_dim]."""
        return {"kv": (self.num_heads, self.head_dim, self.head_dim)}

    def forward_paged(self, hidden: torch.Tensor, pages: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Projections, norm and gate in the (compiled) graph; the recurrence in the op."""
        qkv = self.act(self.qkv_proj(hidden))
        core = torch.ops.zooinfer.state_update([qkv], pages, layer_id, [self.num_heads, self.head_dim])
        return self._finish(core, hidden)

    def forward(self, hidden: torch.Tensor, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """Unpaged form (tests): `state` [num_slots, H, dk, dv] updated in place at meta.slots."""
        core = self._core(self.act(self.qkv_proj(hidden)), state, meta)
        return self._finish(core, hidden)

    def update_states(self, inputs: list[torch.Tensor], states: list[torch.Tensor], plan) -> torch.Tensor:
        """`zooinfer::state_update` body: inputs (activated qkv), states (S)."""
        return self._core(inputs[0], states[0], plan.meta)

    def _finish(self, core: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        out = self.norm(core.to(hidden.dtype).flatten(1))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * out)

    def _split(self, qkv: torch.Tensor):
        T = qkv.shape[0]
        q, k, v = qkv.float().view(T, self.num_heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        return q, k, v

    def _decode(self, qkv: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                has_init: torch.Tensor) -> torch.Tensor:
        S = state[slots].float()
        S = torch.where(has_init.view(-1, 1, 1, 1), S, torch.zeros((), dtype=S.dtype, device=S.device))
        out, S = lightning_step(*self._split(qkv), self.slope(qkv.device), S)
        state[slots] = S.to(state.dtype)
        return out

    def _core(self, qkv: torch.Tensor, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """The recurrence over the step's tokens -> [T, H, head_dim] float32."""
        return run_by_request(
            meta, lambda: qkv.new_zeros(qkv.shape[0], self.num_heads, self.head_dim, dtype=torch.float32),
            lambda tok, req: self._decode(qkv[tok], state, meta.slots[req], meta.has_initial_state[req]),
            lambda s, e, i: self._prefill(qkv[s:e], state, meta.slots[i:i + 1], meta.has_initial_state[i:i + 1]))

    def _prefill(self, qkv: torch.Tensor, state: torch.Tensor, slot: torch.Tensor,
                 has_init: torch.Tensor) -> torch.Tensor:
        """One request's chunk from its stored state; slot, has_init: [1] tensors."""
        S = state.index_select(0, slot)[0].float()
        S = torch.where(has_init, S, torch.zeros((), dtype=S.dtype, device=S.device))
        out, S = lightning_chunk(*self._split(qkv), self.slope(qkv.device), S)
        state.index_copy_(0, slot, S.unsqueeze(0).to(state.dtype))
        return out


def make_mixer(spec: ModelSpec, layer_id: int, rotary: nn.Module) -> nn.Module:
    """`layer_id` is the cache id; the slopes depend on the decoder layer it sits in."""
    sec = spec.lightning_attention
    layer = spec.cache_layers()[layer_id][0]
    return LightningAttention(spec.hidden_size, sec.num_heads, sec.head_dim,
                              slopes(sec.num_heads, layer, spec.num_layers), sec.activation, sec.norm_eps)


def validate(spec: ModelSpec, fail: Fail) -> None:
    sec = spec.lightning_attention
    for name in ("num_heads", "head_dim"):
        if getattr(sec, name) <= 0:
            fail(f"lightning_attention.{name}", f"must be > 0, got {getattr(sec, name)}")
    if sec.activation not in ACTIVATIONS:
        fail("lightning_attention.activation", f"{sec.activation!r} is not one of {', '.join(ACTIVATIONS)}")


def import_hf(cfg: dict, spec: dict) -> None:
    """The section from MiniMax's config: the lightning layers share the attention's head
    count and size, and take `hidden_act` for q|k|v."""
    heads = cfg["num_attention_heads"]
    spec["lightning_attention"] = {"num_heads": heads,
                                   "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
                                   "activation": spec["mlp"]["activation"]}


# HF calls these layers `linear_attention` as it does Gated DeltaNet's: the minimax family maps
# the name (models.import_hf), so the kind claims no HF layer type of its own.
KIND = state_kind("lightning_attention", LightningAttentionSpec, make_mixer, hf_prefix="self_attn",
                  import_hf=import_hf, validate=validate,
                  derived_tensors=("self_attn.slope_rate", "self_attn.query_decay", "self_attn.key_decay",
                                   "self_attn.diagonal_decay"))
