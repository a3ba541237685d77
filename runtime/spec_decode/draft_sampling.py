"""Sampled drafts (draft model, MTP head): the proposal q is the draft's distribution under
the request's own sampling filters.

Rejection sampling (Leviathan et al. 2023) accepts draft d with probability
min(1, p(d) / q(d)) and resamples a rejection from norm(max(0, p - q)). `p` is the target's
distribution after temperature, top-k, top-p and min-p (`Sampler.probs`). The output follows p
for any q that the drafts really came from. But a q that keeps the tokens p has masked out
spends drafts on tokens that are always rejected. Its acceptance is also sum(min(p, q)) of the
wrong q, and that is the rate the adaptive k and the cost model learn from. So q is the
draft's logits under the same temperature, top-k, top-p and min-p as p (`Sampler.probs` with
the request's filters). A draft is drawn from that q, and q goes to the verifier.

Drawing uses the exponential race, as the Sampler does: the argmax of q / E with E ~ Exp(1).
A seeded request's noise comes from its own generator, the others share one draw. Only the
seeded rows are looped over; nothing loops over tokens. Greedy rows take the argmax of the
raw logits (their q row is unused).
"""
from __future__ import annotations

import numpy as np
import torch

from zooinfer_kernels import lm_head
from runtime.worker.sampler import Sampler, SamplingMetadata, _exponential


def draft_distribution(logits: torch.Tensor, batch, rows: np.ndarray) -> torch.Tensor:
    """[R, V] float32: each row's draft distribution under its request's temperature (1 for
    greedy rows), top-k, top-p and min-p, normalised (min-p leaves the masked softmax short
    of 1)."""
    temp = torch.from_numpy(batch.temperature[rows]).to(logits.device)
    top_k, top_p, min_p = batch.sampling_filters(rows, logits.device)
    meta = SamplingMetadata(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, generators={},
                            all_greedy=False)
    q = Sampler.probs(logits.float(), meta)
    return q / q.sum(dim=-1, keepdim=True)


def sample_drafts(logits: torch.Tensor, batch, rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """(one draft per row [R] int64, q [R, V]). Sampled rows draw from q with their
    request's generator when seeded. Greedy rows take the logits' argmax."""
    q = draft_distribution(logits, batch, rows)
    temp = batch.temperature[rows]
    noise = _exponential(q.shape, device=q.device)
    for i, gen in batch.row_generators(rows).items():
        if temp[i] > 0:                       # a greedy row never draws from its generator
            noise[i] = _exponential(q.shape[-1:], generator=gen, device=q.device)
    drawn = lm_head.argmax(q / noise)
    greedy = torch.from_numpy(temp == 0).to(q.device)
    return torch.where(greedy, lm_head.argmax(logits.float()), drawn).cpu().numpy(), q
