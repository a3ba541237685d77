"""Sparse mixture-of-experts blocks: Qwen3-Next (`SparseMoE`) and GraniteMoeHybrid (`GraniteMoE`,
`GraniteSharedMLP`, `GraniteMoEBlock`).

Like the rest of `models`, every module works on flattened tokens, [num_tokens, hidden], with no
batch axis. Parameter names and shapes mirror transformers 5 so a block's HF state_dict loads
1:1 (`load_state_dict(hf_block.state_dict())`). transformers 5 stores the routed experts fused
as 3-D tensors, not as per-expert nn.Linear modules:

    experts.gate_up_proj  [num_experts, 2 * intermediate, hidden]   rows: gate first, then up
    experts.down_proj     [num_experts, hidden, intermediate]

(its checkpoint converter builds these from per-expert `experts.{e}.gate_proj/up_proj/down_proj`
weights for Qwen3-Next, and renames Granite's `input_linear`/`output_linear`/`router.layer`).

Compute: the router picks top-k experts per token; the (token, slot) pairs are sorted by expert,
gathered once with index_select, each expert that received tokens runs two matmuls on its
contiguous slice, and the weighted results are scattered back with a single index_add_. There is
no Python loop over tokens; the loop over experts only visits experts that got tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from models import activations  # engine names and HF `hidden_act` spellings

if TYPE_CHECKING:
    from models.spec import ModelSpec

def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)



def _init_router_sizes(module: nn.Module, hidden_size: int, num_experts: int, top_k: int) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
    module.hidden_size = hidden_size
    module.num_experts = num_experts
    module.top_k = top_k

@torch.library.custom_op("zooinfer::fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str) -> torch.Tensor:
    """sum_k w[t, k] * expert_k(x[t]). A custom op because the per-expert token counts are
    data (a host sync and a loop whose trip count depends on the routing), which torch.compile
    cannot trace with fullgraph=True; as an opaque op the rest of the MoE block compiles."""
    out = torch.zeros_like(x)
    num_tokens, top_k = top_k_index.shape
    if num_tokens == 0:
        return out
    act = activations.activation(activation)
    flat_expert = top_k_index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)             # (token, slot) pairs grouped by expert
    token_idx = torch.div(order, top_k, rounding_mode="floor")
    weights = top_k_weights.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat_expert, minlength=gate_up_proj.shape[0]).tolist()
    x_sorted = x.index_select(0, token_idx)
    y_sorted = torch.empty_like(x_sorted)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        gate, up = F.linear(x_sorted[start:end], gate_up_proj[e]).chunk(2, dim=-1)
        y_sorted[start:end] = F.linear(act(gate) * up, down_proj[e])
        start = end
    y_sorted = y_sorted * weights.unsqueeze(-1)
    return out.index_add_(0, token_idx, y_sorted.to(out.dtype))


@fused_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
    return torch.empty_like(x)


class FusedExperts(nn.Module):
    """`num_experts` gated MLPs (act(x Wg^T) * x Wu^T) Wd^T with HF's fused 3-D weight layout."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu"):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.activation = activation
        self.act = activations.activation(activation)
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; top_k_index [T, K] (int); top_k_weights [T, K] -> sum_k w[t, k] * expert_k(x[t])."""
        return torch.ops.zooinfer.fused_experts(x, top_k_index, top_k_weights, self.gate_up_proj,
                                                self.down_proj, self.activation)


class GatedMLP(nn.Module):
    """Qwen-style gated MLP with separate projections: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = activations.activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Qwen3-Next sparse MoE block (`Qwen3NextSparseMoeBlock`).

    out = sum_{e in topk(softmax(gate(x)))} p_e * expert_e(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    where p is the top-k softmax probabilities, renormalised to sum to 1 when `norm_topk_prob`.

    Parameters (HF names):
        gate.weight                          [num_experts, hidden]
        experts.gate_up_proj                 [num_experts, 2 * moe_intermediate_size, hidden]
        experts.down_proj                    [num_experts, hidden, moe_intermediate_size]
        shared_expert.{gate,up}_proj.weight  [shared_expert_intermediate_size, hidden]
        shared_expert.down_proj.weight       [hidden, shared_expert_intermediate_size]
        shared_expert_gate.weight            [1, hidden]
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, shared_expert_intermediate_size: int,
                 num_experts: int, num_experts_per_tok: int, norm_topk_prob: bool = True,
                 activation: str = "silu"):
        super().__init__()
        _init_router_sizes(self, hidden_size, num_experts, num_experts_per_tok)
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, moe_intermediate_size, activation)
        self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, activation)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    @classmethod
    def from_config(cls, config: Any) -> "SparseMoE":
        """From a Qwen3NextConfig or its config.json dict."""
        return cls(hidden_size=_cfg(config, "hidden_size"),
                   moe_intermediate_size=_cfg(config, "moe_intermediate_size"),
                   shared_expert_intermediate_size=_cfg(config, "shared_expert_intermediate_size"),
                   num_experts=_cfg(config, "num_experts"),
                   num_experts_per_tok=_cfg(config, "num_experts_per_tok"),
                   norm_topk_prob=bool(_cfg(config, "norm_topk_prob", True)),
                   activation=_cfg(config, "hidden_act", "silu"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (top_k_weights [T, K] in x.dtype, top_k_index [T, K])."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.route(x)
        routed = self.experts(x, index, weights)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


class GraniteMoE(nn.Module):
    """GraniteMoeHybrid's routed experts (`GraniteMoeHybridMoE`, the layer's `block_sparse_moe`).

    Router: top-k over the raw logits, then softmax over those k logits (computed in float32).
    That equals Qwen's top-k-of-softmax with renormalisation, i.e. norm_topk_prob=True. No shared
    expert inside and no sigmoid gate: Granite's shared MLP lives next to this block on the decoder
    layer (see `GraniteSharedMLP`, `GraniteMoEBlock`).

    Parameters (HF names):
        router.weight          [num_local_experts, hidden]
        experts.gate_up_proj   [num_local_experts, 2 * intermediate_size, hidden]
        experts.down_proj      [num_local_experts, hidden, intermediate_size]
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, num_experts_per_tok: int,
                 activation: str = "silu"):
        super().__init__()
        _init_router_sizes(self, hidden_size, num_experts, num_experts_per_tok)
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, activation)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(x).float()
        top_logits, index = logits.topk(self.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1).to(x.dtype), index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.route(x)
        return self.experts(x, index, weights)


class GraniteSharedMLP(nn.Module):
    """`GraniteMoeHybridMLP` (the layer's `shared_mlp`): fused input projection, chunk(2) = (gate, up).

    Parameters: input_linear.weight [2 * shared_intermediate_size, hidden],
                output_linear.weight [hidden, shared_intermediate_size]
    """

    def __init__(self, hidden_size: int, shared_intermediate_size: int, activation: str = "silu"):
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * shared_intermediate_size, bias=False)
        self.output_linear = nn.Linear(shared_intermediate_size, hidden_size, bias=False)
        self.act = activations.activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class GraniteMoEBlock(nn.Module):
    """The feed-forward half of a GraniteMoeHybrid decoder layer: block_sparse_moe(x) + shared_mlp(x).

    With num_local_experts == 0 (dense Granite 4 variants) HF builds no `block_sparse_moe` and the
    layer is just the dense `shared_mlp`; here `block_sparse_moe` is then None. Submodule names
    equal the decoder layer's, so `decoder_layer.state_dict()` entries under `block_sparse_moe.` and
    `shared_mlp.` load unchanged. (residual_multiplier and the norms stay with the decoder layer.)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, shared_intermediate_size: int,
                 num_local_experts: int, num_experts_per_tok: int, activation: str = "silu"):
        super().__init__()
        self.block_sparse_moe = (
            GraniteMoE(hidden_size, intermediate_size, num_local_experts, num_experts_per_tok, activation)
            if num_local_experts > 0 else None)
        self.shared_mlp = GraniteSharedMLP(hidden_size, shared_intermediate_size, activation)

    @classmethod
    def from_config(cls, config: Any) -> "GraniteMoEBlock":
        """From a GraniteMoeHybridConfig or its config.json dict."""
        return cls(hidden_size=_cfg(config, "hidden_size"),
                   intermediate_size=_cfg(config, "intermediate_size"),
                   shared_intermediate_size=_cfg(config, "shared_intermediate_size"),
                   num_local_experts=_cfg(config, "num_local_experts", 0) or 0,
                   num_experts_per_tok=_cfg(config, "num_experts_per_tok", 0) or 0,
                   activation=_cfg(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_mlp(x)
        if self.block_sparse_moe is None:
            return shared
        return self.block_sparse_moe(x) + shared


def make_moe(spec: ModelSpec, layer_id: int) -> nn.Module:
    """The MoE block of an MoE layer (`moe:` section)."""
    m = spec.moe
    if m.style == "granite":
        return GraniteMoEBlock(spec.hidden_size, m.intermediate_size, m.shared_expert_intermediate_size,
                               m.num_experts, m.num_experts_per_tok, spec.mlp.activation)
    return SparseMoE(spec.hidden_size, m.intermediate_size, m.shared_expert_intermediate_size,
                     m.num_experts, m.num_experts_per_tok, m.norm_topk_prob, spec.mlp.activation)


def moe_sources(spec: ModelSpec, ours: str, hf: str) -> dict[str, list[tuple[str, int, int]]]:
    """Per-expert checkpoint tensors into the fused expert params, viewed 2-D:
    gate_up [E, 2I, H] as [E*2I, H] (expert e: gate rows e*2I.., up rows e*2I+I..),
    down [E, H, I] as [E*H, I]."""
    m, H = spec.moe, spec.hidden_size
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
