"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4, Xie et al. 2026): `streams`
parallel residual streams instead of one.

The residual of every token is `[streams, hidden]`. Before each sub-block (the token mixers,
then the feed-forward block) a `HyperConnection` reads all streams and derives three mixes
from them with one small projection:

    pre  [n]     collapses the streams into the sub-block's input:  x = sum_j pre_j s_j
    post [n]     spreads the sub-block's output f(x) back onto the streams
    comb [n, n]  mixes the streams themselves, projected (Sinkhorn-Knopp) onto doubly
                 stochastic matrices so that repeated mixing cannot grow the stream norm

and the streams become  s'_k = post_k f(x) + sum_j comb_jk s_j.  After the last layer a
`HyperHead` collapses the streams once more (its own `pre`) before the final norm.

All mixes are computed in float32 from float32 parameters (the checkpoint keeps them so),
whatever the model dtype. Declared by the `hyper_connections:` section; checkpoint names are
`weight_names` keys `hc_attn` / `hc_ffn` (per layer, prefixes of `fn`, `base`, `scale`) and
`hc_head` (prefix of the head's `fn`, `base`, `scale`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import DecoderLayer

if TYPE_CHECKING:
    from models.spec import ModelSpec

WEIGHT_NAMES = {"hc_attn": "hc_attn_", "hc_ffn": "hc_ffn_", "hc_head": "model.hc_head.hc_"}


@dataclass(slots=True)
class HyperConnectionSpec:
    """The `hyper_connections:` section (HF: hc_mult, hc_sinkhorn_iters, hc_eps)."""
    streams: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6


def validate(h: HyperConnectionSpec, fail) -> None:
    if h.streams < 1:
        fail("hyper_connections.streams", f"must be >= 1, got {h.streams}")
    if h.sinkhorn_iters < 1:
        fail("hyper_connections.sinkhorn_iters", f"must be >= 1, got {h.sinkhorn_iters}")
    if not h.eps > 0:
        fail("hyper_connections.eps", f"must be > 0, got {h.eps}")


def _flat_rms(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, n, H] -> [T, n * H] float32, RMS-normalised without a weight."""
    flat = streams.flatten(1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """The pre / post / comb mixes of one sub-block (see the module docstring).

    Parameters (float32): fn [(2 + n) * n, n * hidden], base [(2 + n) * n], scale [3]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hyper_connections
        self.n, self.iters, self.eps, self.norm_eps = h.streams, h.sinkhorn_iters, h.eps, spec.norm.eps
        width = (2 + self.n) * self.n
        self.fn = nn.Parameter(torch.zeros(width, self.n * spec.hidden_size))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))
        self.fp32_params = ("fn", "base", "scale")

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> (post [T, n], comb [T, n, n], collapsed input [T, H])."""
        n, eps = self.n, self.eps
        mixes = F.linear(_flat_rms(streams, self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):      # Sinkhorn-Knopp: rows, then columns, sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams: post_k f(x) + sum_j comb_jk s_j."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(1, 2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams (its own sigmoid `pre`, no post or comb).

    Parameters (float32): fn [n, n * hidden], base [n], scale [1]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hyper_connections
        self.eps, self.norm_eps = h.eps, spec.norm.eps
        self.fn = nn.Parameter(torch.zeros(h.streams, h.streams * spec.hidden_size))
        self.base = nn.Parameter(torch.zeros(h.streams))
        self.scale = nn.Parameter(torch.ones(1))
        self.fp32_params = ("fn", "base", "scale")

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        pre = torch.sigmoid(F.linear(_flat_rms(streams, self.norm_eps), self.fn) * self.scale + self.base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class HyperConnectedLayer(DecoderLayer):
    """A decoder layer on hyper-connected streams: each sub-block reads the collapse of the
    streams (through its pre-norm) and is merged back into all of them. Token mixers and the
    feed-forward block are the DecoderLayer's; only the residual differs."""

    def __init__(self, spec: ModelSpec, layer_id: int, mixers):
        super().__init__(spec, layer_id, mixers)
        self.attn_hc = HyperConnection(spec)
        self.ffn_hc = HyperConnection(spec)
        self.hashed = bool(getattr(self.mlp, "hashed", False))

    def forward(self, positions, streams, residual, caches, token_ids=None):
        """streams [T, n, H] -> (streams, None); `token_ids` feed a hash-routed MoE."""
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, self._mix(positions, self.input_layernorm(x), caches), post, comb)
        post, comb, x = self.ffn_hc(streams)
        h = self.post_attention_layernorm(x)
        out = self.mlp(h, token_ids) if self.hashed else self.mlp(h)
        return HyperConnection.merge(streams, out, post, comb), None


def hyper_sources(spec: ModelSpec, num_layers: int) -> dict[str, list[tuple[str, int, int]]]:
    """Checkpoint names of the streams' parameters (every layer's two mixes and the head)."""
    name, n = spec.weight_name, spec.hyper_connections.streams
    rows = {"fn": (2 + n) * n, "base": (2 + n) * n, "scale": 3}
    src = {}
    for i in range(num_layers):
        hf = name("layer").format(i=i)
        for ours, key in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn")):
            for p, r in rows.items():
                src[f"layers.{i}.{ours}.{p}"] = [(hf + name(key) + p, 0, r)]
    for p, r in (("fn", n), ("base", n), ("scale", 1)):
        src[f"hc_head.{p}"] = [(name("hc_head") + p, 0, r)]
    return src
