"""ThreadGuard (runtime/thread_guard.py): intra-op threads follow the cores other processes
leave free, two agreeing periods per change, never below 1 or above the starting count, and a
count the user sets becomes the new ceiling. Driven by scripted run-queue samples and a fake
clock, so nothing depends on this machine's load."""
from __future__ import annotations

import pytest

from runtime.config import EngineConfig
from runtime.thread_guard import ThreadGuard, running_tasks


class Fake:
    def __init__(self, threads: int):
        self.threads, self.now, self.running, self.sets = threads, 0.0, 0, []

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def guard(self, cores: int) -> ThreadGuard:
        return ThreadGuard(cores=cores, period=1.0, read=lambda: self.running, clock=lambda: self.now,
                           get_threads=lambda: self.threads, set_threads=self.set)

    def periods(self, guard: ThreadGuard, others: float, n: int = 1, steps: int = 4) -> None:
        """n periods in which other tasks keep `others` threads runnable (our own threads on top)."""
        for _ in range(n):
            for i in range(steps):
                self.running = self.threads + int(others) + (1 if i < round((others % 1) * steps) else 0)
                self.now += 1.0 / steps
                guard.tick()


def test_busy_cores_take_threads_away_and_quiet_gives_them_back():
    f = Fake(threads=8)
    g = f.guard(cores=8)
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


def test_unknown_run_queue_changes_nothing():
    f = Fake(threads=2)
    g = ThreadGuard(cores=2, period=1.0, read=lambda: None, clock=lambda: f.now,
                    get_threads=lambda: f.threads, set_threads=f.set)
    for _ in range(10):
        f.now += 1.0
        g.tick()
    assert f.sets == []


def test_running_tasks_reads_the_run_queue():
    n = running_tasks()
    assert n is None or n >= 1                           # the reading thread itself is running


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
