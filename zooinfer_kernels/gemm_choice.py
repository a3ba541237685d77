"""Which fp32 GEMM the linears use, chosen by measuring the candidates on this CPU once per process.

The fastest kernel differs between the machines this project runs on. On an Intel Sapphire
Rapids MKL sgemm runs its AVX-512 kernels and overtakes the C++ panel GEMM past ~64 rows; on an
AMD EPYC Zen 4 MKL runs its AVX2 code, and with one thread (CPU time, 2048 x 576 x 3072 and the
other SmolLM2 / tiny Llama prefill shapes) the blocked panel kernel (`gemm.panel_linear_blocked`)
reached 84-103 GFLOP/s where `F.linear` reached 61-90, and at 64-512 rows even the decode panel
kernel beat MKL's packed GEMM on weights that stay cached. So instead of a table keyed by CPU
vendor, `choice()` times the candidates at start-up on two small products (about 0.1 s of CPU time
in all) and keeps the winners:
- `large`: the kernel for products of more than `prepack.PANEL_MAX_ROWS` rows (prefill chunks):
  "blocked" (the blocked panel kernel on the linear's panels) or "mkl" (`F.linear`), timed at
  `LARGE_SHAPE`; MKL needs to be `MKL_MARGIN` faster to win. Blocked agrees bit for bit with the
  decode panel kernel (a prompt's logits do not depend on how it was chunked), and on Zen 4 the two
  measured within 1-10% of each other, so without a margin the probe picked either from one process
  to the next (two server starts on one machine gave different fp32 roundings);
- `panels_in_cache`: whether the panel kernel beat MKL's packed GEMM (`_mkl_linear`) at
  `SMALL_SHAPE` on a cached weight, i.e. whether models whose weights fit the last-level cache
  get panels too (`prepack.choose_kind`).
The probe runs on one thread and times each run on that thread's CPU clock (`time.thread_time`),
best of `REPEATS` alternating runs: on a machine shared with other work the wall clock says more
about the neighbours than about the kernels (with the load average at 27 on 2 cores, wall-clock
probes picked either kernel at random), while a thread's CPU time only grows with what it
executes and the cache misses others cause it. Which kernel is faster per core is what decides;
the engine's thread count only splits the same work. `ZOOINFER_PREFILL_GEMM=blocked|mkl` forces
`large` (and with it `panels_in_cache`: blocked needs panels, mkl keeps the cache-size rule);
the forced value is what tests use to run each path, the fallback included.
The choice is printed by `zooinfer_kernels.cpu_features.describe()` ("prefill_gemm ...").
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build, gemm

ENV = "ZOOINFER_PREFILL_GEMM"
CHOICES = ("blocked", "mkl")
LARGE_SHAPE = (512, 512, 1024)   # (rows, K, N): a prefill-sized product on a 2 MB weight
SMALL_SHAPE = (32, 512, 1024)    # a decode-sized one on the same weight
REPEATS = 7
MKL_MARGIN = 1.05                # MKL must beat blocked by this factor to be chosen for large products

_lock = threading.Lock()
_choice: list = []


@dataclass(frozen=True)
class GemmChoice:
    large: str                                   # "blocked" or "mkl"
    panels_in_cache: bool                        # panels beat MKL packed on a cached weight
    source: str                                  # "measured", "forced" or "no kernel library"
    gflops: dict[str, float] = field(default_factory=dict)   # what the probe measured

    def describe(self) -> str:
        rates = ", ".join(f"{k} {v:.0f}" for k, v in self.gflops.items())
        return f"{self.large} ({self.source}{'; GFLOP/s ' + rates if rates else ''})"


def _best(fns: dict, flops: int) -> dict[str, float]:
    """GFLOP/s of each function from its best of REPEATS runs on one thread (thread CPU time),
    the functions alternating."""
    best = {name: float("inf") for name in fns}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fn in fns.values():   # first calls allocate and fault pages in: not timed
            fn()
        for _ in range(REPEATS):
            for name, fn in fns.items():
                t0 = time.thread_time()
                fn()
                best[name] = min(best[name], max(time.thread_time() - t0, 1e-9))
    finally:
        torch.set_num_threads(threads)
    return {name: flops / t / 1e9 for name, t in best.items()}


def _measure() -> GemmChoice:
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in CHOICES:
        raise ValueError(f"{ENV}={forced!r}: must be one of {', '.join(CHOICES)}")
    if not cpu_build.available():
        return GemmChoice("mkl", False, "no kernel library")
    if forced:
        return GemmChoice(forced, forced == "blocked", "forced")
    gen = torch.Generator().manual_seed(0)
    m, k, n = LARGE_SHAPE
    w = torch.randn(n, k, generator=gen)
    panels = gemm.pack_panels(w)
    x = torch.randn(m, k, generator=gen)
    with torch.no_grad():
        large = _best({"blocked": lambda: gemm.panel_linear_blocked(x, panels, n, None),
                       "mkl": lambda: F.linear(x, w)}, 2 * m * k * n)
        rates = {f"{m}-row blocked": large["blocked"], f"{m}-row mkl": large["mkl"]}
        panels_in_cache = False
        if hasattr(torch.ops.mkl, "_mkl_linear") and getattr(torch._C, "has_mkl", False):
            ms = SMALL_SHAPE[0]
            xs = x[:ms].contiguous()
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w, ms)
            small = _best({"panel": lambda: gemm.panel_linear(xs, panels, n, None),
                           "mkl": lambda: torch.ops.mkl._mkl_linear(xs, packed, w, None, ms)}, 2 * ms * k * n)
            rates.update({f"{ms}-row panel": small["panel"], f"{ms}-row mkl packed": small["mkl"]})
            panels_in_cache = small["panel"] > small["mkl"]
    large_kind = "mkl" if large["mkl"] > MKL_MARGIN * large["blocked"] else "blocked"
    return GemmChoice(large_kind, panels_in_cache, "measured", rates)


def choice() -> GemmChoice:
    """The measured (or forced) choice; measured on the first call of the process. An invalid ZOOINFER_PREFILL_GEMM is a ValueError naming it."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced or not cpu_build.enabled():   # read on every call, so tests can switch paths
        return _measure()
    if not _choice:
        with _lock:
            if not _choice:
                _choice.append(_measure())
    return _choice[0]


def large_rows_use_blocked() -> bool:
    """Whether products past `prepack.PANEL_MAX_ROWS` rows run the blocked panel kernel."""
    return choice().large == "blocked"
