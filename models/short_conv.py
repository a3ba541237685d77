"""LFM2's short convolution (HF `Lfm2ShortConv`) for the paged, continuously-batched engine.

    B, C, x = in_proj(h).chunk(3)          # [T, hidden] each
    y = C * causal_depthwise_conv(B * x)   # kernel L_cache, no activation
    out = out_proj(y)

There is no recurrence: the only state is the conv's, the last `L_cache - 1` gated inputs
`B * x` per request (`[hidden, L_cache - 1]`, oldest first), kept in pool pages like Mamba2's
and Gated DeltaNet's conv tails, so prefix caching, forks and preemption treat it as any other
state. The conv (models.causal_conv) is one vectorised step on decode-only steps and one
gather per tap over every token otherwise (chunks continue from the stored tail); it runs
inside the `zooinfer::state_update` op, the projections and gates in the compiled graph.

Parameter names and shapes equal HF's (`in_proj`, `conv`, `out_proj`, biases iff conv_bias),
so the layer's checkpoint tensors load 1:1.
"""
from __future__ import annotations

import torch
from torch import nn

import attention.ops  # noqa: F401  (registers zooinfer::state_update, used by forward_paged)
from attention.state import StateMetadata
from models.causal_conv import causal_conv, step_conv_plan


class ShortConv(nn.Module):
    """in_proj -> (B, C, x); y = C * conv(B * x); out_proj. Arguments mirror HF's Lfm2Config:
    hidden_size, conv_L_cache (the kernel), conv_bias (on in_proj, conv and out_proj)."""

    def __init__(self, hidden_size: int, kernel: int = 3, bias: bool = False):
        super().__init__()
        if kernel < 2:
            raise ValueError(f"conv_L_cache must be >= 2, got {kernel}")
        self.hidden_size, self.kernel = hidden_size, kernel
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel, groups=hidden_size, bias=bias,
                              padding=kernel - 1)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request state: conv (hidden, L_cache - 1), the last gated inputs B * x."""
        return {"conv": (self.hidden_size, self.kernel - 1)}

    def _gates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (B * x, C), each [T, hidden]."""
        B, C, x = self.in_proj(hidden).chunk(3, dim=-1)
        return B * x, C

    def _finish(self, conv_out: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        return self.out_proj(C * conv_out.to(C.dtype))

    def forward(self, hidden: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden] with the conv states in slots (`meta.slots`),
        updated in place (the eager, slot-based form; the engine uses `forward_paged`)."""
        bx, C = self._gates(hidden)
        return self._finish(causal_conv(bx, conv_state, meta, self.conv.weight[:, 0], self.conv.bias), C)

    def forward_paged(self, hidden: torch.Tensor, pages: torch.Tensor, layer_id: int) -> torch.Tensor:
        """States in pool pages: the conv runs in the `zooinfer::state_update` op."""
        bx, C = self._gates(hidden)
        conv_out = torch.ops.zooinfer.state_update([bx], pages, layer_id, [self.hidden_size])
        return self._finish(conv_out, C)

    def update_states(self, inputs: list[torch.Tensor], states: list[torch.Tensor], plan) -> torch.Tensor:
        """`zooinfer::state_update` body: inputs (B * x,), states (conv,), the group's ConvPlan
        shared through the StatePlan."""
        (bx,), (conv_state,) = inputs, states
        return causal_conv(bx, conv_state, plan.meta, self.conv.weight[:, 0], self.conv.bias,
                           step_conv_plan(plan, self.kernel))
