"""MultiprocExecutor: tensor-parallel ranks (or pipeline stages) as processes in one group.

Rank 0 is the engine's own process (its runner is `executor.runner`); ranks 1.. are worker
processes (spawned) that build the same shard layout (models/parallel.py), receive every
step's SchedulerOutput over their pipe from the engine and run it in lock step: the model's
collectives (gloo on CPU, NCCL on CUDA, with the group's timeout) keep the ranks together,
and only rank 0's sampled tokens leave the executor. The KV cache config is rank 0's, sent
to every worker, so all ranks hold their shard of each page under the same block ids.

Failure handling: every collective has the group's timeout (`parallel_timeout_s`); a worker
that dies (or raises) turns the next or current step into one `WorkerDiedError` naming its
rank, and every later step raises it too (the server's /health then answers 503); workers
exit when the engine's process is gone, and `shutdown` stops, joins and if need be kills them.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from models.parallel import TPGroup
from runtime.executor import Executor, WorkerDiedError, load_model
from runtime.executor.pipeline import PPModelRunner, pipeline_step
from runtime.worker.model_runner import ModelRunner, ModelRunnerOutput
from runtime.worker.sampler import SamplerOutput

log = logging.getLogger("zooinfer")
STARTUP_TIMEOUT_S = 600.0      # a worker's start (imports, its shard of the weights) at most this long


class TPModelRunner(ModelRunner):
    """A rank's runner: as ModelRunner, and a sampled (not greedy) step's tokens are rank 0's
    draw on every rank (broadcast), so each rank's persistent batch feeds the same next inputs."""

    def __init__(self, *args, tp: TPGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp = tp

    def _sample(self, hidden: torch.Tensor, meta) -> SamplerOutput:
        out = super()._sample(hidden, meta)     # greedy: every rank already has the same reduced tokens
        if not self._greedy_only(meta):
            out.token_ids = self.tp.broadcast(out.token_ids.contiguous(), 0)
        return out


def rank_device(device: str, rank: int) -> str:
    """CUDA ranks take one device each (cuda:rank); CPU ranks share the CPU."""
    return f"cuda:{rank}" if str(device) == "cuda" else str(device)


def init_group(rank: int, world: int, port: int, timeout_s: float, device: str) -> TPGroup:
    """A process group of its own (not torch.distributed's default one, so one process can
    hold several tensor-parallel engines): a TCP store served by rank 0 on `port`, gloo on
    CPU, NCCL on CUDA (unverified here), every collective under `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("zooinfer-tp", store)
    if str(device).startswith("cuda"):
        torch.cuda.set_device(rank_device(device, rank))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    return TPGroup(rank, world, group, store=store)


def _worker(rank: int, world: int, port: int, spec, config, dtype, threads: int, conn) -> None:
    """A worker rank's life: join the group, build its shard, then run what the engine sends."""
    torch.set_num_threads(threads)
    parent = os.getppid()
    try:
        device = rank_device(config.device, rank)
        conn.send(("ready", None))          # imported and alive: the engine may wait for the group now
        group = init_group(rank, world, port, config.parallel_timeout_s, config.device)
        model = _load(spec, config, dtype, device, group)
        runner = None
        conn.send(("ready", None))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:      # the engine's process is gone: so is this rank
                    return
                continue
            op, arg = conn.recv()
            if op == "step":
                run_step(runner, arg)
            elif op == "runner":
                kv_config, kwargs = arg
                runner = make_runner(model, kv_config, group, config, {**kwargs, "device": device})
                conn.send(("ready", None))
            elif op == "warm_up":
                runner.warm_up()
            elif op == "stop":
                return
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException as e:  # noqa: BLE001 - reported to the engine, then this rank exits
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (BrokenPipeError, OSError):
            pass
        os._exit(1)


def _pipeline(config) -> bool:
    return config.pipeline_parallel_size > 1


def _load(spec, config, dtype, device: str, group: TPGroup):
    """This rank's model: its tensor-parallel shard, or its pipeline stage."""
    if _pipeline(config):
        return load_model(spec, dtype, device, config.prepack_weights, pp=group, quantization=config.quantization)
    return load_model(spec, dtype, device, config.prepack_weights, tp=group, quantization=config.quantization)


def make_runner(model, kv_config, group: TPGroup, config, kwargs: dict) -> ModelRunner:
    if _pipeline(config):
        return PPModelRunner(model, kv_config, pp=group, **kwargs)
    return TPModelRunner(model, kv_config, tp=group, **kwargs)


def run_step(runner: ModelRunner, so) -> ModelRunnerOutput:
    """One step on this rank: pipeline stages in micro-batches, tensor-parallel ranks whole."""
    return pipeline_step(runner, so) if isinstance(runner, PPModelRunner) else runner.execute(so)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_workers(procs, conns, timeout: float = 5.0) -> None:
    """Ask each worker to stop, then join; terminate, then kill, what is still running."""
    for c in conns:
        try:
            c.send(("stop", None))
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        c.close()


class MultiprocExecutor(Executor):
    def __init__(self, spec, config, dtype: torch.dtype):
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        self.config = config
        self.what = "pipeline-parallel" if config.pipeline_parallel_size > 1 else "tensor-parallel"   # in errors
        self.timeout_s = config.parallel_timeout_s
        self.error: WorkerDiedError | None = None
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.procs, self.conns = [], []
        threads = torch.get_num_threads()
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, world, port, spec, config, dtype, threads, theirs),
                            name=f"zooinfer-tp{rank}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        try:
            self._wait_ready()              # every worker started (a failed import is an error now, not a timeout)
            self.tp = init_group(0, world, port, self.timeout_s, config.device)   # the rank group, TP or PP
            self.device = rank_device(config.device, 0)
            self.model = _load(spec, config, dtype, self.device, self.tp)
            self._wait_ready()
        except WorkerDiedError:
            self.shutdown()
            raise
        except Exception as e:
            err = self._failure(e)
            self.shutdown()
            raise err from e

    # ------------------------------------------------------------- failures
    def _dead(self) -> WorkerDiedError | None:
        """The first worker that has exited or reported an error, as the error to raise."""
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            msg = None
            try:
                while c.poll():
                    op, arg = c.recv()
                    if op == "error":
                        msg = arg
            except (EOFError, OSError):
                pass
            if msg is not None:
                return WorkerDiedError(f"{self.what} rank {rank} (pid {p.pid}) failed: {msg}")
            if p.exitcode is not None:
                return WorkerDiedError(f"{self.what} rank {rank} (pid {p.pid}) died with exit code {p.exitcode}")
        return None

    def _failure(self, e: BaseException) -> WorkerDiedError:
        """What a failed step or start-up becomes: the dead rank's error when one died (given a
        moment to be seen), else rank 0's own error."""
        deadline = time.monotonic() + 1.0
        dead = self._dead()
        while dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self._dead()
        self.error = dead or WorkerDiedError(
            f"{self.what} step failed on rank 0 with every worker still running (a stuck rank times out "
            f"after {self.timeout_s:g} s): {type(e).__name__}: {e}")
        return self.error

    def _check(self) -> None:
        if self.error is None:
            self.error = self._dead()
        if self.error is not None:
            raise self.error

    def _wait_ready(self) -> None:
        """Each worker's "ready" (or its error): at once when one exits, else within the
        start-up timeout (loading a large checkpoint can outlast a collective's timeout)."""
        limit = max(self.timeout_s, STARTUP_TIMEOUT_S)
        deadline = time.monotonic() + limit
        for rank, c in enumerate(self.conns, start=1):
            while not c.poll(0.1):
                if self.procs[rank - 1].exitcode is not None or time.monotonic() > deadline:
                    self.error = self._dead() or WorkerDiedError(
                        f"{self.what} rank {rank} not ready within {limit:g} s")
                    raise self.error
            op, arg = c.recv()
            if op != "ready":
                self.error = WorkerDiedError(f"{self.what} rank {rank} failed: {arg}")
                raise self.error

    def _broadcast(self, op: str, arg=None) -> None:
        for c in self.conns:
            c.send((op, arg))

    # ------------------------------------------------------------- the executor
    def init_runner(self, kv_config, **runner_kwargs) -> None:
        """Every rank's runner over the same KV cache config (rank 0's), so the same block ids."""
        try:
            self._check()
            self._broadcast("runner", (kv_config, runner_kwargs))
            self.runner = make_runner(self.model, kv_config, self.tp, self.config,
                                      {**runner_kwargs, "device": self.device})
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def warm_up(self) -> None:
        self._run("warm_up", None, self.runner.warm_up)

    def execute(self, so) -> ModelRunnerOutput:
        return self._run("step", so, lambda: run_step(self.runner, so))

    def _run(self, op: str, arg, own):
        self._check()
        try:
            self._broadcast(op, arg)
            return own()
        except Exception as e:
            raise self._failure(e) from e

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]
