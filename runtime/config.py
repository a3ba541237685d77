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
    kv_cache_dtype: str = "auto"            # attention K/V pages: auto (model dtype), float32, bfloat16, int8, fp8_e4m3
    attention_backend: str = "torch"
    device: str = "cpu"
    compile: bool = False                   # whole-model torch.compile, warmed up at engine start
    compile_cache_dir: str | None = None    # TORCHINDUCTOR_CACHE_DIR for compile; None: leave the env alone
    enable_prefix_caching: bool = True      # a hit must hold for every KV cache group (states: checkpoints)
    cuda_graphs: bool = False               # replay captured decode steps (device='cuda', flashinfer)
    cuda_graph_max_bs: int = 256            # largest captured decode batch (also <= max_num_seqs)
    prepack_weights: bool = True            # CPU float32 linears run on pre-packed weights (models/prepack.py)
    adaptive_threads: bool = True           # CPU: fewer intra-op threads while other processes hold the cores (runtime/thread_guard.py)
    quantization: str | None = None         # override of the spec's quantization.method (models/quant_load.py)
    quantization_activations: str | None = None   # override of the spec's quantization.activations (float32 / int8 / int8_bf16)
    scheduling_policy: str = "fcfs"         # or "priority": requests' `priority`, lower first (runtime/scheduler.py)
    # Speculative decoding: {"method": "ngram", "num_speculative_tokens": k, ...} (runtime/spec_decode);
    # None: the spec's `speculative:` section, if any. {"method": None} turns that off.
    speculative: dict | str | None = None
    tensor_parallel_size: int = 1           # ranks sharding the model (runtime/executor, models/parallel.py)
    pipeline_parallel_size: int = 1         # stages of contiguous layers, one process each (models/pipeline.py)
    parallel_timeout_s: float = 60.0        # every collective's timeout; a dead rank is an error by then
    # KV tiers below the pool (cache/tiers/, runtime/kv_tiers.py); all off by default.
    kv_host_tier_bytes: int = 0             # host RAM tier (0: none); also holds swapped-out requests
    kv_disk_tier_dir: str | None = None     # local disk tier: survives restarts, shared by processes
    kv_disk_tier_bytes: int = 16 << 30
    kv_remote_tier_url: str | None = None   # redis://host:port shared by several engines
    kv_tier_write_through: bool = False     # also store each new block in the disk / remote tiers at once
    kv_tier_salt: str = ""                  # part of the tiers' fingerprint: keeps deployments apart
    preemption_mode: str = "auto"           # recompute | swap | auto: swap from swap_min_tokens computed
    swap_min_tokens: int = 256
    # Most logprobs per token a request may ask for (vLLM's --max-logprobs; -1 asks for the whole
    # vocabulary, so it needs this >= the vocabulary size; runtime/vocab_logprobs.py).
    max_logprobs: int = 20

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
        from cache.kv_dtype import check_kv_cache_dtype
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if not isinstance(self.adaptive_threads, bool):
            raise ValueError(f"adaptive_threads must be a bool, got {self.adaptive_threads!r}")
        if not isinstance(self.prepack_weights, bool):
            raise ValueError(f"prepack_weights must be True or False, got {self.prepack_weights!r}")
        if self.quantization is not None:
            from models.spec import QUANT_METHODS
            if self.quantization not in QUANT_METHODS:
                raise ValueError(f"quantization must be one of {', '.join(QUANT_METHODS)}, got {self.quantization!r}")
        if self.quantization_activations is not None:
            from models.spec import QUANT_ACTIVATIONS
            if self.quantization_activations not in QUANT_ACTIVATIONS:
                raise ValueError(f"quantization_activations must be one of {', '.join(QUANT_ACTIVATIONS)}, "
                                 f"got {self.quantization_activations!r}")
        if self.cuda_graphs and not str(self.device).startswith("cuda"):
            raise ValueError(f"cuda_graphs=True needs device='cuda', got device={self.device!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size cannot both exceed 1 yet")
        if not isinstance(self.parallel_timeout_s, (int, float)) or not self.parallel_timeout_s > 0:
            raise ValueError(f"parallel_timeout_s must be a positive number, got {self.parallel_timeout_s!r}")
        if max(self.tensor_parallel_size, self.pipeline_parallel_size) > 1 and \
                (self.kv_host_tier_bytes or self.kv_disk_tier_dir or self.kv_remote_tier_url):
            raise ValueError("KV tiers are not supported with tensor / pipeline parallel yet (the tier copies run "
                             "in the engine's process only)")
        if max(self.tensor_parallel_size, self.pipeline_parallel_size) > 1 and (self.compile or self.cuda_graphs):
            raise ValueError("tensor / pipeline parallel runs eager: compile and cuda_graphs are not supported with "
                             "it yet")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
