"""One step's attention metadata, planned once per KV cache group.

`ModelRunner.execute` (a real batch), `ModelRunner.warm_up` (one dummy request in the null
block) and `CudaGraphRunner.capture` (a padded bucket of dummy requests) all describe their
batch as a `StepBatch` and get the per-layer metadata from `plan_layers`, so the three can
never disagree on how a group is planned.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attention import BatchLayout
from attention.compressed_plan import EntryPlan, RowsPlan
from attention.mla import MLAPlan
from attention.state import StatePlan
from cache.kv_cache_spec import CompressedEntrySpec, KVCacheConfig, MLASpec, SlidingRowsSpec, StateSpec


@dataclass(slots=True)
class StepBatch:
    """What every group's plan is made of, requests in batch order."""
    query_start_loc: np.ndarray            # [num_reqs + 1] int64
    seq_lens: np.ndarray                   # [num_reqs] tokens in context after this step
    num_computed: np.ndarray               # [num_reqs] before this step (0: a state starts fresh)
    block_tables: list[torch.Tensor]       # per group: [num_reqs, width] int32 table rows
    slot_mappings: list[torch.Tensor | None]   # per group: [num_tokens] int64 (None: state group)

    @classmethod
    def dummy(cls, kv_config: KVCacheConfig, num_reqs: int, tokens_per_req: int, width: int) -> StepBatch:
        """`num_reqs` requests of `tokens_per_req` fresh tokens, every slot in the null block
        0 (never read by a real request)."""
        n = num_reqs * tokens_per_req
        return cls(query_start_loc=np.arange(0, n + 1, tokens_per_req, dtype=np.int64),
                   seq_lens=np.full(num_reqs, tokens_per_req, dtype=np.int64),
                   num_computed=np.zeros(num_reqs, dtype=np.int64),
                   block_tables=[torch.zeros(num_reqs, g.spec.pages if isinstance(g.spec, StateSpec) else width,
                                             dtype=torch.int32) for g in kv_config.groups],
                   slot_mappings=[None if isinstance(g.spec, StateSpec) else
                                  torch.arange(tokens_per_req, dtype=torch.int64).repeat(num_reqs)
                                  for g in kv_config.groups])


PlanKV = Callable[[int, BatchLayout], Any]    # (group id, layout) -> that group's metadata


def plan_layers(kv_config: KVCacheConfig, batch: StepBatch, plan_kv: PlanKV,
                device: torch.device) -> list:
    """Per-layer metadata for one step: each group planned once, shared by its layers.
    `plan_kv` plans an attention group (the backend's `plan`, or a CUDA graph's static
    metadata); state groups get a StatePlan, MLA groups an MLAPlan."""
    layer_meta: list = [None] * len(kv_config.layer_to_group())
    num_sched = np.diff(batch.query_start_loc)
    for gid, group in enumerate(kv_config.groups):
        spec, table = group.spec, batch.block_tables[gid]
        if isinstance(spec, StateSpec):
            meta = StatePlan.build(num_sched.tolist(), (batch.num_computed > 0).tolist(),
                                   table[:, :spec.pages], device, spec.dtype)
        else:
            layout = BatchLayout(query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                                 block_table=table, slot_mapping=batch.slot_mappings[gid],
                                 block_size=kv_config.block_size,
                                 sliding_window=getattr(spec, "sliding_window", None))
            # MLA groups and DeepSeek-V4's compressed attention caches are read by their own
            # ops (attention/mla.py, attention/compressed.py), whatever the backend.
            if isinstance(spec, MLASpec) or isinstance(spec, SlidingRowsSpec) and not spec.compress_rate:
                meta = MLAPlan.build(layout, device)
            elif isinstance(spec, SlidingRowsSpec):
                meta = RowsPlan.build(layout, spec.compress_rate, spec.overlap, device)
            elif isinstance(spec, CompressedEntrySpec):
                meta = EntryPlan.build(layout, spec.compress_rate, spec.entries_per_page, spec.block_stride, device)
            else:
                meta = plan_kv(gid, layout)
        for layer in group.layer_ids:
            layer_meta[layer] = meta
    return layer_meta
