"""EngineConfig: the knobs `LLM(...)` and the CLIs pass to the engine."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None        # explicit pool size; else sized from kv_cache_memory
    kv_cache_memory: int = 1 << 30          # bytes for the KV pool when num_kv_blocks is None
    max_model_len: int | None = None        # default and cap: the spec's max_model_len
    seed: int = 0
    dtype: str | None = None                # default: the spec's dtype
    attention_backend: str = "torch"
    device: str = "cpu"
    compile: bool = False                   # whole-model torch.compile, warmed up at engine start
    compile_cache_dir: str | None = None    # TORCHINDUCTOR_CACHE_DIR for compile; None: leave the env alone
    enable_prefix_caching: bool = True      # a hit must hold for every KV cache group (states: checkpoints)
    cuda_graphs: bool = False               # replay captured decode steps (device='cuda', flashinfer)
    cuda_graph_max_bs: int = 256            # largest captured decode batch (also <= max_num_seqs)
    prepack_weights: bool = True            # CPU float32 linears run on pre-packed weights (models/prepack.py)
    quantization: str | None = None         # override of the spec's quantization.method (models/quant_load.py)
    scheduling_policy: str = "fcfs"         # or "priority": requests' `priority`, lower first (runtime/scheduler.py)

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "cuda_graph_max_bs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        if self.compile_cache_dir is not None and not isinstance(self.compile_cache_dir, (str, os.PathLike)):
            raise ValueError(f"compile_cache_dir must be a path, got {self.compile_cache_dir!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if not isinstance(self.prepack_weights, bool):
            raise ValueError(f"prepack_weights must be True or False, got {self.prepack_weights!r}")
        if self.quantization is not None:
            from models.spec import QUANT_METHODS
            if self.quantization not in QUANT_METHODS:
                raise ValueError(f"quantization must be one of {', '.join(QUANT_METHODS)}, got {self.quantization!r}")
        if self.cuda_graphs and not str(self.device).startswith("cuda"):
            raise ValueError(f"cuda_graphs=True needs device='cuda', got device={self.device!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
