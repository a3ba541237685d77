"""Sparse mixture-of-experts: one module (`MoE`) for every family, configured by the `moe:`
section (models.spec.MoESpec) rather than a class per family.

A block is a router, routed experts and an optional shared expert:

    weights, index = route(x)                      # [T, K] each
    out = sum_k weights[t, k] * expert_{index[t, k]}(x[t])  (+ shared(x), optionally * sigmoid(x Wsg))

Router (`Router`, HF's `gate` / `router`): logits = x W^T (+ b); `scoring` turns them into
scores (softmax, sigmoid, or top-k logits then softmax over those k); an optional selection
bias (DeepSeek's e_score_correction_bias) and group-limited routing (n_group / topk_group)
change which experts are picked but not their weights; weights are renormalised
(`norm_topk_prob`) and scaled (`routed_scaling_factor`). Experts (`FusedExperts`) are gated
MLPs act(x Wg) * (x Wu) (SwiGLU, or GPT-OSS's clamped SwiGLU) or ungated act(x Wu) (Nemotron-H's
relu2), with optional biases; a latent projection may wrap them (Nemotron-H).

Like the rest of `models`, every module works on flattened tokens, [num_tokens, hidden]. Routed
experts are stored fused, as transformers 5 holds them in memory, gate rows before up rows:

    experts.gate_up_proj  [E, 2 * I, in]     (ungated: experts.up_proj [E, I, in])
    experts.down_proj     [E, in, I]         in = hidden (or latent_size)

Checkpoints store them per expert (`experts.{e}.gate_proj.weight`: what transformers 5's
save_pretrained writes for Qwen3-MoE, DeepSeek-V3, Kimi, MiniMax, Nemotron-H), fused
(Granite) or fused transposed with gate/up interleaved (GPT-OSS); `moe_sources` names them
for the loader, which transposes / de-interleaves on the way in (models.loader.TRANSFORMS).

How each family's block is declared (`moe:` fields; `weight_names` keys; tests/test_moe.py
pins each against its HF block and saved checkpoint):

    qwen3_moe      defaults (softmax; norm_topk_prob from config; no shared expert)
    qwen3_next,    shared_expert_intermediate_size (sigmoid-gated shared expert, the default)
    qwen3_5_moe    (3.5 always renormalises: norm_topk_prob: true, the default)
    deepseek_v3    scoring: sigmoid, selection_bias, router_fp32, n_group, topk_group,
                   routed_scaling_factor, shared_expert_gate: false (moe_from_hf infers it from
                   n_shared_experts); moe_shared: shared_experts
    kimi_linear    as deepseek_v3; moe: block_sparse_moe, moe_expert_gate/up/down: w1/w3/w2
    nemotron_h     as deepseek_v3 plus gated: false, activation: relu2 (latent_size, dense_bias
                   from moe_latent_size, mlp_bias); layer: backbone.layers.{i}., moe: mixer
    minimax        defaults; moe: block_sparse_moe, moe_expert_gate/up/down: w1/w3/w2
    gpt_oss        scoring: topk_softmax, router_bias, expert_bias, activation: swiglu_clamped
                   (swiglu_alpha/limit), expert_layout: fused_transposed, gate_up_interleaved;
                   moe_router: router
    granite        style: granite (top-k softmax, fused Granite names, ungated shared MLP); moe: ""

Compute: (token, slot) pairs are sorted by expert, gathered once, each expert that received
tokens runs two matmuls on its contiguous slice, and the weighted results are scattered back
with one index_add_: no Python loop over tokens; the loop over experts skips empty ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models import activations
from models.kinds import linear_sources
from models.moe_spec import CLAMPED_SILU, CLAMPED_SWIGLU, MoESpec

if TYPE_CHECKING:
    from models.spec import ModelSpec

# Checkpoint names a `style` presets (under weight_names' keys; see models.spec.DEFAULT_WEIGHT_NAMES).
STYLE_NAMES = {
    "qwen": {},
    "granite": {"moe_router": "block_sparse_moe.router.layer", "moe_experts": "block_sparse_moe",
                "moe_expert_gate_up": "input_linear.weight", "moe_expert_down": "output_linear.weight",
                "moe_shared": "shared_mlp", "moe_shared_gate_up": "input_linear", "moe_shared_down": "output_linear"},
}


def expert_act(h: torch.Tensor, activation: str, gated: bool, alpha: float, limit: float) -> torch.Tensor:
    """The expert nonlinearity on the first projection's output `h` ([.., 2I] gated: gate then
    up; [.., I] ungated)."""
    if not gated:
        return activations.activation(activation)(h)
    gate, up = h.chunk(2, dim=-1)
    if activation == CLAMPED_SWIGLU:     # GPT-OSS: clamp both halves, gate * sigmoid(alpha * gate), up + 1
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if activation == CLAMPED_SILU:       # DeepSeek-V4: silu of the gate capped above, up clamped both ways
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    return activations.activation(activation)(gate) * up


@torch.library.custom_op("zooinfer::fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  w_in: torch.Tensor, w_out: torch.Tensor, b_in: torch.Tensor | None, b_out: torch.Tensor | None,
                  activation: str, gated: bool, alpha: float, limit: float) -> torch.Tensor:
    """sum_k w[t, k] * expert_k(x[t]) with expert e = (act(x w_in[e]^T + b_in[e])) w_out[e]^T + b_out[e].
    A custom op because the per-expert token counts are data (a host sync and a loop whose trip
    count depends on the routing), which torch.compile cannot trace with fullgraph=True; as an
    opaque op the rest of the MoE block compiles."""
    out = torch.zeros_like(x)
    num_tokens, top_k = top_k_index.shape
    if num_tokens == 0:
        return out
    flat_expert = top_k_index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)             # (token, slot) pairs grouped by expert
    token_idx = torch.div(order, top_k, rounding_mode="floor")
    weights = top_k_weights.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat_expert, minlength=w_in.shape[0]).tolist()
    x_sorted = x.index_select(0, token_idx)
    y_sorted = torch.empty(x_sorted.shape[0], w_out.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        h = F.linear(x_sorted[start:end], w_in[e], None if b_in is None else b_in[e])
        h = expert_act(h, activation, gated, alpha, limit)
        y_sorted[start:end] = F.linear(h, w_out[e], None if b_out is None else b_out[e])
        start = end
    y_sorted = y_sorted * weights.unsqueeze(-1)
    return out.index_add_(0, token_idx, y_sorted.to(out.dtype))


@fused_experts.register_fake
def _(x, top_k_index, top_k_weights, w_in, w_out, b_in, b_out, activation, gated, alpha, limit):
    return torch.empty_like(x)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


class FusedExperts(nn.Module):
    """`num_experts` MLPs over [T, in] with fused 3-D weights (see the module docstring)."""

    def __init__(self, num_experts: int, in_size: int, intermediate_size: int, activation: str = "silu",
                 gated: bool = True, bias: bool = False, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.num_experts, self.in_size, self.intermediate_size = num_experts, in_size, intermediate_size
        self.activation, self.gated, self.alpha, self.limit = activation, gated, alpha, limit
        self.w_in_name = "gate_up_proj" if gated else "up_proj"
        rows = (2 if gated else 1) * intermediate_size
        setattr(self, self.w_in_name, _param(num_experts, rows, in_size))
        self.down_proj = _param(num_experts, in_size, intermediate_size)
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        if bias:
            setattr(self, self.w_in_name + "_bias", _param(num_experts, rows))
            self.down_proj_bias = _param(num_experts, in_size)
        self.has_bias = bias

    @property
    def w_in(self) -> torch.Tensor:
        return getattr(self, self.w_in_name)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x [T, in]; top_k_index [T, K] (int); top_k_weights [T, K] -> sum_k w[t, k] * expert_k(x[t])."""
        b_in = getattr(self, self.w_in_name + "_bias") if self.has_bias else None
        b_out = self.down_proj_bias if self.has_bias else None
        return torch.ops.zooinfer.fused_experts(x, top_k_index, top_k_weights, self.w_in, self.down_proj,
                                                b_in, b_out, self.activation, self.gated, self.alpha, self.limit)


class SharedExpert(nn.Module):
    """A dense MLP with the routed experts' nonlinearity: gate_up_proj (gated) or up_proj, down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, gated: bool, bias: bool,
                 alpha: float, limit: float):
        super().__init__()
        self.activation, self.gated, self.alpha, self.limit = activation, gated, alpha, limit
        rows = (2 if gated else 1) * intermediate_size
        if gated:
            self.gate_up_proj = nn.Linear(hidden_size, rows, bias=bias)
        else:
            self.up_proj = nn.Linear(hidden_size, rows, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (self.gate_up_proj if self.gated else self.up_proj)(x)
        return self.down_proj(expert_act(h, self.activation, self.gated, self.alpha, self.limit))


class Router(nn.Module):
    """Picks each token's experts and their weights (see the module docstring).

    Parameters: weight [E, hidden]; bias [E] (router_bias); e_score_correction_bias [E]
    (selection_bias, float32 always, as DeepSeek keeps it). A hash router (`vocab_size` given:
    DeepSeek-V4's hash_moe layers) picks each token's experts from `tid2eid` [vocab, K] (int64,
    from the checkpoint) by its token id instead of by score; the scores still weight them."""

    def __init__(self, hidden_size: int, m: MoESpec, vocab_size: int | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k = m.num_experts, m.num_experts_per_tok
        self.scoring, self.norm_topk_prob, self.scale = m.scoring, m.norm_topk_prob, m.routed_scaling_factor
        self.n_group, self.topk_group, self.fp32 = m.n_group, m.topk_group, m.router_fp32
        self.weight = _param(m.num_experts, hidden_size)
        self.bias = _param(m.num_experts) if m.router_bias else None
        self.hashed = vocab_size is not None
        self.e_score_correction_bias = _param(m.num_experts) if m.selection_bias and not self.hashed else None
        self.tid2eid = nn.Parameter(torch.zeros(vocab_size, self.top_k, dtype=torch.long),
                                    requires_grad=False) if self.hashed else None
        # build_model leaves these in float32 whatever the model dtype (HF keeps them so too)
        self.fp32_params = (("weight", "bias") if m.router_fp32 else ()) + ("e_score_correction_bias",)

    def _pick(self, choice: torch.Tensor) -> torch.Tensor:
        """Top-k indices of the selection scores, within the topk_group best groups."""
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
            choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice), float("-inf"))
        # sigmoid / sqrtsoftplus routers take an unsorted top-k, as DeepSeek does, so slot order matches too
        return torch.topk(choice, k=self.top_k, dim=-1, sorted=self.scoring not in ("sigmoid", "sqrtsoftplus"))[1]

    @torch.no_grad()
    def init_dummy_(self, gen: torch.Generator) -> None:
        """Dummy weights: a hash table of K distinct experts per token (seeded), not random normals."""
        if self.hashed:
            table = torch.rand(self.tid2eid.shape[0], self.num_experts, generator=gen).argsort(dim=-1)
            self.tid2eid.copy_(table[:, :self.top_k])

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (and the tokens' ids [T] for a hash router) -> (top_k_weights [T, K],
        top_k_index [T, K]); weights in x.dtype, or float32 with router_fp32."""
        if self.fp32:
            bias = None if self.bias is None else self.bias.float()
            logits = F.linear(x.float(), self.weight.float(), bias)
        else:
            logits = F.linear(x, self.weight, self.bias)
        if self.scoring == "topk_softmax":
            scores = logits.float()
        elif self.scoring == "sigmoid":
            scores = logits.float().sigmoid()
        elif self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits.float()).sqrt()
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.hashed:
            index = self.tid2eid[token_ids]
        else:
            choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
            index = self._pick(choice)
        weights = scores.gather(1, index)
        if self.scoring == "topk_softmax":
            weights = torch.softmax(weights, dim=-1)
        elif self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        return (weights if self.fp32 else weights.to(x.dtype)), index


class MoE(nn.Module):
    """An MoE feed-forward block built from a MoESpec (see the module docstring).

    Submodules: gate (Router; None without routed experts), experts (FusedExperts), latent_in /
    latent_out (latent_size), shared_expert (SharedExpert), shared_expert_gate ([1, hidden])."""

    def __init__(self, hidden_size: int, m: MoESpec, mlp_activation: str = "silu", vocab_size: int | None = None):
        """vocab_size: set for a hash-routed block (its router's token id table)."""
        super().__init__()
        act = m.expert_activation(mlp_activation)
        common = dict(activation=act, gated=m.gated, alpha=m.swiglu_alpha, limit=m.swiglu_limit)
        self.gate = self.experts = self.latent_in = self.latent_out = None
        self.shared_expert = self.shared_expert_gate = None
        if m.num_experts > 0:
            self.gate = Router(hidden_size, m, vocab_size)
            in_size = m.latent_size or hidden_size
            self.experts = FusedExperts(m.num_experts, in_size, m.intermediate_size, bias=m.expert_bias, **common)
            if m.latent_size:
                self.latent_in = nn.Linear(hidden_size, m.latent_size, bias=m.dense_bias)
                self.latent_out = nn.Linear(m.latent_size, hidden_size, bias=m.dense_bias)
        if m.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, m.shared_expert_intermediate_size, bias=m.dense_bias,
                                              **common)
            if m.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)

    @property
    def hashed(self) -> bool:
        """Routed by token id (its forward needs the tokens' ids)."""
        return self.gate is not None and self.gate.hashed

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        out = None
        if self.experts is not None:
            weights, index = self.gate(x, token_ids)
            h = x if self.latent_in is None else self.latent_in(x)
            out = self.experts(h, index, weights)
            if self.latent_out is not None:
                out = self.latent_out(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = shared if out is None else out + shared
        return out


def make_moe(spec: ModelSpec, layer_id: int) -> MoE:
    """The MoE block of an MoE layer (`moe:` section); hash-routed on `moe.hash_layers`."""
    hashed = layer_id in spec.moe.hash_layers
    return MoE(spec.hidden_size, spec.moe, spec.mlp.activation, spec.vocab_size if hashed else None)


def moe_names(spec: ModelSpec) -> dict[str, str]:
    """The checkpoint names of an MoE block's parts: weight_names' defaults, the style's preset,
    then the spec's own weight_names."""
    from models.spec import DEFAULT_WEIGHT_NAMES
    names = {k: v for k, v in DEFAULT_WEIGHT_NAMES.items() if k.startswith("moe_")}
    return {**names, **STYLE_NAMES.get(spec.moe.style, {}),
            **{k: v for k, v in spec.weight_names.items() if k.startswith("moe_")}}


def _expert_sources(m: MoESpec, n: dict[str, str], ours: str, ex: str, in_size: int) -> dict[str, list[tuple]]:
    """Routed experts: per expert tensors stacked into the fused params (viewed 2-D: gate_up
    [E, 2I, in] as [E*2I, in], expert e's gate rows at e*2I, up rows at e*2I + I), or fused
    tensors whole, transposed / de-interleaved by the loader."""
    E, I = m.num_experts, m.intermediate_size
    w_in = "gate_up_proj" if m.gated else "up_proj"
    suffixes = (".weight",) + ((".bias",) if m.expert_bias else ())
    src: dict[str, list[tuple]] = {}
    if m.expert_layout == "per_expert":
        parts = [n["moe_expert_gate"], n["moe_expert_up"]] if m.gated else [n["moe_expert_up"]]
        rows = len(parts) * I
        for sfx, our_sfx in zip(suffixes, ("", "_bias")):
            src[f"{ours}experts.{w_in}{our_sfx}"] = [(f"{ex}{e}.{p}{sfx}", e * rows + k * I, I)
                                                    for e in range(E) for k, p in enumerate(parts)]
            src[f"{ours}experts.down_proj{our_sfx}"] = [(f"{ex}{e}.{n['moe_expert_down']}{sfx}", e * in_size, in_size)
                                                       for e in range(E)]
        return src
    name_in = n["moe_expert_gate_up"] if m.gated else n["moe_expert_up"]
    t = ("transpose",) if m.expert_layout == "fused_transposed" else ()
    # gpt-oss: gate/up alternate along the output dim: the last dim when transposed, else dim -2
    inter = () if not m.gate_up_interleaved else (
        ("deinterleave",) if t else ("transpose", "deinterleave", "transpose"))
    src[f"{ours}experts.{w_in}"] = [(ex + name_in, 0, E, inter + t)]
    src[f"{ours}experts.down_proj"] = [(ex + n["moe_expert_down"], 0, E, t)]
    if m.expert_bias:
        src[f"{ours}experts.{w_in}_bias"] = [(ex + name_in + "_bias", 0, E, ("deinterleave",) if inter else ())]
        src[f"{ours}experts.down_proj_bias"] = [(ex + n["moe_expert_down"] + "_bias", 0, E)]
    return src


def moe_sources(spec: ModelSpec, ours: str, hf: str, layer: int = -1) -> dict[str, list[tuple]]:
    """Our MoE params (prefix `ours`) -> checkpoint tensors (prefix `hf`, the block's), as
    models.builder's weight_sources: [(name, row offset, rows[, loader transforms])]; `layer`
    tells whether the block is hash-routed (a token id table instead of a selection bias)."""
    m, H, n = spec.moe, spec.hidden_size, moe_names(spec)
    E, S = m.num_experts, m.shared_expert_intermediate_size
    src: dict[str, list[tuple]] = {}
    if E:
        router = hf + n["moe_router"]
        src[ours + "gate.weight"] = [(router + ".weight", 0, E)]
        if m.router_bias:
            src[ours + "gate.bias"] = [(router + ".bias", 0, E)]
        if layer in m.hash_layers:
            src[ours + "gate.tid2eid"] = [(f"{router}.{n['moe_router_table']}", 0, spec.vocab_size)]
        elif m.selection_bias:
            src[ours + "gate.e_score_correction_bias"] = [(f"{router}.{n['moe_router_selection_bias']}", 0, E)]
        ex = hf + (n["moe_experts"] + "." if n["moe_experts"] else "")
        src.update(_expert_sources(m, n, ours, ex, m.latent_size or H))
        if m.latent_size:
            src.update(linear_sources(ours + "latent_in", hf, [(n["moe_latent_in"], 0, m.latent_size)], m.dense_bias))
            src.update(linear_sources(ours + "latent_out", hf, [(n["moe_latent_out"], 0, H)], m.dense_bias))
    if S:
        sh = hf + n["moe_shared"] + "."
        if not m.gated:
            parts, ours_in = [(n["moe_shared_up"], 0, S)], "up_proj"
        elif n["moe_shared_gate_up"]:
            parts, ours_in = [(n["moe_shared_gate_up"], 0, 2 * S)], "gate_up_proj"
        else:
            parts, ours_in = [(n["moe_shared_gate"], 0, S), (n["moe_shared_up"], S, S)], "gate_up_proj"
        src.update(linear_sources(f"{ours}shared_expert.{ours_in}", sh, parts, m.dense_bias))
        src.update(linear_sources(f"{ours}shared_expert.down_proj", sh, [(n["moe_shared_down"], 0, H)], m.dense_bias))
        if m.shared_expert_gate:
            src[ours + "shared_expert_gate.weight"] = [(hf + n["moe_shared_expert_gate"] + ".weight", 0, 1)]
    return src
