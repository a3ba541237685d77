"""Kimi Delta Attention (KDA, Kimi-Linear's linear attention) for the flattened engine.

KDA is the gated delta rule with a decay per key *channel* instead of per head: with
q, k L2-normalised (q scaled by dk**-0.5), per token and head

    S_t = diag(exp(g_t)) S_{t-1};   S_t += k_t (beta_t (v_t - S_t^T k_t))^T;   o_t = S_t^T q_t

where g_t = -exp(A_log) * softplus(f_b(f_a(x_t)) + dt_bias) is a [dk] vector (log decay <= 0),
beta_t = sigmoid(b(x_t)), and q|k|v come out of short causal depthwise convs (silu). The output
is RMS-normed per head, gated by sigmoid(g_b(g_a(x))), and projected back.

The state plumbing (conv tails and recurrent state in pool pages, the all-decode and mixed
paths, `zooinfer::state_update`) is `models.gated_deltanet.DeltaRuleMixer`'s; this module adds
the channel-wise chunked rule (`chunk_kda`) and the layer's projections.

Chunked math (per head, within a chunk; G_t = sum_{s<=t} g_s, the cumulative log decay, a
vector): with D_ts = diag(exp(G_t - G_s)),

    (I + A) delta = beta * V - (beta * K * exp(G)) S_0,   A_ts = beta_t k_t^T D_ts k_s  (s < t)
    O = (Q * exp(G)) S_0 + P delta,                      P_ts = q_t^T D_ts k_s       (s <= t)
    S_C = exp(G_C) * S_0 + (K * exp(G_C - G))^T delta

A scalar decay factors out of q_t^T D_ts k_s; a channel-wise one does not, and exp(G_t) and
exp(-G_s) apart overflow. So the pairwise terms are built by halving the chunk
(`decayed_scores`): pairs across the halves go through a reference position r as
exp(G_t - G_r) * exp(G_r - G_s), both <= 1, in one matmul; pairs within a half recurse down to
single tokens. Everything else is `delta_rule_scan`, shared with Gated DeltaNet.

Parameters are HF's `KimiDeltaAttention` checkpoint tensors, some stacked along dim 0
(`checkpoint_sources`): qkv_proj = q|k|v_proj, conv1d = q|k|v_conv1d, gate_a_proj =
f_a_proj|g_a_proj|b_proj; the others keep their names and shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.activations import activation
from models.gated_deltanet import CHUNK_SIZE, DeltaRuleMixer, delta_rule_scan, from_chunks, l2norm, to_chunks
from models.layers import GatedRMSNorm

# Largest intra-chunk temporary ([H, chunks, C, dk] elements): longer prefills build their
# pairwise terms a group of chunks at a time.
INTRA_BUDGET = 1 << 24


def decayed_scores(xs: tuple[torch.Tensor, ...], k: torch.Tensor, cum: torch.Tensor) -> list[torch.Tensor]:
    """Pairwise channel-decayed products within chunks, for each x in `xs` (q and k): x, k,
    cum [N, C, dk], C a power of two (cum: the cumulative log decay within each chunk,
    non-increasing along C). Returns [N, C, C] per x: x_t . (k_s * exp(cum_t - cum_s)) for
    s <= t, zero above.

    The chunk halves: pairs across the halves go through the second half's first position r
    as exp(cum_t - r) * exp(r - cum_s), both <= 1, in one matmul; pairs within a half recurse,
    down to single tokens (decay 1). Every factor is <= 1, so nothing overflows however fast a
    channel forgets, and no [C, C, dk] tensor is built: each level costs one pass over q and k."""
    N, C, dk = k.shape
    if C == 1:
        return [(x * k).sum(-1, keepdim=True) for x in xs]
    h = C // 2
    ref = cum[:, h:h + 1]                                                 # [N, 1, dk]
    to_ref = (cum[:, h:] - ref).exp()                                     # second half -> r
    k_ref = (k[:, :h] * (ref - cum[:, :h]).exp()).transpose(-1, -2)       # r -> first half, [N, dk, h]
    halves = decayed_scores(tuple(x.reshape(2 * N, h, dk) for x in xs), k.reshape(2 * N, h, dk),
                            cum.reshape(2 * N, h, dk))
    out = []
    for x, own in zip(xs, halves):
        own = own.view(N, 2, h, h)
        across = (x[:, h:] * to_ref) @ k_ref                              # [N, h, h]
        top = torch.cat((own[:, 0], torch.zeros_like(across)), dim=-1)
        out.append(torch.cat((top, torch.cat((across, own[:, 1]), dim=-1)), dim=1))
    return out


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA rule over one request's tokens, in chunks of `chunk_size` (a power of two).

    q, k: [L, H, dk] float32, L2-normalised, q scaled by dk**-0.5; v: [L, H, dv]; g: [L, H, dk]
    log decay per key channel (<= 0); beta: [L, H]; state: [H, dk, dv] float32 initial state.
    Returns (out [L, H, dv], final state [H, dk, dv]), both float32."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size {chunk_size} is not a power of two")
    L = q.shape[0]
    chunk_size = min(chunk_size, 1 << (L - 1).bit_length())
    q, k, v, g, beta = (to_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    H, n, C, dk = q.shape
    cum = g.cumsum(-2)                                                     # [H, n, C, dk]
    step = max(1, INTRA_BUDGET // (H * C * dk))
    parts = []
    for i in range(0, n, step):
        q_i, k_i, cum_i = (x[:, i:i + step].reshape(-1, C, dk) for x in (q, k, cum))
        parts.append([s.view(H, -1, C, C) for s in decayed_scores((q_i, k_i), k_i, cum_i)])
    qk, kk = (torch.cat(p, dim=1) if len(p) > 1 else p[0] for p in zip(*parts))
    beta = beta.unsqueeze(-1)
    ut = kk * beta                          # row t times beta_t; its diagonal is taken as 1
    new_values = torch.linalg.solve_triangular(ut, v * beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k * beta * cum.exp(), upper=False, unitriangular=True)
    last = cum[:, :, -1:]                                                  # [H, n, 1, dk]
    out, state = delta_rule_scan(q * cum.exp(), k * (last - cum).exp(), qk, new_values, k_cumdecay,
                                 last.transpose(-1, -2).exp(), state)
    return from_chunks(out, L), state


class KimiDeltaAttention(DeltaRuleMixer):
    """Kimi-Linear's KDA layer; arguments mirror HF config fields: hidden_size,
    linear_attn_config.num_heads / head_dim / short_conv_kernel_size, rms_norm_eps (the output
    norm's eps) and hidden_act (the convs' activation)."""

    chunk_rule = staticmethod(chunk_kda)

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel_size: int = 4,
                 rms_norm_eps: float = 1e-5, hidden_act: str = "silu"):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = self.num_v_heads = num_heads
        self.head_dim = self.head_k_dim = self.head_v_dim = head_dim
        self.qkv_dim = D = num_heads * head_dim
        self.conv_kernel_size = conv_kernel_size
        self.conv_dim = 3 * D
        self.act = activation(hidden_act)

        self.qkv_proj = nn.Linear(hidden_size, 3 * D, bias=False)
        self.conv1d = nn.Conv1d(3 * D, 3 * D, kernel_size=conv_kernel_size, bias=False, groups=3 * D,
                                padding=conv_kernel_size - 1)
        self.gate_a_proj = nn.Linear(hidden_size, 2 * head_dim + num_heads, bias=False)
        self.f_b_proj = nn.Linear(head_dim, D, bias=False)
        self.g_b_proj = nn.Linear(head_dim, D, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(D))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))
        self.o_norm = GatedRMSNorm(head_dim, eps=rms_norm_eps, sigmoid=True)
        self.o_proj = nn.Linear(D, hidden_size, bias=False)

    def checkpoint_sources(self) -> dict[str, list[tuple[str, int, int]]]:
        """Our parameter -> [(checkpoint name relative to the layer's KDA prefix, row offset,
        rows)]: q|k|v_proj stacked into qkv_proj, q|k|v_conv1d into conv1d, f_a|g_a|b_proj
        into gate_a_proj, the rest 1:1 (HF's KimiDeltaAttention checkpoint names)."""
        D, dk, H = self.qkv_dim, self.head_dim, self.num_heads
        src = {"qkv_proj.weight": [(f"{x}_proj.weight", i * D, D) for i, x in enumerate("qkv")],
               "conv1d.weight": [(f"{x}_conv1d.weight", i * D, D) for i, x in enumerate("qkv")],
               "gate_a_proj.weight": [("f_a_proj.weight", 0, dk), ("g_a_proj.weight", dk, dk),
                                      ("b_proj.weight", 2 * dk, H)]}
        for name in ("f_b_proj.weight", "g_b_proj.weight", "dt_bias", "A_log", "o_norm.weight", "o_proj.weight"):
            src[name] = [(name, 0, self.get_parameter(name).shape[0])]
        return src

    def _project(self, hidden: torch.Tensor):
        """-> mixed_qkv [T, 3D] (q|k|v before the convs), output gate [T, H, dk], and the state
        op's gates g [T, H, dk] (log decay) and beta [T, H] in float32. The gates are computed
        here, in the graph: they do not depend on the convs."""
        T, H, dk = hidden.shape[0], self.num_heads, self.head_dim
        f_a, g_a, b = self.gate_a_proj(hidden).split([dk, dk, H], dim=-1)
        f = (self.f_b_proj(f_a).float() + self.dt_bias.float()).view(T, H, dk)
        g = -self.A_log.float().view(H, 1).exp() * F.softplus(f)
        beta = b.float().sigmoid()
        return self.qkv_proj(hidden), self.g_b_proj(g_a).view(T, H, dk), g, beta

    def _qkv_gates(self, conv_out: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
        """Post-conv [N, 3D] -> fp32 q, k [N, H, dk] (l2-normed, q scaled), v [N, H, dk], g, beta."""
        N, H, dk = conv_out.shape[0], self.num_heads, self.head_dim
        q, k, v = (x.float().view(N, H, dk) for x in conv_out.split(self.qkv_dim, dim=-1))
        return l2norm(q) * dk ** -0.5, l2norm(k), v, g, beta

    def _finish(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Sigmoid-gated RMSNorm per head on [T, H, dv] (the token dim kept, see GatedDeltaNet),
        then o_proj."""
        return self.o_proj(self.o_norm(core.to(dtype), z).flatten(1))
