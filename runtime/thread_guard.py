"""ThreadGuard: fewer intra-op threads while other processes hold the cores.

torch's CPU ops split their work over OpenMP threads that meet at a barrier at the end of
every parallel region, and a decode step has a few hundred regions. When other processes keep
the cores busy, one of our threads is often descheduled, and every region then waits for it to
be scheduled again (a scheduler slice, milliseconds) while the others spin. Measured on 2 cores
with other jobs keeping about 4.5 threads runnable (load average 6.4-6.8): a quantized SmolLM2
generation took 8.2 s on 2 threads and 4.1 s on 1 (its first request 11.7 s against 1.4 s);
OpenVINO's TBB pool degrades far less. On a quiet machine the second thread is a clear win.

So once per `period` seconds the guard measures how much CPU *other* processes used on the
cores this process may run on (their busy time in /proc/stat, minus this process's own CPU
time, over the period's wall time) and sets torch's thread count to the cores left free
(another process busy three quarters of the time counts as one), between 1 and the count the
engine started with (or the count the user set since). Every thread of this process is ours
and never counts as another's: spinning OpenMP workers, a server's asyncio thread streaming
tokens. (A first version sampled the run queue at each step and took everything runnable
past our intra-op threads for other work; in the server the asyncio thread and the load
client counted as a busy core on a quiet machine, and the guard dropped to one thread for
good: 98 served tok/s against 175 offline.) Threads go at the first period that finds the
cores taken (under contention one step takes seconds, more than a few seconds on fewer
threads would cost); they come back only when two periods in a row agree, so a burst costs at
most two periods on fewer threads. Only time the engine spends stepping is judged: after an
idle gap between steps (`IDLE` seconds or more) the period starts afresh, so what other
processes did while the engine waited for work does not count (a load client importing its
libraries for 8 s before it sent the first request had put the served run on one thread for its
first 8 s: 117 tok/s against 128 without the guard). Each change is logged.
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
IDLE = 0.1          # seconds between one step's end and the next step's start that count as idle


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 100


CLK_TCK = _clock_ticks()


def busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds the `cpus` spent busy since boot (user, nice, system, irq, softirq; not idle,
    iowait or the hypervisor's steal), or None where /proc/stat is unreadable."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    ticks, seen = 0, 0
    for line in lines:
        if not line.startswith(b"cpu") or line[3:4] == b" ":
            continue
        name, *fields = line.split()
        try:
            cpu = int(name[3:])
            if cpu in cpus:
                user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
                ticks += user + nice + system + irq + softirq
                seen += 1
        except ValueError:
            return None
    return ticks / CLK_TCK if seen else None


def others_cpu_seconds() -> float | None:
    """Busy CPU seconds of everything but this process on the cores it may run on, since boot
    (only differences mean anything), or None where unknown."""
    busy = busy_seconds(os.sched_getaffinity(0))
    return None if busy is None else busy - time.process_time()


def env_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class ThreadGuard:
    """Call `tick()` once per engine step on the thread that runs the forward (torch's thread
    count is that thread's OpenMP setting) and `ended()` after it; between period ends both
    only read the clock."""

    __slots__ = ("max_threads", "cores", "period", "_read", "_clock", "_get", "_set",
                 "_last", "_due", "_pending", "_expected", "_ended")

    def __init__(self, max_threads: int | None = None, cores: int | None = None, period: float = 2.0,
                 read: Callable[[], float | None] = others_cpu_seconds, clock: Callable[[], float] = time.monotonic,
                 get_threads: Callable[[], int] = torch.get_num_threads,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self._get, self._set, self._read, self._clock = get_threads, set_threads, read, clock
        self.max_threads = max_threads or get_threads()
        self.cores = cores or len(os.sched_getaffinity(0))
        self.period = period
        self._last = (clock(), read())          # (when, others' CPU seconds) at the period's start
        self._due = self._last[0] + period
        self._pending: int | None = None
        self._expected = self.max_threads       # the count we last saw or set
        self._ended: float | None = self._last[0]   # when the last step ended (idle until the first)

    def ended(self) -> None:
        self._ended = self._clock()

    def tick(self) -> None:
        now = self._clock()
        if self._ended is not None and now - self._ended >= IDLE:    # idle since: a fresh period
            self._last, self._due, self._ended = (now, self._read()), now + self.period, None
            return
        if now < self._due:
            return
        used, (t0, used0) = self._read(), self._last
        self._last, self._due = (now, used), now + self.period
        if used is None or used0 is None or now <= t0:
            return
        threads = self._get()
        if threads != self._expected:      # the user set a count since: that is the new ceiling
            self.max_threads = self._expected = threads
            self._pending = None
        others = max(0.0, used - used0) / (now - t0)      # cores other processes kept busy
        target = min(self.max_threads, max(1, self.cores - int(others + 0.25)))   # 0.75 of a core counts
        if target == threads:
            self._pending = None
        elif target < threads or self._pending == target:
            log.info("other processes kept %.1f cores busy of %d: intra-op threads %d -> %d",
                     others, self.cores, threads, target)
            self._set(target)
            self._expected, self._pending = target, None
        else:
            self._pending = target
