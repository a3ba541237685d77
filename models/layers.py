"""Layer modules: norms, rotary embedding, attention, MLP and the decoder layer.

The decoder layer is the same for every layer kind: its mixer (attention, a state layer, ...)
comes from the kind's registry entry (models.kinds), which also says how to call it.

Modules work on the flattened token dimension ([num_tokens, hidden]) with no batch axis:
the runner packs every scheduled request's tokens into one row, and attention finds each
token's request through the per-step plan. Projections are fused (qkv, gate_up) so a layer
runs two large GEMMs instead of five small ones; the loader fills the fused weights from
the checkpoint's separate tensors.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import attention.ops  # noqa: F401  (registers zooinfer::paged_attention and zooinfer::state_update)
from attention.ops import paged_attention_op
from zooinfer_kernels import elementwise as fused   # the fused elementwise CPU kernels
from models import prepack
from models.activations import ACTIVATIONS

if TYPE_CHECKING:   # models.spec imports the kind registry, which imports these modules
    from models.kinds import LayerKind
    from models.spec import ModelSpec, RopeSpec


class RMSNorm(nn.Module):
    """RMSNorm in float32; multiplies by (offset + weight) so Gemma's `1 + w` is offset=1.
    In eager mode on fp32 CPU tensors it runs as one fused kernel (zooinfer_kernels/elementwise.py)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.use_kernel(x, self.weight):
            return fused.rms_norm(x, self.weight, self.eps, self.offset)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.float() + self.offset if self.offset else self.weight.float()
        return (weight * x).to(dtype) if self.offset else weight.to(dtype) * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm in one pass: residual = residual + x * multiplier,
        returns (norm(residual), residual). Neither input is modified."""
        if fused.use_kernel(x, residual, self.weight):
            return fused.add_rms_norm(x, residual, self.weight, self.eps, self.offset, multiplier)
        residual = residual + x * multiplier if multiplier != 1.0 else residual + x
        return self(residual), residual


class GatedRMSNorm(nn.Module):
    """RMSNorm with a silu (Kimi: sigmoid) gate, in the orders the HF state mixers use (the weight is
    `weight`, ones at init, so HF state dicts load 1:1). Either order RMS-normalises each
    group of `group_size` channels (None: all of them):

    - `gate_first` (Mamba2 / Bamba `MambaRMSNormGated`, Falcon-H1 with mamba_norm_before_gate
      false): x * silu(gate), normalised, times weight; float32 out.
    - otherwise (Qwen3-Next `Qwen3NextRMSNormGated`, Falcon-H1 `FalconH1RMSNormGated` with
      mamba_norm_before_gate): normalised x times weight in x's dtype, then times silu(gate);
      out in x's dtype;
    - `sigmoid` (Kimi-Linear `KimiLinearRMSNormGated`): normalised x times weight, all in
      float32, then times sigmoid(gate); out in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None, gate_first: bool = False,
                 sigmoid: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.group_size = group_size
        self.gate_first = gate_first
        self.sigmoid = sigmoid

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.group_size is not None:
            x = x.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).view(shape)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.gate_first:
            return self.weight.float() * self._normalise(x.float() * F.silu(gate.float()))
        dtype = x.dtype
        if self.sigmoid:
            return (self.weight.float() * self._normalise(x.float()) * torch.sigmoid(gate.float())).to(dtype)
        x = self.weight * self._normalise(x.float()).to(dtype)
        x = x * F.silu(gate.float())
        return x.to(dtype)


def rope_inv_freq(rope: RopeSpec, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    elif rope.type == "yarn":
        inv_freq = _yarn_inv_freq(rope, rotary_dim, inv_freq)
    return inv_freq


def _yarn_inv_freq(rope: RopeSpec, rotary_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071, as transformers' `_compute_yarn_parameters`): dims that turn
    more than `beta_fast` times over the original context keep their frequency (extrapolate),
    dims that turn fewer than `beta_slow` times are slowed by `factor` (interpolate), and a
    linear ramp over the dims in between blends the two."""
    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001   # no singular ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # HF's order of operations, so the tables are bit for bit its own: the interpolated
    # frequency is 1 / (factor * base^(2i/d)), weighted by 1 - (1 - ramp).
    keep = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return 1.0 / (rope.factor * pos_freqs) * (1 - keep) + inv_freq * keep


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 m ln(factor) + 1 for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_attention_factor(rope: RopeSpec) -> float:
    """What cos and sin are scaled by (so q.k by its square): YaRN's attention temperature,
    1 for the other rope types. Unset, it is 0.1 ln(factor) + 1, or with DeepSeek's `mscale`
    and `mscale_all_dim` the ratio of that formula at the two."""
    if rope.type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) over the first `rotary_dim` dims, with a
    cos/sin table precomputed for every position up to max_model_len."""

    def __init__(self, head_dim: int, rope: RopeSpec, max_positions: int):
        super().__init__()
        self.rope, self.max_positions = rope, max_positions
        self.rotary_dim = 0 if rope.type == "none" else int(head_dim * rope.partial_rotary_factor)
        cos, sin = self.tables()
        self.register_buffer("cos", cos, persistent=False)   # [max_pos, rotary_dim/2]
        self.register_buffer("sin", sin, persistent=False)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.rope, self.rotary_dim)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        scale = rope_attention_factor(self.rope)
        if scale != 1.0:
            return freqs.cos() * scale, freqs.sin() * scale
        return freqs.cos(), freqs.sin()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.rotary_dim:
            return x
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if not self.rotary_dim:    # rope type none (NoPE layers, Granite 4.0-H): no table lookup
            return q, k
        if fused.use_kernel(q, k, self.cos):
            return fused.rope(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)   # [tokens, 1, rotary_dim/2]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class Attention(nn.Module):
    """Full or sliding-window attention (the window lives in the layer's KV cache group,
    which the backend plans per step; the layer itself only picks its rope). With
    `attention.sinks` (gpt-oss) each head has a learned logit `sinks[h]` that joins the
    softmax denominator as a key with no value, so a query may attend to "nothing"; every
    backend takes it through the attention op."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        a = spec.attention
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        self.output_gate = a.output_gate
        q_rows = self.q_size * (2 if a.output_gate else 1)   # gated: per head [query | gate]
        self.qkv_proj = nn.Linear(spec.hidden_size, q_rows + 2 * self.kv_size, bias=a.bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=a.o_bias)
        # per head (Qwen3), or over the whole q / k projection (OLMo 2/3: qk_norm_all_heads)
        self.qk_norm_all_heads = a.qk_norm_all_heads
        q_dim, k_dim = (self.q_size, self.kv_size) if a.qk_norm_all_heads else (a.head_dim, a.head_dim)
        self.q_norm = RMSNorm(q_dim, spec.norm.eps, spec.norm.offset) if a.qk_norm else None
        self.k_norm = RMSNorm(k_dim, spec.norm.eps, spec.norm.offset) if a.qk_norm else None
        self.rotary = rotary
        self.sinks = nn.Parameter(torch.zeros(a.num_heads)) if a.sinks else None
        self.scale = a.scale if a.scale is not None else (a.query_pre_attn_scalar or a.head_dim) ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        q_rows = self.q_size * (2 if self.output_gate else 1)
        q, k, v = self.qkv_proj(x).split([q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(-1, self.q_size)
        if self.q_norm is not None and self.qk_norm_all_heads:
            q, k = self.q_norm(q.reshape(-1, self.q_size)), self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = paged_attention_op()(q, k, v, kv_cache, self.layer_id, self.scale, self.sinks)   # v: a strided view; backends take it
        o = o.view(-1, self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


class GatedMLP(nn.Module):
    """SwiGLU (silu) or GeGLU (gelu_tanh): down(act(gate(x)) * up(x)); with `mlp.gated` false
    the plain MLP down(act(up(x))) (Nemotron-H: relu2), which has `up_proj` and no gate."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        m = spec.mlp
        self.intermediate_size = m.intermediate_size
        self.gated = m.gated
        if m.gated:
            self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * m.intermediate_size, bias=m.bias)
        else:
            self.up_proj = nn.Linear(spec.hidden_size, m.intermediate_size, bias=m.bias)
        self.down_proj = nn.Linear(m.intermediate_size, spec.hidden_size, bias=m.bias)
        self.act = ACTIVATIONS[m.activation]
        self.activation = m.activation if m.activation in fused.ACTIVATIONS else None   # has a fused kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(self.act(self.up_proj(x)))
        if self.activation is not None and fused.use_kernel(x):
            # prefill chunks on blocked panels: the activation in the GEMM's epilogue
            y = prepack.gate_up_act(self.gate_up_proj, x, fused.ACTIVATIONS[self.activation])
            if y is None:
                y = fused.act_mul(self.gate_up_proj(x), self.activation)
            return self.down_proj(y)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


def residual_scales(spec: ModelSpec, layer: int) -> tuple[float | None, float, float | None, float]:
    """(mixer alpha, mixer beta, mlp alpha, mlp beta) of layer `layer`: sub-block outputs are
    added times beta (Granite's residual_multiplier); alpha, set only with normed-input residuals
    (`spec.residual`, MiniMax), scales the normed input the stream continues from."""
    if spec.residual is None:
        return None, spec.residual_multiplier, None, spec.residual_multiplier
    return (*spec.residual.scales(spec.layer_kinds[layer]), *spec.residual.scales("mlp"))


def delta_multiplier(spec: ModelSpec, layer: int) -> float:
    """What the delta layer `layer` returns (its last sub-block's output) is scaled by when
    the next norm adds it to the residual stream."""
    if spec.norm.sandwich:
        return 1.0
    _, mix_beta, _, mlp_beta = residual_scales(spec, layer)
    return mlp_beta if spec.ffn_kind(layer) != "none" else mix_beta


class DecoderLayer(nn.Module):
    """Pre-norm block: x + mix(norm(x)), then x + mlp(norm(x)).

    The token mixers come from the layer's kinds (models.kinds), each kept under its kind's
    attribute (`self_attn`; `mixer` for state layers) and addressed by its cache id; several
    run in parallel on the same normed input and are summed (Falcon-H1), none leaves an
    MLP-only layer (Nemotron-H), and `mlp` None a mixer-only one. With sandwich norms
    (Gemma 2/3) each sub-block's output is normed too before the residual add:
    x + post_attn_norm(attn(input_norm(x))), then x + post_ffn_norm(mlp(pre_ffn_norm(x))).
    A post-norm layer (`layers.norm_position` post: OLMo 2/3) norms only the outputs:
    x + post_attn_norm(attn(x)), then x + post_ffn_norm(mlp(x)).
    Every residual add runs fused with the norm that follows it (`RMSNorm.add_forward`), vLLM
    style: the block's last add happens in the next layer's first norm (or the final norm)."""

    def __init__(self, spec: ModelSpec, layer_id: int, mixers: list[tuple[LayerKind, int, nn.Module]]):
        """mixers: (kind, cache id, rotary) per token mixer of this layer."""
        super().__init__()
        n = spec.norm
        self.layer_id = layer_id
        self.self_attn = self.mixer = None     # the runtime finds state layers by `mixer`
        self._mixers = []                       # (attribute, kind forward, first cache id, caches)
        for kind, cache_id, rotary in mixers:
            setattr(self, kind.attr, kind.make_mixer(spec, cache_id, rotary))
            self._mixers.append((kind.attr, kind.forward, cache_id, kind.num_caches))
        self.cache_ids = [c + k for _, _, c, n in self._mixers for k in range(n)]
        ffn = spec.ffn_kind(layer_id)
        if ffn == "moe":
            from models.moe import make_moe
            self.mlp = make_moe(spec, layer_id)
        else:
            self.mlp = GatedMLP(spec) if ffn == "mlp" else None
        self.post_norm = spec.post_norm(layer_id)
        if self._mixers and not self.post_norm:
            self.input_layernorm = RMSNorm(spec.hidden_size, n.eps, n.offset)
        if self.mlp is not None:
            self.post_attention_layernorm = RMSNorm(spec.hidden_size, n.eps, n.offset)
        self.sandwich = n.sandwich
        # Each sub-block's output is added times its beta; with normed-input residuals
        # (spec.residual) the stream continues from the normed input times its alpha.
        self.mix_alpha, self.mix_beta, self.mlp_alpha, self.mlp_beta = residual_scales(spec, layer_id)
        self.delta_multiplier = delta_multiplier(spec, layer_id)
        self.in_multiplier = delta_multiplier(spec, layer_id - 1) if layer_id else 1.0
        if n.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, n.eps, n.offset)
        if n.sandwich or self.post_norm:
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, n.eps, n.offset)

    def _mix(self, positions, h, caches):
        out, at = None, 0
        for attr, forward, cache_id, n in self._mixers:     # a mixer of several caches gets a list
            cache = caches[at] if n == 1 else caches[at: at + n]
            at += n
            y = forward(getattr(self, attr), cache_id, positions, h, cache)
            out = y if out is None else out + y
        return out

    @staticmethod
    def _add_norm(norm: RMSNorm, x, residual, multiplier: float, alpha: float | None = None):
        """norm(residual + x * multiplier) and the new residual; with normed-input residuals
        (`alpha` set) the residual carried on is the normed value times alpha."""
        if residual is None:           # the first layer: x is the embeddings
            h, residual = norm(x), x
        else:
            h, residual = norm.add_forward(x, residual, multiplier)
        return (h, residual) if alpha is None else (h, h * alpha)

    def forward(self, positions, x, residual, caches):
        """Returns (delta, residual): the residual stream without this layer's last sub-block
        output, and that output (`delta`). The caller adds `delta * delta_multiplier` in the next
        norm (the next layer's first norm, or the final norm) in one fused pass, as vLLM does.
        The first layer gets the embeddings as `x` and residual None. `caches`: one per mixer."""
        multiplier = self.in_multiplier        # scales x, the previous layer's delta
        if self.post_norm:                     # the sub-blocks read the stream itself, un-normed
            h = x if residual is None else residual + x * multiplier
            x = self.post_attention_layernorm(self._mix(positions, h, caches))
            h = h + x * self.mix_beta if self.mix_beta != 1.0 else h + x
            return self.post_feedforward_layernorm(self.mlp(h)), h
        if self._mixers:
            h, residual = self._add_norm(self.input_layernorm, x, residual, multiplier, self.mix_alpha)
            x = self._mix(positions, h, caches)
            if self.mlp is None:
                return x, residual
            multiplier = self.mix_beta
            if self.sandwich:
                h, residual = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(x), residual)
                return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self._add_norm(self.post_attention_layernorm, x, residual, multiplier, self.mlp_alpha)
        return self.mlp(h), residual
