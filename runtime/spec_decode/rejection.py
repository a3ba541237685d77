"""Verification of draft tokens against the target model, vectorised over the batch.

Each sampling request i brings `nd[i]` drafts (0 for a request that did not speculate) and
the target's outputs at its `nd[i] + 1` positions, flattened request-major: position j of
request i is row `start[i] + j`. Position j's output is the token after draft j-1.

Greedy requests accept draft j while it equals the target's argmax at j; the token emitted
after the accepted run is the argmax at the first mismatch (or the bonus position nd), so
the output is exactly what plain greedy decoding gives.

Sampled requests follow Leviathan et al. 2023 with a point-mass proposal q = delta(d_j):
draft j is accepted with probability min(1, p_j(d_j) / q(d_j)) = p_j(d_j); at the first
rejection the token is drawn from the residual norm(max(0, p_j - q)), which is p_j with d_j
removed; when every draft is accepted the bonus token is drawn from p_nd. The result is
distributed exactly as sampling from p one token at a time. Draws use the request's own
generator when it is seeded (its uniforms for the drafts first, then the Exp(1) noise of
the exponential race, as the sampler draws it), a shared draw otherwise; a request with no
drafts draws exactly what the plain sampler would.
"""
from __future__ import annotations

import numpy as np
import torch

from zooinfer_kernels import lm_head
from runtime.worker.sampler import _exponential


def layout(nd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start row of each request, request of each flat row) for `nd[i] + 1` rows each."""
    reps = nd + 1
    start = np.cumsum(reps) - reps
    return start, np.repeat(np.arange(len(nd)), reps)


def verify(target: torch.Tensor, probs: torch.Tensor | None, greedy: np.ndarray, drafts: np.ndarray,
           nd: np.ndarray, generators: dict[int, torch.Generator],
           proposal: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Returns (emitted [R, K+1] int64: accepted drafts then the next token, junk after;
    num_accepted [R]). `target`: [N] argmax per flat row; `probs`: [N, V] the target's
    sampling distribution per flat row (None when every request is greedy); `greedy`: [R]
    bool; `drafts`: [R, K] int64 (only the first nd[i] of row i are read); `generators`:
    request index -> its generator; `proposal`: [N, V] the proposal distribution per flat row, for
    drafts sampled from a draft model's distribution (None: every draft a point mass). A
    draft is then accepted with probability min(1, p(d) / q(d)) and a rejection samples from
    norm(max(0, p - q)); a point-mass row of q is one-hot at its draft, which is the rule above."""
    r = len(nd)
    kmax = drafts.shape[1]
    start, _ = layout(nd)
    j = np.arange(kmax)[None, :]
    in_draft = j < nd[:, None]                                 # [R, K]
    flat = np.minimum(start[:, None] + j, start[:, None] + nd[:, None])   # row of draft position j
    target_np = target.cpu().numpy()
    accept = in_draft & (drafts == target_np[flat])            # greedy rule
    sampled_rows = np.flatnonzero(~greedy)
    if len(sampled_rows):
        # Uniforms for the drafts: seeded requests from their generator, the rest shared.
        u = torch.rand(r, kmax)
        for i, gen in generators.items():
            if not greedy[i] and nd[i]:
                u[i, :nd[i]] = torch.rand(int(nd[i]), generator=gen)
        d_t = torch.from_numpy(np.where(in_draft, drafts, 0))
        p_draft = probs[torch.from_numpy(flat), d_t].cpu()   # p_j(d_j)  [R, K]
        if proposal is not None:                              # u < p / q, without dividing by 0
            u = u * proposal[torch.from_numpy(flat), d_t].cpu()
        accept_s = in_draft & (u < p_draft).numpy()
        accept[sampled_rows] = accept_s[sampled_rows]
    num_acc = np.cumprod(accept, axis=1).sum(axis=1)
    emitted = np.zeros((r, kmax + 1), dtype=np.int64)
    emitted[:, :kmax] = np.where(in_draft, drafts, 0)
    at = start + num_acc                                        # flat row of the emitted next token
    nxt = target_np[at]
    if len(sampled_rows):
        at_t = torch.from_numpy(at[sampled_rows])
        p = probs[at_t].clone()                                 # [S, V]
        rejected = num_acc[sampled_rows] < nd[sampled_rows]
        if rejected.any():   # residual: the rejected draft's mass removed (the race renormalises)
            rr = torch.from_numpy(np.flatnonzero(rejected))
            bad = torch.from_numpy(drafts[sampled_rows[rejected], num_acc[sampled_rows[rejected]]])
            if proposal is None:
                p[rr, bad.to(p.device)] = 0.0
            else:
                res = (p[rr] - proposal[torch.from_numpy(at[sampled_rows[rejected]]).to(p.device)]).clamp_(min=0.0)
                ok = res.sum(-1, keepdim=True) > 0     # all mass on q's side: only rounding rejects
                p[rr] = torch.where(ok, res, p[rr])
        q = _exponential(p.shape, device=p.device)
        pos = {int(i): n for n, i in enumerate(sampled_rows.tolist())}
        for i, gen in generators.items():
            if i in pos:
                q[pos[i]] = _exponential(p.shape[-1:], generator=gen, device=p.device)
        nxt[sampled_rows] = lm_head.argmax(p / q).cpu().numpy()
    emitted[np.arange(r), num_acc] = nxt
    return emitted, num_acc
