"""The pipeline-parallel side of the executor: a stage's runner and a step as micro-batches.

A step's scheduled requests are cut into two micro-batches of about equal token counts
(`split_micro_batches`): the first carries the step's batch delta and the page copies that
precede the forward, the second the copies that follow it. Every stage but the last runs
both forwards before sampling either, so stage 0 computes micro-batch 2 while stage 1
computes micro-batch 1 (`models/pipeline.py` sends without waiting); the last stage
forwards and samples each in turn. Its tokens (and logprobs) are broadcast to every stage,
so each stage's persistent batch feeds the same next inputs and rank 0 returns them.
"""
from __future__ import annotations

import dataclasses

import torch

from models.parallel import TPGroup
from runtime.scheduler import SchedulerOutput
from runtime.worker.model_runner import ModelRunner, ModelRunnerOutput
from runtime.worker.sampler import SamplerOutput


class PPModelRunner(ModelRunner):
    """A stage's runner: the last stage samples, every stage gets its tokens by broadcast."""

    def __init__(self, *args, pp: TPGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.pp = pp
        self.last = pp.rank == pp.size - 1

    def _sample(self, hidden: torch.Tensor, meta) -> SamplerOutput:
        src, n = self.pp.size - 1, hidden.shape[0]
        k = meta.max_logprobs
        if self.last:
            out = super()._sample(hidden, meta)
        else:
            out = SamplerOutput(token_ids=torch.empty(n, dtype=torch.int64, device=hidden.device))
            if k is not None:
                out.logprobs = torch.empty(n, 1 + k, dtype=torch.float32, device=hidden.device)
                out.logprob_token_ids = torch.empty(n, 1 + k, dtype=torch.int64, device=hidden.device)
                out.sampled_ranks = torch.empty(n, dtype=torch.int64, device=hidden.device)
        out.token_ids = self.pp.broadcast(out.token_ids.contiguous(), src)
        if k is not None:
            out.logprobs = self.pp.broadcast(out.logprobs.contiguous(), src)
            out.logprob_token_ids = self.pp.broadcast(out.logprob_token_ids.contiguous(), src)
            out.sampled_ranks = self.pp.broadcast(out.sampled_ranks.contiguous(), src)
        return out


def split_micro_batches(so: SchedulerOutput) -> list[SchedulerOutput]:
    """The step as two micro-batches (one when it schedules a single request)."""
    ids = list(so.num_scheduled_tokens)
    if len(ids) < 2:
        return [so]
    counts = list(so.num_scheduled_tokens.values())
    cut, acc = 1, counts[0]
    while cut < len(ids) - 1 and acc + counts[cut] <= so.total_num_scheduled_tokens / 2:
        acc += counts[cut]
        cut += 1
    first = dataclasses.replace(so, num_scheduled_tokens={r: so.num_scheduled_tokens[r] for r in ids[:cut]},
                                total_num_scheduled_tokens=acc, copies_after=[])
    second = SchedulerOutput(num_scheduled_tokens={r: so.num_scheduled_tokens[r] for r in ids[cut:]},
                             total_num_scheduled_tokens=so.total_num_scheduled_tokens - acc,
                             copies_after=so.copies_after, grammar_bitmask=so.grammar_bitmask)
    return [first, second]


def pipeline_step(runner: PPModelRunner, so: SchedulerOutput) -> ModelRunnerOutput:
    """One step on this stage, micro-batch by micro-batch (see the module docstring)."""
    parts = split_micro_batches(so)
    try:
        if runner.last:
            outs = [runner.finish_step(runner.forward_step(p)) for p in parts]
        else:
            pending = [runner.forward_step(p) for p in parts]
            outs = [runner.finish_step(p) for p in pending]
    finally:
        runner.model.drain()
    sampled = {k: v for o in outs for k, v in o.sampled.items()}
    logprobs = [o.logprobs for o in outs if o.logprobs is not None]
    return ModelRunnerOutput(sampled, {k: v for lp in logprobs for k, v in lp.items()} if logprobs else None)
