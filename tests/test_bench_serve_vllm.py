"""bench.serve_vllm's bookkeeping: ratios paired by round, CPU split by thread, the command lines."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.serve_offline import cpu_delta, thread_cpu_seconds
from bench.serve_vllm import client_command, cpu_split, sample_cores, server_command, summarize, window_cores


def _run(target: str, rnd: int, tok_s: float, ttft: float, tpot: float) -> dict:
    return {"target": target, "round": rnd, "output_throughput": tok_s, "median_ttft_ms": ttft,
            "median_tpot_ms": tpot, "cpu": {"total": tok_s / 10, "engine_thread": 1.0, "main_thread": 0.5,
                                            "other": 0.0}}


def test_summary_pairs_each_run_with_vllms_of_the_same_round():
    runs = [_run("vllm", 0, 100, 2000, 50), _run("ours", 0, 120, 1000, 40),
            _run("vllm", 1, 200, 1000, 25), _run("ours", 1, 180, 1500, 30), _run("ours", 2, 999, 1, 1)]
    s = summarize(runs, ["ours", "vllm"])
    assert s["ours"]["tok_s_ratio"] == [1.2, 0.9]         # round 2 has no vLLM run to pair with
    assert s["ours"]["ttft_ratio"] == [0.5, 1.5] and s["ours"]["tpot_ratio"] == [0.8, 1.2]
    assert s["ours"]["output_throughput"] == 180 and s["vllm"]["output_throughput"] == 150
    assert "tok_s_ratio" not in s["vllm"] and s["vllm"]["cpu_ms_per_token"]["total"] == 15


def test_cpu_split_by_thread():
    cpu = {"python/python": 1.0, "python/zooinfer-engine": 3.0, "python/python-omp": 4.0,
           "VLLM::EngineCor/VLLM::EngineCor": 2.0}
    assert cpu_split(cpu, 1000) == {"total": 10.0, "engine_thread": 3.0, "main_thread": 1.0, "other": 6.0}
    now = thread_cpu_seconds(os.getpid())
    busy_until = time.thread_time() + 0.05    # this thread burns 5 clock ticks of CPU (a fixed loop
    while time.thread_time() < busy_until:    # took under one 10 ms tick on a Zen 5: nothing grew)
        pass
    grown = cpu_delta(now, thread_cpu_seconds(os.getpid()))
    assert grown and all(v > 0 for v in grown.values())


def test_cores_over_the_clients_timed_run_only():
    # (time, server CPU, client CPU, machine busy, machine idle), cumulative: the client's
    # start-up (t 0-8: it alone busy, the server idle) is left out by its reported duration
    samples = [(0.0, 10.0, 0.0, 100.0, 50.0), (8.0, 10.0, 7.5, 108.0, 58.5), (10.0, 13.0, 7.6, 111.2, 59.3),
               (12.0, 16.0, 7.7, 114.4, 60.1)]
    assert window_cores(samples, 4.0) == {"server": 1.5, "client": 0.05, "idle": 0.4}
    assert window_cores(samples, 100.0) == {"server": 0.5, "client": 0.64, "idle": 0.84}
    assert window_cores(samples[:1], 4.0) == {}
    t, server, client, busy, idle = sample_cores(os.getpid(), os.getpid())
    assert server == client > 0 and (busy + idle > 0 or not Path("/proc/stat").exists())


def test_every_target_runs_the_same_workload_greedy():
    args = argparse.Namespace(model_dir=Path("/m"), name="m", spec="zoo/x.yaml", baseline="/old", ours_args="--a 1",
                              vllm_args="", input_len=128, output_len=64, num_prompts=48, max_concurrency=16)
    ours, cwd = server_command("ours", args, 8100)
    assert ours[-2:] == ["--a", "1"] and "--quantization" in ours and cwd.name != "old"
    quant, _ = server_command("ours-quant", args, 8101)
    assert "--quantization" not in quant
    assert server_command("base", args, 8102)[1] == Path("/old")
    vllm, _ = server_command("vllm", args, 8103)
    assert vllm[2:4] == ["vllm.entrypoints.openai.api_server", "--model"] and "float32" in vllm
    # each server's own CPU default token budget: ours unset (runtime.serve picks 1024), vLLM's 2048
    assert "--max-num-batched-tokens" not in ours
    assert vllm[vllm.index("--max-num-batched-tokens") + 1] == "2048"
    client = client_command(args, 8103, 5, Path("r.json"))
    for flag, value in (("--seed", "5"), ("--temperature", "0"), ("--random-input-len", "128"),
                        ("--max-concurrency", "16"), ("--base-url", "http://127.0.0.1:8103")):
        assert client[client.index(flag) + 1] == value
    assert "--ignore-eos" in client


def test_server_token_budget_defaults_by_device():
    from runtime.serve import batched_tokens
    assert batched_tokens(None, "cpu") == 1024 and batched_tokens(None, "cuda") == 2048
    assert batched_tokens(512, "cpu") == 512 and batched_tokens(4096, "cuda") == 4096
