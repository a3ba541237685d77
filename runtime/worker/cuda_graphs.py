"""CUDA graphs for decode-only steps, captured per padded batch-size bucket.

A decode step of a small model is launch-bound: hundreds of tiny kernels per token, each
costing more CPU time to launch than GPU time to run. Replaying a captured graph launches
them all at once. A graph freezes shapes and addresses, so
- batch sizes are rounded up to a few buckets (1, 2, 4, 8, 16, 24, 32, ..., never above
  `max_num_seqs`), and a batch of n < bucket rows is padded with dummy requests: token 0 at
  position 0, one page, the null block 0, writing their K/V to the null block's slot 0 (never
  read by a real request) and whose outputs are dropped;
- every input the graph reads is a static buffer: token ids, positions, and per bucket and
  KV cache group the attention backend's static metadata (`graph_metadata`), planned at
  capture for a bucket of dummy requests (`StepBatch.dummy`, as the warm-up) and re-planned
  in place before each replay (`plan_graph`, FlashInfer's CUDA-graph decode wrappers);
- all buckets share one graph memory pool, captured largest first so smaller graphs reuse
  the largest one's blocks.
Anything else (a prefill chunk in the batch, more rows than the largest bucket) runs eager.

The bucket, padding and fallback rules are pure functions, tested on CPU; only
`CudaGraphRunner` touches CUDA.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from attention import BatchLayout, ForwardContext, set_forward_context
from cache.kv_cache_spec import CompressedEntrySpec, MLASpec, SlidingRowsSpec, StateSpec
from runtime.worker.step_plan import StepBatch, plan_layers

log = logging.getLogger("zooinfer")


def capture_sizes(max_num_seqs: int, max_bs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, max_bs), which is always the
    last bucket, so every decode batch the scheduler can form (<= max_num_seqs) fits one
    when max_bs allows it."""
    cap = min(max_num_seqs, max_bs)
    if cap < 1:
        return []
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def choose_bucket(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `num_reqs` rows; None when none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if num_reqs >= 1 and i < len(sizes) else None


def decode_bucket(num_scheduled: np.ndarray, sizes: list[int]) -> int | None:
    """The bucket a step replays, or None for eager: only steps where every request
    computes exactly one token (pure decode) and that fit the largest bucket."""
    num_scheduled = np.asarray(num_scheduled)
    if not len(num_scheduled) or (num_scheduled != 1).any():
        return None
    return choose_bucket(len(num_scheduled), sizes)


def pad_tokens(values: np.ndarray, bucket: int) -> np.ndarray:
    """Token ids or positions of a decode step, padded with 0 (dummy rows) to `bucket`."""
    out = np.zeros(bucket, dtype=np.int64)
    out[:len(values)] = values
    return out


def pad_decode_layout(layout: BatchLayout, bucket: int) -> BatchLayout:
    """A decode layout of n rows extended to `bucket` rows with dummy requests: one token,
    context 1, block table row of null blocks, slot 0 (offset 0 of the null block)."""
    n = layout.num_reqs
    if n > bucket:
        raise ValueError(f"pad_decode_layout: {n} requests do not fit bucket {bucket}")
    pad = bucket - n
    table = layout.block_table
    return BatchLayout(
        query_start_loc=np.arange(bucket + 1, dtype=np.int64),
        seq_lens=np.concatenate((layout.seq_lens, np.ones(pad, dtype=layout.seq_lens.dtype))),
        block_table=torch.cat((table, table.new_zeros(pad, table.shape[1]))),
        slot_mapping=torch.cat((layout.slot_mapping, layout.slot_mapping.new_zeros(pad))),
        block_size=layout.block_size, sliding_window=layout.sliding_window)


def unsupported_reason(device: torch.device, backend, kv_config) -> str | None:
    """Why CUDA graphs cannot run in this set-up (one line), or None."""
    if torch.device(device).type != "cuda":
        return f"cuda_graphs=True needs device='cuda', got device='{device}'"
    if not backend.supports_cuda_graphs:
        return (f"cuda_graphs=True needs an attention backend with CUDA graph support "
                f"(attention_backend='flashinfer'), got '{backend.name}'")
    if any(isinstance(g.spec, StateSpec) for g in kv_config.groups):
        return "cuda_graphs=True does not support state layers (mamba2, gated_deltanet) yet"
    if any(isinstance(g.spec, MLASpec) for g in kv_config.groups):
        return "cuda_graphs=True does not support mla layers yet"
    if any(isinstance(g.spec, (SlidingRowsSpec, CompressedEntrySpec)) for g in kv_config.groups):
        return "cuda_graphs=True does not support DeepSeek-V4 attention layers (their plans are not static) yet"
    return None


class CudaGraphRunner:
    """Captures the runner's forward for each bucket and replays it for decode steps.

    `runner` is the ModelRunner (duck-typed: forward, compiled, backend, kv_config,
    kv_caches, batch.block_table, device)."""

    def __init__(self, runner, max_num_seqs: int, max_bs: int):
        reason = unsupported_reason(runner.device, runner.backend, runner.kv_config)
        if reason:
            raise ValueError(reason)
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs, max_bs)
        largest = self.sizes[-1]
        dev = runner.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=dev)
        self.pool = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, dict] = {}         # bucket -> group id -> static metadata
        self.capture_seconds = 0.0

    def bucket_for(self, num_scheduled: np.ndarray) -> int | None:
        return decode_bucket(num_scheduled, self.sizes)

    def _run_forward(self, n: int) -> torch.Tensor:
        r = self.runner
        ids, pos = self.input_ids[:n], self.positions[:n]
        if r.compiled:   # the same dynamic marking as the eager path: one compiled graph for all
            torch._dynamo.decorators.mark_unbacked(ids, 0)
            torch._dynamo.decorators.mark_unbacked(pos, 0)
        return r.forward(ids, pos, r.kv_caches)

    @torch.inference_mode()     # as `execute`: no autograd records in the captured graphs
    def capture(self) -> None:
        r, backend = self.runner, self.runner.backend
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        width = r.batch.block_table[0].max_num_blocks_per_req
        for bs in reversed(self.sizes):
            metas = {}

            def plan_kv(gid, layout, bs=bs, metas=metas):   # static metadata, planned for dummies
                meta = backend.graph_metadata(bs, width, layout.block_size, layout.sliding_window, r.device)
                backend.plan_graph(meta, layout)
                metas[gid] = meta
                return meta

            layer_meta = plan_layers(r.kv_config, StepBatch.dummy(r.kv_config, bs, 1, width), plan_kv, r.device)
            with set_forward_context(ForwardContext(backend, layer_meta)):
                for _ in range(2):      # warm-up: wrapper plans, kernel JIT, compile, cuBLAS
                    self._run_forward(bs)
                torch.cuda.synchronize(r.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._run_forward(bs)
            self.graphs[bs], self.outputs[bs], self.metas[bs] = graph, out, metas
        torch.cuda.synchronize(r.device)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs (decode batch sizes %s) in %.1f s",
                 len(self.sizes), self.sizes, self.capture_seconds)

    def plan(self, bucket: int, gid: int, layout: BatchLayout):
        """Re-plan group `gid`'s static metadata of `bucket` for this step's decode layout."""
        meta = self.metas[bucket][gid]
        self.runner.backend.plan_graph(meta, pad_decode_layout(layout, bucket))
        return meta

    def replay(self, bucket: int, input_ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Run the captured step; returns the hidden states of the real rows (a view of the
        graph's output, valid until the next replay)."""
        n = len(input_ids)
        self.input_ids[:bucket].copy_(torch.from_numpy(pad_tokens(input_ids, bucket)), non_blocking=True)
        self.positions[:bucket].copy_(torch.from_numpy(pad_tokens(positions, bucket)), non_blocking=True)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]
