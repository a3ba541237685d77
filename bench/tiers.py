"""KV tiers on a multi-turn chat workload whose working set is 4x the pool: TTFT and
throughput with tiers vs without (same run), and the first request after a restart, disk
tier vs cold.

    python -m bench.tiers [--model zoo/smollm2-135m.yaml] [--convs 8] [--turns 4]
        [--system 256] [--user 64] [--new-tokens 32] [--threads 1]

Every conversation starts with one shared system prompt; each turn's prompt is the
conversation so far plus a new user message, and all conversations send their turn at once
(TTFT is measured per request, from that submission to its first token). The pool holds a
quarter of the KV of all conversations' histories, so without tiers most of a turn's
prefix was evicted since the conversation's last turn; the host RAM tier holds them all.
Restart: an engine with a disk tier runs the workload and shuts down (it persists its
cache); a fresh engine on the same folder, and a cold one, then serve the longest prompt.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

from runtime import LLM, SamplingParams


def conversations(args) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and, per conversation, its user messages."""
    rng = np.random.default_rng(0)
    system = rng.integers(10, 30000, args.system).tolist()
    users = [[rng.integers(10, 30000, args.user).tolist() for _ in range(args.turns)] for _ in range(args.convs)]
    return system, users


def run_turns(llm: LLM, system, users, new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    history = [list(system) for _ in users]
    ttft, outputs, answers = [], 0, []
    t0 = time.perf_counter()
    for turn in range(len(users[0])):
        prompts = [h + u[turn] for h, u in zip(history, users)]
        reqs = [engine.make_request({"prompt_token_ids": p}, params) for p in prompts]
        start = time.perf_counter()
        for r in reqs:
            engine.add_request(r)
        first, done = {}, {}
        while engine.has_unfinished():
            for out in engine.step():
                first.setdefault(out.request_id, time.perf_counter() - start)
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        ttft += first.values()
        for c, r in enumerate(reqs):
            outputs += len(done[r.request_id])
            answers.append(done[r.request_id])
            history[c] = prompts[c] + done[r.request_id]
    wall = time.perf_counter() - t0
    ttft.sort()
    stats = llm.kv_cache_stats()
    tiers = stats.get("kv_tiers") or {}
    return {"wall_s": wall, "out_tok_s": outputs / wall, "ttft_p50": statistics.median(ttft),
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "hit_rate": stats["prefix_cache_hit_rate"], "preemptions": stats["num_preemptions"],
            "tier_hit_tokens": tiers.get("tier_hit_tokens", 0), "swapped": tiers.get("swapped_in", 0),
            "answers": answers, "longest": max(history, key=len)}


def first_request_ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoo/smollm2-135m.yaml")
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    system, users = conversations(args)
    final_len = args.system + args.turns * (args.user + args.new_tokens)
    working_set = -(-args.system // 16) + args.convs * -(-(final_len - args.system) // 16)   # blocks
    max_len = final_len + 16
    need = -(-max_len // 16) + 2
    pool = max(working_set // 4, need) + 1
    common = dict(max_model_len=max_len, num_kv_blocks=pool, max_num_seqs=args.convs, max_num_batched_tokens=512)
    probe = LLM(args.model, **common)
    page_bytes = probe.engine.kv_manager.config.bytes_per_block
    del probe
    host = 2 * working_set * page_bytes
    print(f"working set {working_set} blocks, pool {pool - 1} blocks ({working_set / (pool - 1):.1f}x), "
          f"host tier {host / 2**20:.0f} MiB")
    results = {}
    for name, kw in (("no tiers", {}), ("host tier", {"kv_host_tier_bytes": host})):
        llm = LLM(args.model, **common, **kw)
        run_turns(llm, system[:32], [[u[0][:16]] for u in users[:2]], 2)       # warm-up
        results[name] = run_turns(llm, system, users, args.new_tokens)
    same = results["no tiers"]["answers"] == results["host tier"]["answers"]
    for name, r in results.items():
        print(f"{name:>10}: TTFT p50 {r['ttft_p50'] * 1000:8.1f} ms  p99 {r['ttft_p99'] * 1000:8.1f} ms  "
              f"{r['out_tok_s']:7.1f} out tok/s  hit rate {r['hit_rate']:.2f}  preemptions {r['preemptions']}  "
              f"tier hit tokens {r['tier_hit_tokens']}  swapped {r['swapped']}")
    a, b = results["no tiers"], results["host tier"]
    ratios = {"ttft_p50": a["ttft_p50"] / b["ttft_p50"], "ttft_p99": a["ttft_p99"] / b["ttft_p99"],
              "throughput": b["out_tok_s"] / a["out_tok_s"]}
    print(f"tiers vs none: TTFT p50 {ratios['ttft_p50']:.2f}x lower, p99 {ratios['ttft_p99']:.2f}x lower, "
          f"throughput {ratios['throughput']:.2f}x; same greedy answers: {same}")

    longest = a["longest"]
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(args.model, **common, kv_disk_tier_dir=folder)
        run_turns(llm, system, users, args.new_tokens)
        llm.engine.close()                         # persists its cached blocks to disk
        del llm
        restarted = LLM(args.model, **common, kv_disk_tier_dir=folder)
        cold = LLM(args.model, **common)
        for warm in (restarted, cold):             # the forward's first call is slow: not what we measure
            warm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
        disk_s, disk_cached = first_request_ttft(restarted, longest)
        cold_s, _ = first_request_ttft(cold, longest)
    print(f"after restart: first request ({len(longest)} tokens) TTFT {disk_s * 1000:.1f} ms from disk "
          f"({disk_cached} cached tokens) vs {cold_s * 1000:.1f} ms cold: {cold_s / disk_s:.2f}x lower")
    if args.json:
        print(json.dumps({"ratios": ratios, "same": same, "restart_ratio": cold_s / disk_s,
                          **{k: {x: y for x, y in v.items() if x not in ("answers", "longest")}
                             for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
