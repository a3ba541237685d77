"""What this CPU can do and which kernel path each hot op takes on it, measured at start-up.

The machines change from one day to the next (Sapphire Rapids with AMX, AMD EPYC Zen 4 with
avx512_bf16 and no AMX, AVX2 laptops), and the speed of a run depends on which path ran. So
the choice is made from what the running process can actually use, never assumed:
- the CPU's model and its SIMD flags (/proc/cpuinfo, as Linux reports them after its own
  CPUID checks);
- the kernel library's build (`-march=native`, or the portable `-O3` retry, or none) and
  what the built code found at run time (the screen's CPUID checks, Linux's grant of AMX tile
  state: `lm_head.usable_screen_isas`);
- the path each op then takes: the greedy head's bf16 screen (`lm_head.screen_isa`, which
  also honours ZOOINFER_SCREEN_ISA), the linear layers (C++ panel GEMM / MKL packed GEMM /
  torch), paged attention (C++ kernels / torch).

`describe()` is one line of all that; the engine logs it once per process (`log_once`), and
every bench table prints it (`bench.throughput`, `bench.greedy_head`, the pytest-benchmark
suites' extra_info through `summary()`).
"""
from __future__ import annotations

import logging
import platform
import threading
from functools import lru_cache
from pathlib import Path

from zooinfer_kernels import cpu_build

# The flags that decide a kernel path, in the order they are printed.
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")

_logged = threading.Event()


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, every flag) of the first processor in /proc/cpuinfo; the platform's
    processor string and no flags where there is none (not Linux)."""
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model name", "Hardware") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
            if model and flags:
                break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's model name, e.g. "AMD EPYC" or "Intel(R) Xeon(R) Platinum 8480+"."""
    return _cpuinfo()[0]


def cpu_flags() -> list[str]:
    """The path-deciding flags (`FLAGS`) this CPU reports, in `FLAGS` order."""
    have = _cpuinfo()[1]
    return [f for f in FLAGS if f in have]


def kernel_paths() -> dict[str, str]:
    """The path each hot op takes in this process: "library" (the C++ kernels' build: "native",
    "portable" or "off"), "greedy_screen" (the LM head's bf16 screen: "amx", "avx512_bf16",
    "avx2" or "none"), "linear" (what prepacked linears can use: the C++ panel GEMM and/or
    MKL's packed GEMM, "panel+mkl", "panel", "mkl", else "torch"), "prefill_gemm" (products past
    64 rows: "blocked" or "mkl", with how it was chosen and the probe's GFLOP/s),
    "int8_activations" (the products of `activations: int8`, zooinfer_kernels/quant_gemm.py: "avx512_vnni",
    "avx2" or "none": the exact fp32 product instead), "bf16_prefill" (the products of `activations:
    int8_bf16` from `quant_gemm.BF16_MIN_ROWS` rows: "amx", else "int8" or "none" as above) and "attention" ("cpp" or
    "torch")."""
    import torch

    from zooinfer_kernels import gemm_choice, lm_head, quant_gemm
    built = cpu_build.available()
    lib = cpu_build.library_path() or ""
    library = ("native" if "native" in Path(lib).name else "portable") if built else "off"
    try:
        screen = lm_head.screen_isa() or "none"
    except ValueError as e:       # a ZOOINFER_SCREEN_ISA this CPU cannot run: say so, don't fail a log line
        screen = f"invalid ({e})"
    mkl = torch.backends.mkl.is_available()
    linear = "+".join(p for p, ok in (("panel", built), ("mkl", mkl)) if ok) or "torch"
    try:
        prefill = gemm_choice.choice().describe()
    except ValueError as e:       # an invalid ZOOINFER_PREFILL_GEMM: say so here, the engine raises it
        prefill = f"invalid ({e})"
    int8_act = quant_gemm.Q8_ISA_NAMES.get(quant_gemm.q8_best_isa(), "none") if built else "none"
    bf16_prefill = "amx" if built and quant_gemm.bf16_amx_available() else "int8" if int8_act != "none" else "none"
    return {"library": library, "greedy_screen": screen, "linear": linear, "prefill_gemm": prefill,
            "int8_activations": int8_act, "bf16_prefill": bf16_prefill, "attention": "cpp" if built else "torch"}


def summary() -> dict[str, object]:
    """CPU model, flags and kernel paths as one dict (for JSON results and benchmark extra_info)."""
    return {"cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "kernel_paths": kernel_paths()}


def describe() -> str:
    """One line: the CPU model, its path-deciding flags (and the missing ones), the paths."""
    flags = cpu_flags()
    missing = [f for f in FLAGS if f not in flags]
    paths = ", ".join(f"{k} {v}" for k, v in kernel_paths().items())
    return (f"CPU {cpu_model()} [{' '.join(flags) or 'no SIMD flags reported'}"
            f"{'; no ' + ' '.join(missing) if missing else ''}]; kernels: {paths}")


def log_once(log: logging.Logger) -> None:
    """Log `describe()` at INFO the first time any engine of this process starts."""
    if not _logged.is_set():
        _logged.set()
        log.info("%s", describe())
