"""ThreadGuard: fewer intra-op threads while other processes hold the cores.

torch's CPU ops split their work over OpenMP threads that meet at a barrier at the end of
every parallel region, and a decode step has a few hundred regions. When other processes keep
the cores busy, one of our threads is often descheduled, and every region then waits for it to
be scheduled again (a scheduler slice, milliseconds) while the others spin. Measured on 2 cores
with other jobs keeping about 4.5 threads runnable (load average 6.4-6.8): a quantized SmolLM2
generation took 8.2 s on 2 threads and 4.1 s on 1 (its first request 11.7 s against 1.4 s);
OpenVINO's TBB pool degrades far less. On a quiet machine the second thread is a clear win.

So once per `period` seconds the guard compares the cores this process may run on with how
many threads *other* tasks keep runnable (the instantaneous running count of /proc/loadavg,
sampled at every engine step, minus our own intra-op threads, averaged over the period) and
sets torch's thread count to the cores left free (another task runnable three quarters of the
time counts as one), between 1 and the count the engine started with (or the count the user
set since). Threads go at the first period that finds the cores taken (under contention one step
takes seconds, more than a few seconds on fewer threads would cost); they come back only when
two periods in a row agree, so a burst costs at most two periods on fewer threads. Each change
is logged.
`ZOOINFER_ADAPTIVE_THREADS=0` (or `EngineConfig.adaptive_threads=False`) turns it off; it only
runs for CPU engines in one process (tensor/pipeline-parallel ranks keep their own threads).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ENV = "ZOOINFER_ADAPTIVE_THREADS"


def running_tasks() -> int | None:
    """Tasks runnable right now, system-wide (including the caller), or None where unknown."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None


def env_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class ThreadGuard:
    """Call `tick()` once per engine step on the thread that runs the forward (torch's thread
    count is that thread's OpenMP setting)."""

    __slots__ = ("max_threads", "cores", "period", "_read", "_clock", "_get", "_set",
                 "_sum", "_n", "_due", "_pending", "_expected")

    def __init__(self, max_threads: int | None = None, cores: int | None = None, period: float = 2.0,
                 read: Callable[[], int | None] = running_tasks, clock: Callable[[], float] = time.monotonic,
                 get_threads: Callable[[], int] = torch.get_num_threads,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self._get, self._set, self._read, self._clock = get_threads, set_threads, read, clock
        self.max_threads = max_threads or get_threads()
        self.cores = cores or len(os.sched_getaffinity(0))
        self.period = period
        self._sum, self._n = 0.0, 0
        self._due = clock() + period
        self._pending: int | None = None
        self._expected = self.max_threads       # the count we last saw or set

    def tick(self) -> None:
        running = self._read()
        if running is None:
            return
        threads = self._get()
        if threads != self._expected:      # the user set a count since: that is the new ceiling
            self.max_threads = self._expected = threads
            self._pending = None
        self._sum += max(0, running - threads)
        self._n += 1
        if self._clock() < self._due:
            return
        others = self._sum / self._n
        self._sum, self._n = 0.0, 0
        self._due = self._clock() + self.period
        target = min(self.max_threads, max(1, self.cores - int(others + 0.25)))   # 0.75 of a thread counts
        if target == threads:
            self._pending = None
        elif target < threads or self._pending == target:
            log.info("other processes keep %.1f threads runnable on %d cores: intra-op threads %d -> %d",
                     others, self.cores, threads, target)
            self._set(target)
            self._expected, self._pending = target, None
        else:
            self._pending = target
