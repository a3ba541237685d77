"""Executors: what runs the model for the engine, one step at a time (vLLM's executor layer).

The engine keeps the scheduler, the KV cache manager and the block ids; an executor owns the
model and its runner(s) and answers `execute(SchedulerOutput) -> ModelRunnerOutput`.
`UniprocExecutor` is the one-process engine as before. `MultiprocExecutor`
(tensor_parallel_size or pipeline_parallel_size > 1) runs rank 0 in the engine's process and
starts one worker process per other rank, joined in a torch.distributed group (gloo on CPU,
NCCL on CUDA); each rank holds its shard of the model (or its stage's layers) and of every KV
page under the same block ids, gets each step's SchedulerOutput from the engine, and only
rank 0's sampled tokens come back.
"""
from __future__ import annotations

import logging

import torch

from models import build_model, load_weights
from models.builder import CausalLM
from models.parallel import TPGroup, install_reductions, tp_model
from models.pipeline import PPStageModel, free_other_stages
from models.prepack import prepack_linears
from models.quant_load import apply_quantization
from runtime.worker.model_runner import ModelRunner, ModelRunnerOutput

log = logging.getLogger("zooinfer")


class WorkerDiedError(RuntimeError):
    """A worker rank is gone or failed: the executor cannot run another step."""


def load_model(spec, dtype: torch.dtype, device: str, prepack: bool, tp: TPGroup | None = None,
               pp: TPGroup | None = None, quantization: str | None = None):
    """The model (this rank's tensor-parallel shard when `tp` has more than one rank; this
    rank's pipeline stage when `pp` has), weights loaded, linears packed when `prepack`,
    row-parallel outputs reduced, other stages' weights dropped."""
    model = build_model(spec, device, dtype, cls=PPStageModel if pp is not None else CausalLM)
    load_weights(model, spec)
    _quantize(model, spec, quantization, parallel=(tp is not None and tp.size > 1) or pp is not None)
    reduced: list[str] = []
    if tp is not None and tp.size > 1:
        model, reduced = tp_model(model, tp)
    if pp is not None:
        model.init_stage(pp)
    if prepack:       # only CPU float32 linears qualify; a no-op elsewhere
        packed = prepack_linears(model)
        if packed:
            log.info("packed %d linear weights", packed)
    if reduced:
        install_reductions(model, reduced, tp)
    if pp is not None:
        free_other_stages(model)
    return model


def _quantize(model, spec, quantization: str | None, parallel: bool) -> None:
    """The spec's (or the engine's) quantization (models/quant_load.py). Sharded models keep
    float weights: asked for explicitly that is an error, a spec default is skipped with a warning."""
    method = spec.quantization.method if quantization is None else quantization
    if method == "none":
        return
    if parallel:
        if quantization is not None:
            raise ValueError(f"quantization {method!r} does not combine with tensor / pipeline parallelism yet")
        log.warning("%s: quantization %s skipped under tensor / pipeline parallelism (float weights)",
                    spec.name, method)
        return
    done = apply_quantization(model, spec, method)
    log.info("quantized %d linears (%s)", len(done), ", ".join(sorted(set(done.values()))))


class Executor:
    """The interface the engine drives: `model` (rank 0's), `init_runner`, `execute`, `shutdown`."""
    model = None
    runner: ModelRunner | None = None
    tp: TPGroup | None = None

    def init_runner(self, kv_config, **runner_kwargs) -> None:
        raise NotImplementedError

    def execute(self, so) -> ModelRunnerOutput:
        raise NotImplementedError

    def warm_up(self) -> None:
        self.runner.warm_up()

    def shutdown(self) -> None:
        """Stop what the executor started (idempotent)."""


class UniprocExecutor(Executor):
    """The model and its runner in the engine's process (tensor_parallel_size 1)."""

    def __init__(self, spec, config, dtype: torch.dtype):
        self.model = load_model(spec, dtype, config.device, config.prepack_weights,
                                quantization=config.quantization)

    def init_runner(self, kv_config, **runner_kwargs) -> None:
        self.runner = ModelRunner(self.model, kv_config, **runner_kwargs)

    def execute(self, so) -> ModelRunnerOutput:
        return self.runner.execute(so)


def make_executor(spec, config, dtype: torch.dtype) -> Executor:
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return UniprocExecutor(spec, config, dtype)
    from runtime.executor.multiproc import MultiprocExecutor
    return MultiprocExecutor(spec, config, dtype)


__all__ = ["Executor", "MultiprocExecutor", "UniprocExecutor", "WorkerDiedError", "load_model", "make_executor"]


def __getattr__(name):
    if name == "MultiprocExecutor":
        from runtime.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor
    raise AttributeError(name)
