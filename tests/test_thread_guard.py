"""ThreadGuard (runtime/thread_guard.py): intra-op threads follow the cores other processes
leave free, two agreeing periods per change, never below 1 or above the starting count, and a
count the user sets becomes the new ceiling. Driven by scripted CPU times of other processes
and a fake clock, so nothing depends on this machine's load; the readers of /proc/stat are
checked against this process's own busy loop."""
from __future__ import annotations

import pytest

from runtime.config import EngineConfig
import os
import time

from runtime.thread_guard import ThreadGuard, busy_seconds, others_cpu_seconds


class Fake:
    def __init__(self, threads: int):
        self.threads, self.now, self.others, self.sets = threads, 0.0, 0.0, []

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def guard(self, cores: int) -> ThreadGuard:
        return ThreadGuard(cores=cores, period=1.0, read=lambda: self.others, clock=lambda: self.now,
                           get_threads=lambda: self.threads, set_threads=self.set)

    def periods(self, guard: ThreadGuard, others: float, n: int = 1, steps: int = 4) -> None:
        """n periods in which other processes keep `others` cores busy while the engine steps
        back to back (each step takes the whole 1 / steps of a period)."""
        for _ in range(n):
            for _ in range(steps):
                guard.tick()
                self.now += 1.0 / steps
                self.others += others / steps
                guard.ended()
            guard.tick()                                 # the next step starts: the period is judged


def test_busy_cores_take_threads_away_and_quiet_gives_them_back():
    f = Fake(threads=8)
    g = f.guard(cores=8)
    g.tick()                                             # the first step: the first period starts
    f.periods(g, others=0.0, n=3)
    assert f.sets == []                                  # quiet: every thread stays
    f.periods(g, others=3.0)
    assert f.sets == [5] and f.threads == 5              # at once: 8 cores - 3 busy
    f.periods(g, others=20.0)
    assert f.threads == 1                                # never below one
    f.periods(g, others=0.0)
    assert f.threads == 1                                # one quiet period is not enough to come back
    f.periods(g, others=0.0)
    assert f.threads == 8 and f.sets == [5, 1, 8]        # back to the starting count, not above


def test_a_burst_costs_at_most_two_periods_and_a_fraction_counts_from_three_quarters():
    f = Fake(threads=2)
    g = f.guard(cores=2)
    f.periods(g, others=0.5, n=3)
    assert f.sets == []                                  # half a thread: keep both
    f.periods(g, others=0.75)
    assert f.sets == [1]
    for others in (0.0, 1.0, 0.0, 1.0):                  # quiet periods never two in a row: stay at 1
        f.periods(g, others=others)
    assert f.sets == [1]
    f.periods(g, others=0.0, n=2)
    assert f.sets == [1, 2]


def test_a_count_the_user_sets_is_the_new_ceiling():
    f = Fake(threads=4)
    g = f.guard(cores=4)
    f.threads = 2                                        # torch.set_num_threads(2) by the user
    f.periods(g, others=0.0, n=3)
    assert f.sets == [] and g.max_threads == 2           # not raised back to 4


def test_unknown_cpu_times_change_nothing():
    f = Fake(threads=2)
    g = ThreadGuard(cores=2, period=1.0, read=lambda: None, clock=lambda: f.now,
                    get_threads=lambda: f.threads, set_threads=f.set)
    for _ in range(10):
        f.now += 1.0
        g.tick()
    assert f.sets == []


def test_ticks_between_period_ends_read_nothing():
    f, reads = Fake(threads=2), []
    g = ThreadGuard(cores=2, period=1.0, read=lambda: reads.append(f.now) or 0.0, clock=lambda: f.now,
                    get_threads=lambda: f.threads, set_threads=f.set)
    for _ in range(16):
        g.tick()
        f.now += 0.25
        g.ended()
    assert reads == [0.0, 1.0, 2.0, 3.0]   # construction, then one read per period end


def test_what_others_do_while_the_engine_idles_does_not_count():
    f = Fake(threads=2)
    g = f.guard(cores=2)
    f.now += 8.0
    f.others += 8.0                                      # a client starting up: one core busy for 8 s
    f.periods(g, others=0.0, n=3)                        # then the engine steps on a quiet machine
    assert f.sets == []
    g.tick()
    f.now += 0.05                                        # a step
    g.ended()
    f.now += 0.05                                        # a gap under IDLE: still stepping
    f.others += 0.1 + 2.0
    f.periods(g, others=0.0)                             # so this period saw the busy core
    assert f.sets == [1]
    f.now += 5.0
    f.others += 10.0                                     # busy while idle again, then quiet steps
    f.periods(g, others=0.0, n=2)
    assert f.sets == [1, 2]


def test_this_process_is_not_another():
    """Our own busy loop raises the cores' busy time but not what counts as other processes'."""
    cpus = os.sched_getaffinity(0)
    busy0, others0, t0 = busy_seconds(cpus), others_cpu_seconds(), time.process_time()
    if busy0 is None:
        pytest.skip("no /proc/stat")
    while time.process_time() - t0 < 0.5:
        pass
    spun = time.process_time() - t0
    busy, others = busy_seconds(cpus) - busy0, others_cpu_seconds() - others0
    assert busy >= 0.8 * spun - 0.05                       # the loop shows as busy time (10 ms ticks)
    assert others < busy - 0.5 * spun                      # and most of it is ours, not another's


@pytest.mark.parametrize("env, enabled", [("1", True), ("0", False)])
def test_engine_has_a_guard_unless_turned_off(tiny_hf, monkeypatch, env, enabled):
    from runtime.engine import Engine
    path = tiny_hf("llama")[0]
    monkeypatch.setenv("ZOOINFER_ADAPTIVE_THREADS", env)
    assert (Engine(path, EngineConfig(max_model_len=128))._thread_guard is not None) is enabled
    monkeypatch.setenv("ZOOINFER_ADAPTIVE_THREADS", "1")
    assert Engine(path, EngineConfig(max_model_len=128, adaptive_threads=False))._thread_guard is None
    with pytest.raises(ValueError, match="adaptive_threads"):
        EngineConfig(adaptive_threads="yes").validate()
