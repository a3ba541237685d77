"""Prompt logprobs: the logprob of each prompt token given its prefix, from the prefill forward.

vLLM's `prompt_logprobs=k`: position j's hidden state predicts prompt token j + 1, so a
prefill chunk that computes positions [c, c + n) gives the entries of prompt tokens
c + 1 .. c + n (never past the last prompt token: position P - 1 predicts the first output
token, which the sampler handles). Nothing runs a second pass: the runner takes the hidden
states of the chunk it just computed (`compute`), so chunked prefill gives each position's
entry from the same forward that fills its KV cache. The logits are the model's raw logits
(no penalties, bias or grammar), as vLLM's default `raw_logprobs` mode.

A prefix-cache hit skips positions, so a request asking for prompt logprobs is admitted
without a hit (as vLLM does; `Scheduler.schedule`); its blocks are still published for
others. A preempted request recomputes its prompt: `record` keeps only the positions it has
not recorded yet, so the values a client sees come from one computation each.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.limits import MAX_LOGPROBS
from runtime.outputs import Logprob
from runtime.vocab_logprobs import gc_paused

# Rows of logits materialised at once: a 2048-token chunk of a 150k vocabulary would
# otherwise be 1.2 GB of float32 logits.
_SLICE = 256


@dataclass(slots=True)
class PromptLogprobsChunk:
    """One request's entries from one step: prompt tokens first_token .. first_token + len - 1."""
    first_token: int            # prompt index of the first entry's token (>= 1)
    token_ids: np.ndarray       # [m] the prompt tokens
    logprobs: np.ndarray        # [m] their logprobs
    ranks: np.ndarray           # [m] their ranks (1 = best)
    top_ids: np.ndarray         # [m, k] the request's top-k token ids, best first
    top_logprobs: np.ndarray    # [m, k]


def compute(hidden: torch.Tensor, compute_logits, batch, rows: np.ndarray, req_rows: np.ndarray,
            positions: np.ndarray) -> dict[str, PromptLogprobsChunk]:
    """The step's prompt-logprob entries, by request id. `hidden` is the forward's output for
    the step's flattened tokens (token t of the step belongs to batch row `req_rows[t]` at
    `positions[t]`); `rows` are the step's distinct rows. One masked gather over all tokens,
    then the logits in slices: no loop over tokens."""
    want = batch.prompt_logprobs[req_rows]
    take = np.flatnonzero((want >= 0) & (positions < batch.num_prompt_tokens[req_rows] - 1))
    if not len(take):
        return {}
    t_rows, t_pos = req_rows[take], positions[take]
    targets_np = batch.token_ids[t_rows, t_pos + 1]
    k = int(want[take].max())
    index = torch.from_numpy(take).to(hidden.device)
    targets = torch.from_numpy(targets_np).to(hidden.device)
    chosen, ranks, top_v, top_i = [], [], [], []
    for s in range(0, len(take), _SLICE):
        lp = compute_logits(hidden[index[s:s + _SLICE]]).float().log_softmax(dim=-1)
        c = lp.gather(-1, targets[s:s + _SLICE, None])
        chosen.append(c[:, 0])
        ranks.append((lp > c).sum(dim=-1) + 1)
        if k:
            v, i = lp.topk(k, dim=-1)
            top_v.append(v)
            top_i.append(i)
    chosen_np = torch.cat(chosen).cpu().numpy()
    ranks_np = torch.cat(ranks).cpu().numpy()
    top_v_np = torch.cat(top_v).cpu().numpy() if k else np.zeros((len(take), 0), np.float32)
    top_i_np = torch.cat(top_i).cpu().numpy() if k else np.zeros((len(take), 0), np.int64)
    # The step's tokens are grouped by row, so each request's entries are one contiguous run.
    starts = np.flatnonzero(np.r_[True, t_rows[1:] != t_rows[:-1]])
    ends = np.r_[starts[1:], len(take)]
    out = {}
    for a, b_ in zip(starts.tolist(), ends.tolist()):
        row = int(t_rows[a])
        kr = int(batch.prompt_logprobs[row])
        out[batch.req_ids[row]] = PromptLogprobsChunk(int(t_pos[a]) + 1, targets_np[a:b_], chosen_np[a:b_],
                                                      ranks_np[a:b_], top_i_np[a:b_, :kr], top_v_np[a:b_, :kr])
    return out


def record(entries: list, chunk: PromptLogprobsChunk, decode) -> None:
    """Append a chunk's entries to a request's prompt logprobs (`entries[j]` is prompt token
    j's {token id: Logprob}, entries[0] is None), skipping the positions it already holds
    (a preempted request recomputes them). `decode(ids)` spells tokens (or gives Nones)."""
    skip = len(entries) - chunk.first_token
    if skip >= len(chunk.token_ids):
        return
    if skip < 0:
        raise RuntimeError(f"prompt logprobs: entries jump from {len(entries)} to {chunk.first_token}")
    ids, top_ids = chunk.token_ids[skip:].tolist(), chunk.top_ids[skip:].tolist()
    lps, ranks, top_lps = chunk.logprobs[skip:].tolist(), chunk.ranks[skip:].tolist(), chunk.top_logprobs[skip:].tolist()
    words = dict(zip(*_unique_words(ids, top_ids, decode)))
    with gc_paused(chunk.top_ids.shape[1] > MAX_LOGPROBS):        # a whole-vocabulary row (vocab_logprobs.py)
        for t, lp, rank, ti, tv in zip(ids, lps, ranks, top_ids, top_lps):
            d = {tid: Logprob(v, r + 1, words[tid]) for r, (tid, v) in enumerate(zip(ti, tv))}
            d[t] = Logprob(lp, rank, words[t])
            entries.append(d)


def _unique_words(ids: list[int], top_ids: list[list[int]], decode) -> tuple[list[int], list]:
    """Each distinct token of the chunk spelled once (prompts repeat tokens a lot)."""
    uniq = sorted(set(ids).union(*map(set, top_ids)) if top_ids else set(ids))
    return uniq, decode(uniq)
