"""Mamba2 mixer for the paged, continuously-batched engine.

The engine packs the scheduled tokens of every request into one `[num_tokens, hidden]` row
(no batch axis). A step can mix prefill chunks (many tokens, maybe a later chunk of a long
prompt) and decodes (one token). Each request's recurrent state lives in a slot of two
per-layer tensors, updated in place:

- conv state `[num_slots, conv_dim, conv_kernel - 1]`: the last `conv_kernel - 1` *inputs*
  of the causal depthwise conv (pre-conv xBC columns, oldest first), zero-padded on the left
  while a request has seen fewer tokens. `conv_dim = intermediate_size + 2 * n_groups *
  state_size` (the x, B and C channels that go through the conv).
- ssm state `[num_slots, num_heads, head_dim, state_size]`: the SSD recurrent state h, with
  h_t = exp(dt_t * A) h_{t-1} + dt_t * x_t B_t^T and y_t = h_t C_t + D x_t.

The maths is HF's Mamba2 / Bamba / GraniteMoeHybrid `torch_forward` (the segment-sum
chunked SSD algorithm, `mamba2_chunk_scan`) with an initial state, and the recurrent update
(`mamba2_selective_state_update`) for single tokens. Parameter names and shapes match
HF's `BambaMixer`, `GraniteMoeHybridMambaLayer` and `Mamba2Mixer` 1:1, so a checkpoint's
`...mamba.*` / `...mixer.*` tensors load with no renaming.

Paths:
- `meta.all_decode`: one batched recurrent update over all requests (no Python loop, no
  host-side index building; CUDA-graph friendly: only `slots` / `has_initial_state` vary).
- otherwise: the conv runs over every token at once (models.causal_conv: a gather of the K
  taps from "stored tails ++ this step's tokens"); 1-token requests take the batched recurrent update,
  and all longer requests go through one *varlen* chunked scan: each request is padded to a
  multiple of `chunk_size` so every chunk belongs to one request, the intra-chunk work is
  batched over all chunks, and the inter-chunk recurrence runs over the concatenated chunk
  sequence (with one pseudo-chunk per request carrying its initial state) with
  cross-request terms masked out. No loop over requests or tokens.

The host-side index work for the mixed path is in `Mamba2Plan`; build it once per step
(`Mamba2Plan.build(meta, chunk_size, conv_kernel)`) and pass it to every Mamba2 layer of the
group, or let `forward` build it. The engine's path, `forward_paged`, runs the conv and scan
inside the `zooinfer::state_update` custom op and builds the plan once per step per group
(`StatePlan.derive`), so the model compiles with fullgraph=True.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import attention.ops  # noqa: F401  (registers zooinfer::state_update, used by forward_paged)
from attention.state import StateMetadata
from models.causal_conv import ConvPlan, conv_step, conv_varlen
from models.layers import GatedRMSNorm


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T] with out[..., i, j] = sum(x[..., j+1:i+1]) for i >= j, -inf
    above the diagonal (HF's numerically stable cumsum-and-mask form)."""
    n = x.size(-1)
    x = x[..., None].expand(*x.size(), n)
    mask = torch.tril(torch.ones(n, n, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~mask, 0)
    out = torch.cumsum(x, dim=-2)
    mask = torch.tril(torch.ones(n, n, device=x.device, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~mask, -torch.inf)


@dataclass(slots=True)
class Mamba2Plan:
    """Per-step index tensors for the mixed (not all-decode) path; shared by every Mamba2
    layer with the same chunk_size and conv_kernel. Built on the host from
    `meta.query_start_loc` and moved to the device once."""
    num_tokens: int
    conv_kernel: int
    chunk_size: int
    conv: ConvPlan                # the causal conv's gathers (models.causal_conv)
    dec_reqs: torch.Tensor | None  # [Rd] requests with exactly one token
    dec_toks: torch.Tensor | None  # [Rd] their token rows
    pf_reqs: torch.Tensor | None   # [Rp] requests with more than one token
    pf_toks: torch.Tensor | None   # [Tp] their token rows, in request order
    pf_dest: torch.Tensor | None   # [Tp] row of each in the chunk-padded layout
    num_chunks: int               # Nc: chunks of the padded layout
    chunk_aug: torch.Tensor | None       # [Nc] position of each chunk in the augmented sequence
    pseudo_aug: torch.Tensor | None      # [Rp] position of each request's initial-state pseudo-chunk
    final_aug: torch.Tensor | None       # [Rp] position holding each request's final state
    aug_same: torch.Tensor | None        # [Na, Na] bool: both positions belong to one request

    @staticmethod
    def build(meta: StateMetadata, chunk_size: int, conv_kernel: int,
              device: torch.device | str | None = None) -> "Mamba2Plan":
        device = meta.slots.device if device is None else device
        qsl = meta.query_start_loc
        R, T = len(qsl) - 1, qsl[-1]
        starts = torch.tensor(qsl[:-1], dtype=torch.long)
        lens = torch.tensor(qsl[1:], dtype=torch.long) - starts
        req = torch.repeat_interleave(torch.arange(R), lens, output_size=T)
        tok = torch.arange(T)
        pos = tok - starts[req]

        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        is_dec = lens == 1
        dec_reqs = dec_toks = pf_reqs = pf_toks = pf_dest = None
        chunk_aug = pseudo_aug = final_aug = aug_same = None
        nc_total = 0
        if bool(is_dec.any()):
            dec_reqs = is_dec.nonzero().squeeze(1)
            dec_toks = starts[dec_reqs]
            dec_reqs, dec_toks = to(dec_reqs), to(dec_toks)
        if not bool(is_dec.all()):
            pf_r = (~is_dec).nonzero().squeeze(1)
            rp = pf_r.numel()
            pf_lens = lens[pf_r]
            nchunks = (pf_lens + chunk_size - 1) // chunk_size
            chunk_off = torch.cumsum(nchunks, 0) - nchunks
            nc_total = int(nchunks.sum())
            tok_mask = ~is_dec[req]
            pf_t = tok[tok_mask]
            local_r = torch.repeat_interleave(torch.arange(rp), pf_lens)  # index into pf_r
            dest = chunk_off[local_r] * chunk_size + pos[tok_mask]
            chunk_req = torch.repeat_interleave(torch.arange(rp), nchunks, output_size=nc_total)
            c_aug = torch.arange(nc_total) + chunk_req + 1
            p_aug = chunk_off + torch.arange(rp)
            f_aug = p_aug + nchunks
            aug_req = torch.repeat_interleave(torch.arange(rp), nchunks + 1)
            same = aug_req[:, None] == aug_req[None, :]
            pf_reqs, pf_toks, pf_dest = to(pf_r), to(pf_t), to(dest)
            chunk_aug, pseudo_aug, final_aug, aug_same = to(c_aug), to(p_aug), to(f_aug), to(same)
        return Mamba2Plan(T, conv_kernel, chunk_size, ConvPlan.build(meta, conv_kernel, device), dec_reqs,
                          dec_toks, pf_reqs, pf_toks, pf_dest, nc_total, chunk_aug, pseudo_aug,
                          final_aug, aug_same)


def hf_mixer_kwargs(config) -> dict:
    """Mamba2Mixer kwargs from an HF BambaConfig / GraniteMoeHybridConfig (mamba_* fields) or
    Mamba2Config (plain fields)."""
    if hasattr(config, "mamba_n_heads"):
        num_heads, hidden = config.mamba_n_heads, config.hidden_size
        inter = int(config.mamba_expand * hidden)
        head_dim = config.mamba_d_head if isinstance(config.mamba_d_head, int) else inter // num_heads
        return dict(hidden_size=hidden, num_heads=num_heads, head_dim=head_dim,
                    state_size=config.mamba_d_state, n_groups=config.mamba_n_groups,
                    conv_kernel=config.mamba_d_conv, intermediate_size=inter,
                    chunk_size=config.mamba_chunk_size, use_conv_bias=config.mamba_conv_bias,
                    use_bias=config.mamba_proj_bias, rms_norm_eps=config.rms_norm_eps,
                    activation=config.hidden_act, time_step_limit=config.time_step_limit)
    return dict(hidden_size=config.hidden_size, num_heads=config.num_heads, head_dim=config.head_dim,
                state_size=config.state_size, n_groups=config.n_groups, conv_kernel=config.conv_kernel,
                intermediate_size=int(config.expand * config.hidden_size), chunk_size=config.chunk_size,
                use_conv_bias=config.use_conv_bias, use_bias=config.use_bias,
                rms_norm_eps=config.layer_norm_epsilon, activation=config.hidden_act,
                time_step_limit=config.time_step_limit)


class Mamba2Mixer(nn.Module):
    """Mamba2 (SSD) mixer over the flattened token row; see the module docstring.

    Parameters (names as HF's BambaMixer): in_proj [I + conv_dim + H, hidden] (+bias if
    use_bias; output split gate | xBC | dt), conv1d.weight [conv_dim, 1, K] (+conv1d.bias
    [conv_dim] if use_conv_bias), dt_bias [H], A_log [H], D [H], norm.weight [I] (unless
    gated_norm is "none"), out_proj [hidden, I] (+bias if out_bias, default use_bias);
    I = intermediate_size = H * head_dim.

    gated_norm: how the output is gated by silu(gate) before out_proj. "gate_then_norm"
    (Mamba2, Bamba, Nemotron-H): RMS-normalise y * silu(gate) per group of I / n_groups
    channels; "norm_then_gate" (Falcon-H1 with mamba_norm_before_gate): normalise y per group,
    then gate; "none" (Falcon-H1 with mamba_rms_norm false): y * silu(gate), no norm weight.
    """

    GATED_NORMS = ("gate_then_norm", "norm_then_gate", "none")

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int,
                 n_groups: int = 1, conv_kernel: int = 4, intermediate_size: int | None = None,
                 chunk_size: int = 256, use_conv_bias: bool = True, use_bias: bool = False,
                 rms_norm_eps: float = 1e-6, activation: str = "silu",
                 time_step_limit: tuple[float, float] | None = (0.0, float("inf")),
                 gated_norm: str = "gate_then_norm", out_bias: bool | None = None):
        super().__init__()
        inter = num_heads * head_dim if intermediate_size is None else intermediate_size
        if inter != num_heads * head_dim:
            raise ValueError(f"intermediate_size {inter} != num_heads * head_dim {num_heads * head_dim}")
        if num_heads % n_groups:
            raise ValueError(f"num_heads {num_heads} not divisible by n_groups {n_groups}")
        if conv_kernel < 2:
            raise ValueError("conv_kernel must be >= 2")
        if activation not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {activation!r}")
        if gated_norm not in self.GATED_NORMS:
            raise ValueError(f"gated_norm {gated_norm!r} is not one of {', '.join(self.GATED_NORMS)}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.state_size, self.n_groups, self.conv_kernel = state_size, n_groups, conv_kernel
        self.intermediate_size, self.chunk_size = inter, chunk_size
        self.conv_dim = inter + 2 * n_groups * state_size
        lo, hi = (0.0, float("inf")) if time_step_limit is None else time_step_limit
        self.time_step_limit = (float(lo), float(hi))

        self.in_proj = nn.Linear(hidden_size, inter + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.norm = None if gated_norm == "none" else GatedRMSNorm(
            inter, rms_norm_eps, group_size=inter // n_groups, gate_first=gated_norm == "gate_then_norm")
        self.D = nn.Parameter(torch.ones(num_heads))
        self.out_proj = nn.Linear(inter, hidden_size, bias=use_bias if out_bias is None else out_bias)

    @classmethod
    def from_hf_config(cls, config) -> "Mamba2Mixer":
        return cls(**hf_mixer_kwargs(config))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request state shapes. conv: (conv_dim, conv_kernel - 1) with conv_dim =
        intermediate_size + 2 * n_groups * state_size (x, B, C channels; the last K-1 conv
        inputs, oldest first). ssm: (num_heads, head_dim, state_size)."""
        return {"conv": (self.conv_dim, self.conv_kernel - 1),
                "ssm": (self.num_heads, self.head_dim, self.state_size)}

    def make_plan(self, meta: StateMetadata) -> Mamba2Plan:
        return Mamba2Plan.build(meta, self.chunk_size, self.conv_kernel)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                meta: StateMetadata, plan: Mamba2Plan | None = None) -> torch.Tensor:
        """Slot-based states: `conv_state` / `ssm_state` hold every slot, `meta.slots` picks."""
        gate, xbc, dt, A = self._project(hidden)
        y = self._mix(xbc, dt, A, conv_state, ssm_state, meta, plan)
        return self._finish(y, gate, hidden.dtype)

    def forward_paged(self, hidden: torch.Tensor, pages: torch.Tensor, layer_id: int) -> torch.Tensor:
        """States in pool pages: the projections and the gated norm stay in the (compiled)
        graph; the conv + SSD scan, which read and write the pages through the step's
        host-side plan, run inside the `zooinfer::state_update` op (see `update_states`)."""
        gate, xbc, dt, A = self._project(hidden)
        y = torch.ops.zooinfer.state_update([xbc, dt, A], pages, layer_id, [self.num_heads, self.head_dim])
        return self._finish(y, gate, hidden.dtype)

    def update_states(self, inputs: list[torch.Tensor], states: list[torch.Tensor], plan) -> torch.Tensor:
        """`zooinfer::state_update` body: inputs (xbc, dt, A), states (conv, ssm) in slot order
        of `plan.meta`; the Mamba2Plan is built once per step for the whole group."""
        xbc, dt, A = inputs
        conv_state, ssm_state = states
        mplan = None if plan.meta.all_decode else plan.derive(
            ("mamba2", self.chunk_size, self.conv_kernel), self.make_plan)
        return self._mix(xbc, dt, A, conv_state, ssm_state, plan.meta, mplan)

    def _project(self, hidden: torch.Tensor):
        """-> gate [T, I], pre-conv xbc [T, conv_dim], dt [T, H] (softplus, clamped, fp32), A [H]."""
        gate, xbc, dt = self.in_proj(hidden).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = self.time_step_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(min=lo, max=hi)
        A = -torch.exp(self.A_log.float())
        return gate, xbc, dt, A

    def _finish(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = y.view(-1, self.intermediate_size)
        out = y * F.silu(gate.float()) if self.norm is None else self.norm(y, gate)
        return self.out_proj(out.to(dtype))

    def _mix(self, xbc, dt, A, conv_state, ssm_state, meta: StateMetadata,
             plan: Mamba2Plan | None) -> torch.Tensor:
        """Conv + SSM over the step's tokens, states updated in place -> y [T, H, P] fp32
        (with the D skip term, before the gated norm)."""
        T = xbc.shape[0]
        I, H, P, N, G = self.intermediate_size, self.num_heads, self.head_dim, self.state_size, self.n_groups
        if meta.all_decode:
            assert meta.slots.shape[0] == T, "all_decode: one slot per token"
            xbc = self._conv_decode(xbc, conv_state, meta.slots, meta.has_initial_state)
            x, B, C = xbc.split([I, G * N, G * N], dim=-1)
            x = x.view(T, H, P)
            y = self._ssm_step(x, dt, A, B.view(T, G, N), C.view(T, G, N), ssm_state,
                               meta.slots, meta.has_initial_state)
        else:
            assert T == meta.query_start_loc[-1], "hidden rows must match query_start_loc"
            if plan is None:
                plan = self.make_plan(meta)
            xbc = self._conv_varlen(xbc, conv_state, meta, plan)
            x, B, C = xbc.split([I, G * N, G * N], dim=-1)
            x, B, C = x.reshape(T, H, P), B.reshape(T, G, N), C.reshape(T, G, N)
            y = x.new_empty(T, H, P)
            if plan.dec_toks is not None:
                t, r = plan.dec_toks, plan.dec_reqs
                y[t] = self._ssm_step(x[t], dt[t], A, B[t], C[t], ssm_state, meta.slots[r],
                                      meta.has_initial_state[r])
            if plan.pf_toks is not None:
                t, r = plan.pf_toks, plan.pf_reqs
                y[t] = self._ssd_varlen(x[t], dt[t], A, B[t], C[t], ssm_state, meta.slots[r],
                                        meta.has_initial_state[r], plan)
        return y + self.D.float()[:, None] * x

    # ------------------------------------------------------------------ conv
    def _conv_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.conv1d.weight.squeeze(1), self.conv1d.bias          # [conv_dim, K], [conv_dim]

    def _conv_decode(self, xbc, conv_state, slots, has_init):
        """One token per request: window = stored tail ++ token; writes the new tail."""
        return F.silu(conv_step(xbc, conv_state, slots, has_init, *self._conv_weights()))

    def _conv_varlen(self, xbc, conv_state, meta, plan: Mamba2Plan):
        """Causal depthwise conv over every request's tokens, each prefixed by its stored tail
        (zeros when it has no initial state); writes the new tails."""
        return F.silu(conv_varlen(xbc, conv_state, meta, plan.conv, *self._conv_weights()))

    # ------------------------------------------------------------------ ssm
    def _ssm_step(self, x, dt, A, B, C, ssm_state, slots, has_init):
        """Recurrent update for one token per request ([R, H, P] x); in-place state write.
        Returns y without the D skip term."""
        R, H, P = x.shape
        G, N = B.shape[1], B.shape[2]
        E = H // G
        h = ssm_state[slots].float()                                     # [R, H, P, N]
        h = torch.where(has_init[:, None, None, None], h, torch.zeros_like(h))
        dA = torch.exp(dt * A)                                            # [R, H]
        Bh = B.float()[:, :, None, :].expand(R, G, E, N).reshape(R, H, 1, N)
        Ch = C.float()[:, :, None, :].expand(R, G, E, N).reshape(R, H, N, 1)
        h = h * dA[:, :, None, None] + (dt[:, :, None] * x.float())[..., None] * Bh
        ssm_state[slots] = h.to(ssm_state.dtype)
        return torch.matmul(h, Ch).squeeze(-1)                           # [R, H, P]

    def _ssd_varlen(self, x, dt, A, B, C, ssm_state, slots, has_init, plan: Mamba2Plan):
        """Chunked SSD scan over the prefill requests' tokens (concatenated, request order),
        each from its initial state; writes final states. Returns y without the D term."""
        Tp, H, P = x.shape
        G, N = B.shape[1], B.shape[2]
        E, cs, Nc = H // G, plan.chunk_size, plan.num_chunks
        dev = x.device
        # Chunk-padded layout: each request padded to whole chunks (pad rows are zero: no
        # decay, no input, so they leave the state untouched).
        xdt = torch.zeros(Nc * cs, H, P, device=dev).index_copy_(0, plan.pf_dest, x.float() * dt[..., None])
        dA = torch.zeros(Nc * cs, H, device=dev).index_copy_(0, plan.pf_dest, dt * A)
        Bp = torch.zeros(Nc * cs, G, N, device=dev).index_copy_(0, plan.pf_dest, B.float())
        Cp = torch.zeros(Nc * cs, G, N, device=dev).index_copy_(0, plan.pf_dest, C.float())
        xdt = xdt.view(Nc, cs, G, E, P)
        Bp, Cp = Bp.view(Nc, cs, G, N), Cp.view(Nc, cs, G, N)
        dA = dA.view(Nc, cs, H).permute(0, 2, 1)                          # [Nc, H, l]
        A_cum = torch.cumsum(dA, dim=-1)

        # 1. intra-chunk (diagonal blocks)
        L = torch.exp(segment_sum(dA)).view(Nc, G, E, cs, cs)            # [c, g, e, l, s]
        CB = torch.einsum("clgn,csgn->cgls", Cp, Bp)
        y = torch.einsum("cgels,csgep->clgep", CB[:, :, None] * L, xdt)

        # 2. each chunk's own state contribution (from a zero start)
        decay_states = torch.exp(A_cum[:, :, -1:] - A_cum).view(Nc, G, E, cs)
        states = torch.einsum("clgn,cgel,clgep->cgepn", Bp, decay_states, xdt).reshape(Nc, H, P, N)

        # 3. inter-chunk recurrence over the augmented chunk sequence: per request one
        # pseudo-chunk (initial state, no decay) then its chunks; cross-request terms masked.
        Rp = slots.shape[0]
        Na = Nc + Rp
        init = ssm_state[slots].float()
        init = torch.where(has_init[:, None, None, None], init, torch.zeros_like(init))
        aug_states = states.new_empty(Na, H, P, N)
        aug_states[plan.pseudo_aug] = init
        aug_states[plan.chunk_aug] = states
        aug_decay = A_cum.new_zeros(H, Na)
        aug_decay[:, plan.chunk_aug] = A_cum[:, :, -1].transpose(0, 1)
        seg = segment_sum(aug_decay).masked_fill(~plan.aug_same, -torch.inf)  # [H, i, j]
        new_states = torch.einsum("hij,jhpn->ihpn", torch.exp(seg), aug_states)
        ssm_state[slots] = new_states[plan.final_aug].to(ssm_state.dtype)
        start_states = new_states[plan.chunk_aug - 1].view(Nc, G, E, P, N)

        # 4. state -> output per chunk (off-diagonal blocks)
        y_off = torch.einsum("clgn,cgepn->clgep", Cp, start_states)
        y = y + y_off * torch.exp(A_cum).view(Nc, G, E, cs).permute(0, 3, 1, 2)[..., None]
        return y.reshape(Nc * cs, H, P)[plan.pf_dest]
