"""Gated DeltaNet (Qwen3-Next linear attention) for the flattened, continuously-batched engine,
and the plumbing every short-conv delta-rule layer shares (`DeltaRuleMixer`: Gated DeltaNet
here, Kimi Delta Attention in models/kda.py).

The layer works on `[num_tokens, hidden]` with no batch axis. Request i of the step owns tokens
`meta.query_start_loc[i]:meta.query_start_loc[i+1]` and the state slot `meta.slots[i]` of two
per-layer tensors that are updated in place (see `DeltaRuleMixer.state_shapes`):

- conv state `[num_slots, conv_dim, kernel - 1]`: the last `kernel - 1` *inputs* of the causal
  depthwise conv (the projected q|k|v channels before the conv), oldest first, so that the next
  chunk's conv can be run as if the whole prompt were one sequence;
- recurrent state `[num_slots, num_v_heads, k_head_dim, v_head_dim]`: the delta-rule state S,
  read as `o_t = q_t @ S_t` (q as a row vector). Kept in whatever dtype the caller allocates
  (float32 recommended); the math runs in float32.

`meta.has_initial_state[i] == False` (a request's first chunk) means both states are taken as
zero whatever the slot holds, so slots never need clearing.

Paths: when `meta.all_decode` every request has one token and the step is one vectorised
recurrent update over all requests (no Python loop, no host sync). Otherwise the causal conv
runs over every token of the step at once, each request's chunk prefixed with its stored tail
(models.causal_conv); single-token requests are still grouped into one vectorised step, and
each multi-token request (a prefill chunk) runs the layer's chunked delta rule (chunks of up
to 64 tokens) from its stored state; its final states are written back to its slot.

Parameter names and shapes equal HF's `Qwen3NextGatedDeltaNet`, so its state_dict loads 1:1.
`SeparateGatedDeltaNet` (OLMo-Hybrid) and `Qwen3_5GatedDeltaNet` (Qwen3.5) take their input
projections from other checkpoint tensors; the rest is the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import attention.ops  # noqa: F401  (registers zooinfer::state_update, used by forward_paged)
from attention.state import StateMetadata, run_by_request
from models.activations import activation
from models.causal_conv import ConvPlan, conv_step, conv_varlen, step_conv_plan
from models.layers import GatedRMSNorm

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA-style L2 normalisation over the last dim (same formula as HF)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[L, H, *d] -> [H, n, chunk_size, *d], end-padded with zeros to n whole chunks (zero k, v,
    beta and log decay leave a delta-rule state unchanged; padded outputs are dropped)."""
    x = x.transpose(0, 1)
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, -x.shape[1] % chunk_size))
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])


def from_chunks(out: torch.Tensor, length: int) -> torch.Tensor:
    """[H, n, C, d] -> [length, H, d]: the inverse of `to_chunks`, padding dropped."""
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1)


def delta_rule_scan(q: torch.Tensor, k: torch.Tensor, intra: torch.Tensor, new_values: torch.Tensor,
                    k_cumdecay: torch.Tensor, chunk_decay: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part of a chunked (gated) delta rule: chunk by chunk, never token by token.

    Per chunk i ([H, n, C, .] tensors indexed at i): q decayed to the chunk start (q_t * exp(G_t)),
    k decayed to the chunk end (k_s * exp(G_C - G_s)), intra [C, C] (decayed q_t . k_s, s <= t),
    the triangular-solved values and k_cumdecay (what the state at the chunk start subtracts from
    them), chunk_decay (exp(G_C): [H, n, 1, 1] for a decay per head, [H, n, dk, 1] per key
    channel). Returns (out [H, n, C, dv], final state [H, dk, dv])."""
    out = torch.empty_like(new_values)
    for i in range(new_values.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out, state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one request's tokens, chunked (HF torch_chunk_gated_delta_rule math).

    q, k: [L, H, dk] float32, already L2-normalised, q already scaled by dk**-0.5;
    v: [L, H, dv]; g (log decay), beta: [L, H]; state: [H, dk, dv] float32 initial state.
    Returns (out [L, H, dv], final state [H, dk, dv]), both float32.
    """
    L = q.shape[0]
    chunk_size = min(chunk_size, L)
    q, k, v, g, beta = (to_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)

    cum = g.cumsum(-1)                                                   # [H, n, C]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay                          # [H, n, C, C]
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    out, state = delta_rule_scan(q * cum.exp().unsqueeze(-1), k * (cum[..., -1:] - cum).exp().unsqueeze(-1),
                                 intra, new_values, k_cumdecay, cum[..., -1].exp()[..., None, None], state)
    return from_chunks(out, L), state


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, vectorised over requests (HF torch_recurrent_gated_delta_rule math).

    q, k: [R, H, dk] float32 (normalised, q scaled); v: [R, H, dv]; beta: [R, H]; g (log decay):
    [R, H] (one per head, Gated DeltaNet) or [R, H, dk] (one per key channel, KDA);
    state: [R, H, dk, dv] float32. Returns (out [R, H, dv], new state [R, H, dk, dv]).
    """
    decay = g.exp()
    state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * q.unsqueeze(-1)).sum(dim=-2)
    return out, state


class DeltaRuleMixer(nn.Module):
    """What every short-conv delta-rule state layer shares: the causal conv over q|k|v with its
    stored tail, the recurrent state, the decode / mixed paths and the paged entry points.

    A subclass sets `conv1d` (depthwise, weight [conv_dim, 1, kernel]), `conv_dim`,
    `conv_kernel_size`, `act`, `num_v_heads`, `head_k_dim`, `head_v_dim` and `chunk_rule` (its
    chunked delta rule, fn(q, k, v, g, beta, state) -> (out, state)), and implements
    `_project(hidden) -> (mixed_qkv [T, conv_dim], z, *gates)` (gates: [T, ...] tensors the
    state op takes), `_qkv_gates(conv_out, *gates) -> (q, k, v, g, beta)` in float32 and
    `_finish(core, z, dtype) -> [T, hidden]`."""

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request state shapes (allocate `[num_slots, *shape]` per layer):
        conv: (conv_dim, kernel - 1), the q|k|v channels' last kernel-1 conv inputs, oldest first;
        recurrent: (num_v_heads, head_k_dim, head_v_dim), the delta-rule state S (o = q @ S)."""
        return {"conv": (self.conv_dim, self.conv_kernel_size - 1),
                "recurrent": (self.num_v_heads, self.head_k_dim, self.head_v_dim)}

    # ---- per-path state updates --------------------------------------------------------------

    def _decode(self, x: torch.Tensor, gates: list[torch.Tensor], conv_state: torch.Tensor,
                recurrent_state: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
        """One token per request: x [R, conv_dim] -> core out [R, Hv, dv] (fp32)."""
        conv_out = self.act(conv_step(x, conv_state, slots, has_init, self.conv1d.weight[:, 0])).to(x.dtype)
        return self._recurrent_step(conv_out, gates, recurrent_state, slots, has_init)

    def _recurrent_step(self, conv_out: torch.Tensor, gates: list[torch.Tensor],
                        recurrent_state: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
        """The delta rule for one post-conv token per request -> [R, Hv, dv] (fp32)."""
        q, k, v, g, beta = self._qkv_gates(conv_out, *gates)
        S = recurrent_state[slots].float()
        S = torch.where(has_init.view(-1, 1, 1, 1), S, torch.zeros((), dtype=S.dtype, device=S.device))
        out, S = recurrent_gated_delta_step(q, k, v, g, beta, S)
        recurrent_state[slots] = S.to(recurrent_state.dtype)
        return out

    def _prefill_one(self, conv_out: torch.Tensor, gates: list[torch.Tensor], recurrent_state: torch.Tensor,
                     slot: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
        """One request's chunk after the conv: conv_out [L, conv_dim]; slot, has_init: [1]
        tensors -> out [L, Hv, dv], the chunked delta rule from its stored state."""
        q, k, v, g, beta = self._qkv_gates(conv_out, *gates)
        S = recurrent_state.index_select(0, slot)[0].float()
        S = torch.where(has_init, S, torch.zeros((), dtype=S.dtype, device=S.device))
        out, S = self.chunk_rule(q, k, v, g, beta, S)
        recurrent_state.index_copy_(0, slot, S.unsqueeze(0).to(recurrent_state.dtype))
        return out

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                meta: StateMetadata) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; updates the states' slots in place.

        In the all-decode path T must equal meta.num_reqs (pad slots alongside tokens). In the
        mixed path, tokens past query_start_loc[-1] (padding) get a zero core output."""
        mixed_qkv, z, *gates = self._project(hidden)
        core = self._core(mixed_qkv, gates, conv_state, recurrent_state, meta)
        return self._finish(core, z, hidden.dtype)

    def forward_paged(self, hidden: torch.Tensor, pages: torch.Tensor, layer_id: int) -> torch.Tensor:
        """States in pool pages: projections, gated norm and output projection stay in the
        (compiled) graph; the conv and delta rule, which read and write the pages through the
        step's host-side plan, run inside the `zooinfer::state_update` op (see `update_states`)."""
        mixed_qkv, z, *gates = self._project(hidden)
        core = torch.ops.zooinfer.state_update([mixed_qkv, *gates], pages, layer_id,
                                               [self.num_v_heads, self.head_v_dim])
        return self._finish(core, z, hidden.dtype)

    def update_states(self, inputs: list[torch.Tensor], states: list[torch.Tensor], plan) -> torch.Tensor:
        """`zooinfer::state_update` body: inputs (mixed_qkv, *gates), states (conv, recurrent)."""
        return self._core(inputs[0], inputs[1:], *states, plan.meta, step_conv_plan(plan, self.conv_kernel_size))

    def _core(self, mixed_qkv: torch.Tensor, gates: list[torch.Tensor], conv_state: torch.Tensor,
              recurrent_state: torch.Tensor, meta: StateMetadata, conv_plan: ConvPlan | None = None) -> torch.Tensor:
        """Conv + delta rule over the step's tokens -> core [T, Hv, dv] fp32. The conv runs
        over every token at once; the delta rule as one vectorised step over the single-token
        requests and chunked (64-token chunks) per longer request."""
        if meta.all_decode:
            return self._decode(mixed_qkv, gates, conv_state, recurrent_state, meta.slots,
                                meta.has_initial_state)
        T, device = mixed_qkv.shape[0], mixed_qkv.device
        conv_plan = conv_plan or ConvPlan.build(meta, self.conv_kernel_size)
        conv_out = conv_varlen(mixed_qkv, conv_state, meta, conv_plan, self.conv1d.weight[:, 0])
        conv_out = self.act(conv_out).to(mixed_qkv.dtype)
        return run_by_request(
            meta, lambda: torch.zeros(T, self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=device),
            lambda tok, req: self._recurrent_step(conv_out[tok], [x[tok] for x in gates], recurrent_state,
                                                  meta.slots[req], meta.has_initial_state[req]),
            lambda s, e, i: self._prefill_one(conv_out[s:e], [x[s:e] for x in gates], recurrent_state,
                                              meta.slots[i:i + 1], meta.has_initial_state[i:i + 1]))


class GatedDeltaNet(DeltaRuleMixer):
    """Qwen3-Next linear-attention layer; arguments mirror HF config fields:
    hidden_size, linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim, linear_conv_kernel_dim, rms_norm_eps, hidden_act (and OLMo-Hybrid's
    linear_allow_neg_eigval: beta = 2 * sigmoid(b))."""

    chunk_rule = staticmethod(chunk_gated_delta_rule)

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int = 4, rms_norm_eps: float = 1e-6,
                 hidden_act: str = "silu", allow_neg_eigval: bool = False):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_k_heads})")
        try:
            act = activation(hidden_act)
        except ValueError:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}") from None
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.activation = hidden_act
        self.act = act
        self.beta_scale = 2.0 if allow_neg_eigval else 1.0   # beta in [0, 2]: negative eigenvalues

        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=conv_kernel_size, bias=False,
                                groups=self.conv_dim, padding=conv_kernel_size - 1)
        self._make_projections()
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps=rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @classmethod
    def from_hf_config(cls, config) -> "GatedDeltaNet":
        return cls(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                   config.linear_key_head_dim, config.linear_value_head_dim,
                   config.linear_conv_kernel_dim, config.rms_norm_eps, config.hidden_act)

    # ---- projections -------------------------------------------------------------------------

    def _make_projections(self) -> None:
        """HF's two fused input projections: per key head [q | k | v | z], then [b | a]."""
        self.in_proj_qkvz = nn.Linear(self.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(self.hidden_size, 2 * self.num_v_heads, bias=False)

    def checkpoint_sources(self) -> dict[str, list[tuple[str, int, int]]]:
        """Our parameter -> [(checkpoint name relative to the layer's prefix, row offset, rows)]:
        HF's Qwen3NextGatedDeltaNet names, 1:1."""
        return {name: [(name, 0, p.shape[0])] for name, p in self.named_parameters()}

    def _project(self, hidden: torch.Tensor):
        """-> mixed_qkv [T, conv_dim] (q|k|v, heads in order), z [T, Hv, dv], b, a [T, Hv]."""
        T = hidden.shape[0]
        nk, r = self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        # HF layout: per key head g: [q (dk) | k (dk) | v (r*dv) | z (r*dv)]; ba: [b (r) | a (r)].
        qkvz = self.in_proj_qkvz(hidden).view(T, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = self.in_proj_ba(hidden).view(T, nk, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        # Explicit sizes: with T unbacked under torch.compile, -1 would need a T != 0 guard.
        mixed_qkv = torch.cat((q.reshape(T, self.key_dim), k.reshape(T, self.key_dim),
                               v.reshape(T, self.value_dim)), dim=-1)
        return (mixed_qkv, z.reshape(T, self.num_v_heads, dv), b.reshape(T, self.num_v_heads),
                a.reshape(T, self.num_v_heads))

    def _qkv_gates(self, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Post-conv [N, conv_dim] -> fp32 q, k [N, Hv, dk] (l2-normed, q scaled), v [N, Hv, dv],
        g (log decay), beta [N, Hv]."""
        N = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.num_v_heads // self.num_k_heads
        q = l2norm(q.float().view(N, self.num_k_heads, self.head_k_dim)) * self.head_k_dim ** -0.5
        k = l2norm(k.float().view(N, self.num_k_heads, self.head_k_dim))
        if r > 1:  # each q/k head serves r consecutive value heads
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        v = v.float().view(N, self.num_v_heads, self.head_v_dim)
        beta = b.float().sigmoid() * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v, g, beta

    def _finish(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gated norm per value head on [T, Hv, dv], then out_proj. The token dim stays a dim of
        its own: under torch.compile with an unbacked token count, folding it into rows
        ([T * Hv, dv] and back) is miscompiled by inductor (torch 2.13, CPU)."""
        out = self.norm(core.to(dtype), z)
        return self.out_proj(out.flatten(1))

class SeparateGatedDeltaNet(GatedDeltaNet):
    """OLMo-Hybrid's Gated DeltaNet (HF `OlmoHybridGatedDeltaNet`): the same conv and delta
    rule, but q, k, v, the output gate, b and a come from separate projections of the layer
    input, each head-major (all q heads, then all k heads, ...; no per-key-head interleave).
    They run here as one fused `in_proj`, filled from the checkpoint's q_proj, k_proj, v_proj,
    g_proj, b_proj and a_proj; its q_conv1d, k_conv1d and v_conv1d fill our one conv1d (HF
    concatenates them on load), its o_proj and o_norm are our out_proj and norm."""

    def _make_projections(self) -> None:
        self.in_proj = nn.Linear(self.hidden_size, 2 * self.key_dim + 2 * self.value_dim + 2 * self.num_v_heads,
                                 bias=False)

    def checkpoint_sources(self) -> dict[str, list[tuple[str, int, int]]]:
        src = super().checkpoint_sources()          # dt_bias and A_log keep their names
        rows = {"q_proj": self.key_dim, "k_proj": self.key_dim, "v_proj": self.value_dim,
                "g_proj": self.value_dim, "b_proj": self.num_v_heads, "a_proj": self.num_v_heads}
        parts, offset = [], 0
        for name, n in rows.items():
            parts.append((f"{name}.weight", offset, n))
            offset += n
        src["in_proj.weight"] = parts
        # the conv as three (OLMo-core's layout), sized by the file: HF's save_pretrained
        # re-splits the q|k|v channels into equal thirds, OLMo-core's are key, key, value
        src["conv1d.weight"] = [(f"{n}_conv1d.weight", None, None) for n in "qkv"]
        src["out_proj.weight"] = [("o_proj.weight", 0, self.hidden_size)]
        src["norm.weight"] = [("o_norm.weight", 0, self.head_v_dim)]
        return src

    def _project(self, hidden: torch.Tensor):
        """-> mixed_qkv [T, conv_dim] (q|k|v), z [T, Hv, dv], b, a [T, Hv]."""
        T, Hv = hidden.shape[0], self.num_v_heads
        mixed_qkv, z, b, a = self.in_proj(hidden).split([self.conv_dim, self.value_dim, Hv, Hv], dim=-1)
        return mixed_qkv, z.reshape(T, Hv, self.head_v_dim), b, a


class Qwen3_5GatedDeltaNet(SeparateGatedDeltaNet):
    """Qwen3.5's Gated DeltaNet (HF `Qwen3_5GatedDeltaNet`): Qwen3-Next's math with the input
    projections split per part and head-major, in_proj_qkv (q|k|v, already the conv's channel
    order), in_proj_z, in_proj_b and in_proj_a, stacked into the one fused `in_proj` of
    `SeparateGatedDeltaNet`; conv1d, dt_bias, A_log, norm and out_proj keep HF's names."""

    def checkpoint_sources(self) -> dict[str, list[tuple[str, int, int]]]:
        src = GatedDeltaNet.checkpoint_sources(self)
        rows = {"in_proj_qkv": self.conv_dim, "in_proj_z": self.value_dim,
                "in_proj_b": self.num_v_heads, "in_proj_a": self.num_v_heads}
        parts, offset = [], 0
        for name, n in rows.items():
            parts.append((f"{name}.weight", offset, n))
            offset += n
        src["in_proj.weight"] = parts
        return src
