"""The served workload without the server: the floor the server path is measured against.

    python -m bench.serve_offline [--spec zoo/smollm2-135m.yaml] [--quantization none]
        [--num-prompts 48] [--max-concurrency 16] [--input-len 128] [--output-len 64]
        [--seed 0] [--json out.json]

A closed-loop client on the Engine itself, in this process: `--max-concurrency` requests in
flight, a new one added as soon as one finishes (what `vllm bench serve --max-concurrency`
does over HTTP), random token-id prompts of `--input-len`, `--output-len` tokens each with
ignore_eos, greedy, streamed as the server asks the engine for them (cumulative outputs with
incremental detokenization), so the only thing missing against `runtime.serve` is the
server: HTTP, asyncio, the engine thread hand-off, SSE and JSON. Reports output tok/s and
TTFT / TPOT p50 (vLLM's definitions), and `thread_cpu`: CPU seconds per thread name over the
run (`thread_cpu_seconds`, also used by `bench.serve_vllm` on the servers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of process `pid` and its descendants, summed per
    "process-name/thread-name" (Linux /proc; {} where it cannot be read)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = defaultdict(float)
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            pname = Path(f"/proc/{p}/comm").read_text().strip()
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{p}/task/{tid}/stat").read_text()
                children = Path(f"/proc/{p}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            out[f"{pname}/{name}"] += (int(fields[11]) + int(fields[12])) / tick   # utime, stime
            todo.extend(int(c) for c in children)
    return dict(out)


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}


def latency_stats(first: dict, done: dict, start: dict, n_out: int) -> dict:
    """TTFT and TPOT medians in ms, as `vllm bench serve` defines them."""
    ttft = [first[r] - start[r] for r in done]
    tpot = [(done[r] - first[r]) / (n_out - 1) for r in done] if n_out > 1 else [0.0]
    return {"median_ttft_ms": float(np.median(ttft)) * 1e3, "median_tpot_ms": float(np.median(tpot)) * 1e3,
            "mean_ttft_ms": float(np.mean(ttft)) * 1e3}


def run(args) -> dict:
    import torch
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine(args.spec, EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048,
                                            quantization=args.quantization))
    engine.warm_up(SamplingParams(temperature=0, max_tokens=2))
    rng = np.random.default_rng(args.seed)
    vocab = engine.spec.vocab_size
    prompts = [rng.integers(100, vocab - 100, size=args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start, first, done = {}, {}, {}
    pending = list(enumerate(prompts))[::-1]
    in_flight = 0
    cpu0, t0 = thread_cpu_seconds(os.getpid()), time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < args.max_concurrency:
            i, ids = pending.pop()
            req = engine.make_request({"prompt_token_ids": ids}, params, request_id=f"r{i}", cap_max_tokens=False)
            engine.add_request(req, stream_text=True)
            start[req.request_id] = time.perf_counter()
            in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
                in_flight -= 1
    duration = time.perf_counter() - t0
    cpu = cpu_delta(cpu0, thread_cpu_seconds(os.getpid()))
    n_tokens = args.num_prompts * args.output_len
    return {"output_throughput": n_tokens / duration, "duration_s": duration, "completed": len(done),
            **latency_stats(first, done, start, args.output_len), "thread_cpu": cpu,
            "cpu_ms_per_token": 1e3 * sum(cpu.values()) / n_tokens}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serve_offline", description=__doc__.split("\n")[0])
    p.add_argument("--spec", default="zoo/smollm2-135m.yaml")
    p.add_argument("--quantization", default="none", help="none (fp32), or the spec's default with ''")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if min(args.num_prompts, args.max_concurrency, args.input_len, args.output_len, args.threads) < 1:
        p.error("--num-prompts, --max-concurrency, --input-len, --output-len and --threads must be positive")
    args.quantization = args.quantization or None
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
