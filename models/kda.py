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
exp(-G_s) apart overflow. So the pairwise terms are built per 16-token sub-chunk (FLA's
layout): pairs in earlier sub-chunks go through the sub-chunk's first position r as
exp(G_t - G_r) * exp(G_r - G_s), both <= 1, in one matmul; pairs inside a sub-chunk use the
exact per-channel decay. Everything else is `delta_rule_scan`, shared with Gated DeltaNet.

Parameters are HF's `KimiDeltaAttention` checkpoint tensors, some stacked along dim 0 (see
models/kinds/kda.py): qkv_proj = q|k|v_proj, conv1d = q|k|v_conv1d, gate_a_proj =
f_a_proj|g_a_proj|b_proj; the others keep their names and shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.activations import activation
from models.gated_deltanet import CHUNK_SIZE, DeltaRuleMixer, delta_rule_scan, from_chunks, l2norm, to_chunks
from models.layers import GatedRMSNorm

SUB_CHUNK = 16
# Largest intra-chunk temporary ([H, chunks, C, SUB_CHUNK, dk] elements): longer prefills build
# their pairwise terms a group of chunks at a time.
INTRA_BUDGET = 1 << 24


def decayed_scores(q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise channel-decayed products within chunks: q, k, cum [H, n, C, dk] (cum: the
    cumulative log decay within each chunk, non-increasing along C; C a multiple of SUB_CHUNK).
    Returns (qk, kk) [H, n, C, C]: x_t . (k_s * exp(cum_t - cum_s)) for s <= t, zero above."""
    H, n, C, dk = q.shape
    B = SUB_CHUNK
    m = C // B
    qb, kb, cb = (x.reshape(H, n, m, B, dk) for x in (q, k, cum))
    ref = cb[:, :, :, :1]                                                  # [H, n, m, 1, dk]
    # Earlier sub-chunks, through the reference r: exp(cum_t - r) * exp(r - cum_s), both <= 1
    # (the clamp only touches pairs that the mask drops).
    to_ref = (cb - ref).exp()
    k_ref = k.unsqueeze(2) * (ref - cum.unsqueeze(2)).clamp(max=0).exp()   # [H, n, m, C, dk]
    cols = torch.arange(C, device=q.device)
    earlier = (cols < torch.arange(m, device=q.device)[:, None] * B)[:, None, :]   # [m, 1, C]
    k_ref_t = k_ref.transpose(-1, -2)
    qk = ((qb * to_ref) @ k_ref_t).masked_fill(~earlier, 0.0)             # [H, n, m, B, C]
    kk = ((kb * to_ref) @ k_ref_t).masked_fill(~earlier, 0.0)
    # Own sub-chunk: the exact decay per channel, masked (s > t) before the exp.
    later = torch.ones(B, B, dtype=torch.bool, device=q.device).triu(1)
    diff = (cb.unsqueeze(-2) - cb.unsqueeze(-3)).masked_fill(later[..., None], float("-inf"))
    k_dec = kb.unsqueeze(-3) * diff.exp()                                 # [H, n, m, B(t), B(s), dk]
    eye = torch.eye(m, dtype=q.dtype, device=q.device)
    out = []
    for acc, x in ((qk, qb), (kk, kb)):
        own = (k_dec @ x.unsqueeze(-1)).squeeze(-1)                       # [H, n, m, B, B]
        acc = acc + torch.einsum("hnits,ij->hnitjs", own, eye).reshape(H, n, m, B, C)
        out.append(acc.reshape(H, n, C, C))
    return out[0], out[1]


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA rule over one request's tokens, in chunks of `chunk_size` (a multiple of 16).

    q, k: [L, H, dk] float32, L2-normalised, q scaled by dk**-0.5; v: [L, H, dv]; g: [L, H, dk]
    log decay per key channel (<= 0); beta: [L, H]; state: [H, dk, dv] float32 initial state.
    Returns (out [L, H, dv], final state [H, dk, dv]), both float32."""
    if chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of {SUB_CHUNK}")
    L = q.shape[0]
    chunk_size = min(chunk_size, -(-L // SUB_CHUNK) * SUB_CHUNK)
    q, k, v, g, beta = (to_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    H, n, C, dk = q.shape
    cum = g.cumsum(-2)                                                     # [H, n, C, dk]
    step = max(1, INTRA_BUDGET // (H * C * SUB_CHUNK * dk))
    parts = [decayed_scores(q[:, i:i + step], k[:, i:i + step], cum[:, i:i + step]) for i in range(0, n, step)]
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

    def _project(self, hidden: torch.Tensor):
        """-> mixed_qkv [T, 3D] (q|k|v before the convs), gates [g [T, H, dk] log decay, beta
        [T, H]] in float32, output gate [T, H, dk]. The gates are computed here, in the graph:
        they do not depend on the convs."""
        T, H, dk = hidden.shape[0], self.num_heads, self.head_dim
        f_a, g_a, b = self.gate_a_proj(hidden).split([dk, dk, H], dim=-1)
        f = (self.f_b_proj(f_a).float() + self.dt_bias.float()).view(T, H, dk)
        g = -self.A_log.float().view(H, 1).exp() * F.softplus(f)
        beta = b.float().sigmoid()
        return self.qkv_proj(hidden), [g, beta], self.g_b_proj(g_a).view(T, H, dk)

    def _qkv_gates(self, conv_out: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
        """Post-conv [N, 3D] -> fp32 q, k [N, H, dk] (l2-normed, q scaled), v [N, H, dk], g, beta."""
        N, H, dk = conv_out.shape[0], self.num_heads, self.head_dim
        q, k, v = (x.float().view(N, H, dk) for x in conv_out.split(self.qkv_dim, dim=-1))
        return l2norm(q) * dk ** -0.5, l2norm(k), v, g, beta

    def _finish(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Sigmoid-gated RMSNorm per head on [T, H, dv] (the token dim kept, see GatedDeltaNet),
        then o_proj."""
        return self.o_proj(self.o_norm(core.to(dtype), z).flatten(1))
