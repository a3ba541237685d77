"""Clocks for speculative decoding's cost model that time device work, not its launch.

On CUDA a forward returns once its kernels are queued, so `time.perf_counter()` around it
measures the launch. `device_clock` synchronizes the device before it reads the time, so
an interval between two of its readings covers the device work queued in it. On the CPU
it is `time.perf_counter` itself (nothing to wait for). The CUDA branch is unverified on
this project's CPU-only machines.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def device_clock(device) -> Callable[[], float]:
    """A clock (seconds) that first waits for the queued work of `device` when it is CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(dev)
        return time.perf_counter()
    return clock
