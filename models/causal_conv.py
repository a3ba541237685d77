"""The causal depthwise conv every state layer runs (Mamba2, Gated DeltaNet, LFM2's short conv),
over the engine's flattened tokens with a stored tail per request.

A layer keeps, per request, the last `K - 1` conv *inputs* (oldest first) in a conv state
`[num_slots, channels, K - 1]`; the next chunk's conv then runs as if the whole sequence were
one. `has_initial_state == False` (a request's first chunk) reads the tail as zeros whatever the
slot holds, so slots never need clearing. Both paths compute in float32, store the new tails
in the state's dtype, and return the conv output before any activation (the caller's).

- `conv_step`: one token per request, vectorised over requests (decode).
- `conv_varlen`: any mix of chunk lengths in one step, no loop over requests or tokens: each
  of the K taps is one gather from "stored tails ++ this step's tokens" (`ConvPlan`, built once
  per step on the host and shared by every layer with the same kernel size).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.state import StateMetadata


@dataclass(slots=True)
class ConvPlan:
    """Per-step gather indices of `conv_varlen` for one kernel size. Rows index
    `cat(tails [R*(K-1)], tokens [T])`: request r's stored tail column e is row r*(K-1) + e,
    token t is row R*(K-1) + t."""
    conv_idx: torch.Tensor      # [K, T]: the row each token reads at each tap
    tail_idx: torch.Tensor      # [R*(K-1)]: the rows that become each request's new tail

    @staticmethod
    def build(meta: StateMetadata, kernel: int, device: torch.device | str | None = None) -> "ConvPlan":
        device = meta.slots.device if device is None else device
        qsl = meta.query_start_loc
        R, T, km1 = len(qsl) - 1, qsl[-1], kernel - 1
        starts = torch.tensor(qsl[:-1], dtype=torch.long)
        lens = torch.tensor(qsl[1:], dtype=torch.long) - starts
        req = torch.repeat_interleave(torch.arange(R), lens, output_size=T)
        pos = torch.arange(T) - starts[req]

        # Request r's extended sequence: its K-1 tail columns, then its tokens.
        def ext_row(r, e, s):
            return torch.where(e < km1, r * km1 + e, R * km1 + s + e - km1)

        conv_idx = torch.stack([ext_row(req, pos + k, starts[req]) for k in range(kernel)])
        jr = torch.arange(R).repeat_interleave(km1)
        jj = torch.arange(km1).repeat(R)
        tail_idx = ext_row(jr, lens[jr] + jj, starts[jr])
        return ConvPlan(conv_idx.to(device, non_blocking=True), tail_idx.to(device, non_blocking=True))


def _tails(conv_state: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
    tails = conv_state[slots]                                           # [R, C, K-1]
    return torch.where(has_init[:, None, None], tails, torch.zeros((), dtype=tails.dtype, device=tails.device))


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor,
              weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One token per request: x [R, C], weight [C, K] -> [R, C] float32; window = stored tail
    ++ token, whose last K-1 columns become the new tail."""
    window = torch.cat([_tails(conv_state, slots, has_init), x.to(conv_state.dtype)[:, :, None]], dim=-1)
    conv_state[slots] = window[:, :, 1:]
    out = (window.float() * weight.float()).sum(-1)
    return out if bias is None else out + bias.float()


def conv_varlen(x: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata, plan: ConvPlan,
                weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Every request's tokens of the step (x [T, C], request i in slot meta.slots[i]), each
    prefixed by its stored tail -> [T, C] float32; writes the new tails."""
    R, C, km1 = meta.num_reqs, x.shape[1], weight.shape[1] - 1
    tails = _tails(conv_state, meta.slots, meta.has_initial_state)
    src = torch.cat([tails.transpose(1, 2).reshape(R * km1, C), x.to(conv_state.dtype)], dim=0)
    conv_state[meta.slots] = src[plan.tail_idx].view(R, km1, C).transpose(1, 2)
    w = weight.float()
    out = src[plan.conv_idx[0]].float() * w[:, 0]
    for k in range(1, km1 + 1):    # over the K taps, never over tokens
        out = out + src[plan.conv_idx[k]].float() * w[:, k]
    return out if bias is None else out + bias.float()


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata, weight: torch.Tensor,
                bias: torch.Tensor | None = None, plan: ConvPlan | None = None) -> torch.Tensor:
    """The step's conv on either path: `conv_step` when every request has one token, else
    `conv_varlen` (building its plan unless given)."""
    if meta.all_decode:
        return conv_step(x, conv_state, meta.slots, meta.has_initial_state, weight, bias)
    return conv_varlen(x, conv_state, meta, plan or ConvPlan.build(meta, weight.shape[1]), weight, bias)


def step_conv_plan(plan, kernel: int) -> ConvPlan | None:
    """The ConvPlan of a `StatePlan`'s step for `kernel`, built by the first layer that asks and
    shared by the rest of the group; None on all-decode steps (which need none)."""
    if plan.meta.all_decode:
        return None
    return plan.derive(("causal_conv", kernel), lambda meta: ConvPlan.build(meta, kernel))
