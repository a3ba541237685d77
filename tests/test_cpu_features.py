"""The start-up capability report (`zooinfer_kernels.cpu_features`): the flags match /proc/cpuinfo, the
paths match what the kernels actually choose (the greedy screen, the library build, the
fallbacks when the library is off or a set is forced), and the engine logs it exactly once."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from zooinfer_kernels import cpu_build, cpu_features, lm_head

needs_kernels = pytest.mark.skipif(shutil.which("c++") is None or not cpu_build.available(),
                                   reason="no C++ CPU kernels")


def _proc_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo (not Linux)")
def test_flags_are_the_kernels_flags_the_cpu_reports():
    proc = _proc_flags()
    assert cpu_features.cpu_flags() == [f for f in cpu_features.FLAGS if f in proc]
    line = cpu_features.describe()
    assert line.startswith(f"CPU {cpu_features.cpu_model()} [")
    missing = [f for f in cpu_features.FLAGS if f not in proc]
    assert (f"; no {' '.join(missing)}]" in line) == bool(missing)


@needs_kernels
def test_paths_are_the_ones_the_kernels_take(monkeypatch):
    monkeypatch.delenv(lm_head.SCREEN_ISA_ENV, raising=False)
    paths = cpu_features.kernel_paths()
    assert paths["library"] == ("native" if "native" in Path(cpu_build.library_path()).name else "portable")
    assert paths["greedy_screen"] == (lm_head.screen_isa() or "none")
    assert paths["attention"] == "cpp" and paths["linear"].startswith("panel")
    flags = set(cpu_features.cpu_flags())
    assert paths["int8_activations"] == ("avx512_vnni" if {"avx512_vnni", "avx512bw"} <= flags else
                                         "avx2" if {"avx2", "fma"} <= flags else "none")
    assert paths["bf16_prefill"] == ("amx" if {"amx_bf16", "avx512_bf16"} <= flags else
                                     "none" if paths["int8_activations"] == "none" else "int8")
    if "avx512_bf16" in cpu_features.cpu_flags() and "amx_bf16" not in cpu_features.cpu_flags():
        assert paths["greedy_screen"] == "avx512_bf16"    # the Zen 4 / Cooper Lake path
    for isa in lm_head.usable_screen_isas():
        monkeypatch.setenv(lm_head.SCREEN_ISA_ENV, isa)
        assert cpu_features.kernel_paths()["greedy_screen"] == isa
    monkeypatch.setenv(lm_head.SCREEN_ISA_ENV, "sse")
    assert cpu_features.kernel_paths()["greedy_screen"].startswith("invalid (ZOOINFER_SCREEN_ISA='sse'")
    monkeypatch.delenv(lm_head.SCREEN_ISA_ENV)
    monkeypatch.setenv("ZOOINFER_CPU_KERNELS", "0")
    paths = cpu_features.kernel_paths()
    assert (paths["library"], paths["greedy_screen"], paths["attention"]) == ("off", "none", "torch")
    assert paths["int8_activations"] == "none"        # no library: the exact fp32 product in torch
    assert paths["bf16_prefill"] == "none"
    assert "panel" not in paths["linear"]


def test_summary_carries_model_flags_and_paths():
    s = cpu_features.summary()
    assert s["cpu_model"] == cpu_features.cpu_model() and s["cpu_flags"] == cpu_features.cpu_flags()
    assert set(s["kernel_paths"]) == {"library", "greedy_screen", "linear", "prefill_gemm", "int8_activations",
                                      "bf16_prefill", "attention"}


def test_engine_logs_the_report_once(tiny_hf, monkeypatch, caplog):
    from runtime import LLM
    monkeypatch.setattr(cpu_features, "_logged", type(cpu_features._logged)())   # as in a fresh process
    path, _ = tiny_hf("llama")
    with caplog.at_level(logging.INFO, logger="zooinfer"):
        LLM(str(path), max_num_batched_tokens=64)
        LLM(str(path), max_num_batched_tokens=64)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU ")]
    assert lines == [cpu_features.describe()]
