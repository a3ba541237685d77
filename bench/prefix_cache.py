"""Prefix caching on a shared-system-prompt workload: TTFT and throughput, on vs off.

    python -m bench.prefix_cache [--model zoo/smollm2-135m.yaml] [--requests 64]
        [--prefix 1536] [--suffix 16-48] [--new-tokens 16] [--threads 1]

Every request is the same long system prompt plus a short distinct suffix. Both engines
see the same requests in one process; TTFT is measured per request from submission (all
at once) to its first token, throughput as output tokens over wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from runtime import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.make_request({"prompt_token_ids": p}, params) for p in prompts]
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    first: dict[str, float] = {}
    outputs = 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - t0)
            if out.finished:
                outputs += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    ttft = sorted(first.values())
    stats = llm.kv_cache_stats()
    return {"wall_s": wall, "out_tok_s": outputs / wall, "ttft_p50": statistics.median(ttft),
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))], "hit_rate": stats["prefix_cache_hit_rate"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoo/smollm2-135m.yaml")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--suffix", type=int, nargs=2, default=[16, 48])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    prefix = rng.integers(10, 30000, args.prefix).tolist()
    prompts = [prefix + rng.integers(10, 30000, int(rng.integers(*args.suffix))).tolist()
               for _ in range(args.requests)]
    results = {}
    for name, caching in (("off", False), ("on", True)):
        llm = LLM(args.model, enable_prefix_caching=caching, max_model_len=4096)
        run(llm, prompts[:2], 2)                                   # warm-up
        results[name] = run(llm, prompts, args.new_tokens)
    print(f"model {args.model}: {args.requests} requests, shared prefix {args.prefix} tokens, "
          f"suffix {args.suffix[0]}-{args.suffix[1]}, {args.new_tokens} new tokens, {args.threads} thread(s)")
    print(f"{'caching':<8} {'wall s':>8} {'out tok/s':>10} {'TTFT p50 s':>11} {'TTFT p90 s':>11} {'hit rate':>9}")
    for name, r in results.items():
        print(f"{name:<8} {r['wall_s']:>8.2f} {r['out_tok_s']:>10.1f} {r['ttft_p50']:>11.2f} "
              f"{r['ttft_p90']:>11.2f} {r['hit_rate']:>9.3f}")
    on, off = results["on"], results["off"]
    print(f"ratio on/off: throughput {on['out_tok_s'] / off['out_tok_s']:.2f}x, "
          f"TTFT p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
