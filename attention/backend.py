"""The attention backend interface and the per-step batch layout every backend plans from."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class BatchLayout:
    """Host-side facts about one step's batch for one KV cache group.

    Requests are in batch order; request i owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` of the flattened token dimension, whose
    positions are ``seq_lens[i] - query_lens[i]`` ... ``seq_lens[i] - 1``.
    """
    query_start_loc: np.ndarray     # [num_reqs + 1] int64
    seq_lens: np.ndarray            # [num_reqs] tokens in context after this step
    block_table: torch.Tensor       # [num_reqs, >= max blocks] int32, rows in batch order
    slot_mapping: torch.Tensor      # [num_tokens] int64, flat cache slot per token
    block_size: int
    sliding_window: int | None = None   # keys limited to the last W positions (itself included)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(ABC):
    """One implementation of paged attention (torch, triton, flashinfer, ...)."""

    name: str = "abstract"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        """Per-layer cache layout: block-major (a block's K and V are one contiguous page, so
        pages of a shared buffer can serve any KV cache group), token-major inside."""
        return (num_blocks, 2, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def plan(self, layout: BatchLayout, device: torch.device) -> Any:
        """Build per-step metadata once; every layer of the group reuses it."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k/v of this step into the cache, then attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        sinks: None, or [num_heads] logits (already in softmax units, not scaled) that join
        each query's softmax denominator as a key with no value: out = sum_j p_j v_j with
        p_j = exp(s_j) / (exp(sink_h) + sum_i exp(s_i)). A backend that cannot must raise.
        Returns [num_tokens, num_heads, head_dim].
        """

    # CUDA graphs (runtime/worker/cuda_graphs.py): a backend that sets `supports_cuda_graphs` keeps
    # a decode bucket's metadata in static tensors that a captured graph reads, re-planned
    # in place before each replay.
    supports_cuda_graphs: bool = False

    def graph_metadata(self, batch_size: int, max_pages_per_req: int, block_size: int,
                       sliding_window: int | None, device) -> Any:
        """Static metadata for decode steps of exactly `batch_size` requests."""
        raise NotImplementedError(f"the {self.name} backend does not support CUDA graphs")

    def plan_graph(self, meta: Any, layout: BatchLayout) -> None:
        """Re-plan `meta` (from graph_metadata) in place for a padded decode layout."""
        raise NotImplementedError(f"the {self.name} backend does not support CUDA graphs")


_BACKENDS: dict[str, str] = {"torch": "attention.torch_backend:TorchAttentionBackend",
                             "triton": "attention.triton_backend:TritonAttentionBackend",
                             "flashinfer": "attention.flashinfer_backend:FlashInferAttentionBackend"}


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    import importlib  # backends import their own heavy deps (triton, flashinfer) lazily
    return getattr(importlib.import_module(module), cls)()
