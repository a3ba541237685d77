"""The `moe:` section of a spec (MoESpec) and its checks; models.spec re-exports MoESpec and
runs `validate_moe` with the spec's `fail` (one line naming the field), models.moe builds
the block from it."""
from __future__ import annotations

from dataclasses import dataclass, field

from models.activations import ACTIVATIONS

MOE_STYLES = ("qwen", "granite")
MOE_SCORINGS = ("softmax", "sigmoid", "topk_softmax", "sqrtsoftplus")
EXPERT_LAYOUTS = ("per_expert", "fused", "fused_transposed")
CLAMPED_SWIGLU = "swiglu_clamped"     # GPT-OSS's expert activation (needs swiglu_alpha / swiglu_limit)
CLAMPED_SILU = "silu_clamped"        # DeepSeek-V4's: silu(min(gate, limit)) * clamp(up, -limit, limit)
# What a `style` fills in for the fields it leaves None (a style is only a preset of these).
_MOE_STYLE_DEFAULTS = {"qwen": {"scoring": "softmax", "shared_expert_gate": True, "expert_layout": "per_expert"},
                       "granite": {"scoring": "topk_softmax", "shared_expert_gate": False, "expert_layout": "fused"}}


@dataclass(slots=True)
class MoESpec:
    """A sparse MoE feed-forward block, declared field by field (models.moe builds one module
    from it for every family): a router picks `num_experts_per_tok` of `num_experts` experts
    per token, their outputs are summed with the router weights, and an optional shared
    expert runs on every token.

    `style` is a preset for the fields left unset: qwen (Qwen3-MoE/Next/3.5) softmax
    scoring and a sigmoid-gated shared expert; granite (GraniteMoeHybrid) top-k-then-softmax,
    an ungated shared MLP and Granite's checkpoint names (models.moe)."""
    num_experts: int                       # routed experts; 0 leaves only the shared expert (dense Granite)
    num_experts_per_tok: int               # top-k
    intermediate_size: int                 # each routed expert's hidden size
    shared_expert_intermediate_size: int = 0   # 0: no shared expert
    norm_topk_prob: bool = True            # renormalise the k weights to sum to 1 (softmax / sigmoid)
    decoder_sparse_step: int = 1           # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: list = field(default_factory=list)   # ... and i is not listed here
    style: str = "qwen"
    # ---- router
    scoring: str | None = None             # softmax: top-k of softmax(logits) (Qwen, MiniMax);
    #   sigmoid: top-k of sigmoid(logits) (DeepSeek-V3, Kimi, Nemotron-H);
    #   topk_softmax: top-k logits, softmax over those k (Granite, GPT-OSS, Mixtral);
    #   sqrtsoftplus: top-k of sqrt(softplus(logits)) (DeepSeek-V4)
    router_bias: bool = False              # router linear has a bias (GPT-OSS)
    selection_bias: bool = False           # e_score_correction_bias: added to the scores to pick experts, not to weight them
    n_group: int = 1                       # group-limited routing: experts in n_group groups, a group ranked by
    topk_group: int = 1                    #   the sum of its 2 best scores, experts picked from the topk_group best
    routed_scaling_factor: float = 1.0     # the k weights times this (after renormalising)
    hash_layers: list = field(default_factory=list)   # layers whose router picks experts from a fixed
    #   token id -> k experts table (`tid2eid`, DeepSeek-V4's hash_moe); the scores still weight them
    router_fp32: bool = False              # router logits, scores and weights in float32 whatever the model dtype
    # ---- routed experts
    activation: str | None = None          # None: mlp.activation; or swiglu_clamped (GPT-OSS), silu_clamped (V4)
    gated: bool = True                     # act(x Wg) * (x Wu); False: act(x Wu) with up_proj only (Nemotron-H relu2)
    swiglu_alpha: float = 1.702            # swiglu_clamped: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    swiglu_limit: float = 7.0              # swiglu_clamped / silu_clamped: the clamp bound
    expert_bias: bool = False              # biases on the expert projections (GPT-OSS)
    expert_layout: str | None = None       # checkpoint: experts.{e}.*_proj.weight, fused [E, out, in] or
    #   fused_transposed [E, in, out] tensors
    gate_up_interleaved: bool = False      # fused checkpoint gate/up alternate along the output dim (GPT-OSS)
    latent_size: int | None = None         # experts run in a latent space: x -> fc1 -> experts -> fc2 (Nemotron-H)
    # ---- shared expert (same activation and gating as the routed experts)
    shared_expert_gate: bool | None = None  # scale the shared expert by sigmoid(x Wsg), Wsg [1, hidden] (Qwen3-Next)
    dense_bias: bool = False               # biases on the shared expert and latent projections (Nemotron-H mlp_bias)

    def __post_init__(self):
        for key, value in _MOE_STYLE_DEFAULTS.get(self.style, _MOE_STYLE_DEFAULTS["qwen"]).items():
            if getattr(self, key) is None:
                setattr(self, key, value)

    def is_moe(self, layer: int) -> bool:
        if self.style == "granite":
            return True
        return self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0 \
            and layer not in self.mlp_only_layers

    def expert_activation(self, mlp_activation: str) -> str:
        return self.activation or mlp_activation


def validate_moe(m: MoESpec, num_layers: int, fail) -> None:
    """The `moe:` section's values and how they fit together; one line naming the field."""
    for where, value, allowed in (("moe.style", m.style, MOE_STYLES), ("moe.scoring", m.scoring, MOE_SCORINGS),
                                  ("moe.expert_layout", m.expert_layout, EXPERT_LAYOUTS),
                                  ("moe.activation", m.activation or "silu", (*ACTIVATIONS, CLAMPED_SWIGLU, CLAMPED_SILU))):
        if value not in allowed:
            fail(where, f"{value!r} is not one of {', '.join(allowed)}")
    for where, value in (("num_experts", m.num_experts), ("shared_expert_intermediate_size",
                                                          m.shared_expert_intermediate_size)):
        if value < 0:
            fail(f"moe.{where}", f"must be >= 0, got {value}")
    if m.num_experts == 0 and m.shared_expert_intermediate_size == 0:
        fail("moe.num_experts", "an MoE block needs routed experts or a shared expert")
    if m.num_experts > 0:
        if not 0 < m.num_experts_per_tok <= m.num_experts:
            fail("moe.num_experts_per_tok", f"must be in [1, num_experts={m.num_experts}], got {m.num_experts_per_tok}")
        if m.intermediate_size <= 0:
            fail("moe.intermediate_size", f"must be > 0, got {m.intermediate_size}")
    if m.decoder_sparse_step < 1:
        fail("moe.decoder_sparse_step", f"must be >= 1, got {m.decoder_sparse_step}")
    for key in ("mlp_only_layers", "hash_layers"):
        for i, layer in enumerate(getattr(m, key)):
            if not isinstance(layer, int) or not 0 <= layer < num_layers:
                fail(f"moe.{key}[{i}]", f"expected a layer index in [0, {num_layers}), got {layer!r}")
    if m.n_group < 1 or (m.num_experts and m.num_experts % m.n_group):
        fail("moe.n_group", f"must be >= 1 and divide num_experts={m.num_experts}, got {m.n_group}")
    if not 1 <= m.topk_group <= m.n_group:
        fail("moe.topk_group", f"must be in [1, n_group={m.n_group}], got {m.topk_group}")
    if m.n_group > 1:
        per_group = m.num_experts // m.n_group
        if per_group < 2:
            fail("moe.n_group", f"groups are ranked by their 2 best experts; {per_group} per group is too few")
        if m.topk_group * per_group < m.num_experts_per_tok:
            fail("moe.topk_group", f"{m.topk_group} groups of {per_group} experts cannot supply "
                                   f"num_experts_per_tok={m.num_experts_per_tok}")
    if m.activation in (CLAMPED_SWIGLU, CLAMPED_SILU):
        if not m.gated:
            fail("moe.activation", f"{m.activation} is a gated activation; it needs gated: true")
        if m.swiglu_limit <= 0:
            fail("moe.swiglu_limit", f"must be > 0, got {m.swiglu_limit}")
    if m.gate_up_interleaved and (m.expert_layout == "per_expert" or not m.gated):
        fail("moe.gate_up_interleaved", "needs fused gated experts (expert_layout fused or fused_transposed, gated: true)")
    if m.latent_size is not None and m.latent_size <= 0:
        fail("moe.latent_size", f"must be > 0, got {m.latent_size}")
