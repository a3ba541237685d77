"""The prefill GEMM per shape: the blocked panel kernel, the decode panel kernel and MKL (`F.linear`).

    python -m bench.prefill_gemm [--model smollm2|tiny-llama|<HF dir>] [--rows 2048,256,96]
        [--threads 1] [--rounds 7] [--json out.json]

For each linear shape of one decoder layer of the model (fused qkv, o, fused gate_up, down; K
and N from its config.json) and each row count, the three kernels run alternately `--rounds`
times on the same x and weight; the table gives GFLOP/s from the median time and blocked's
ratio to MKL. At one thread the time is the thread's CPU time (`time.thread_time`), so a busy
shared machine, which only delays a thread, changes it far less than the wall clock (it
still shares the caches); with more threads it is the wall clock (best of the rounds). The
capability line (`zooinfer_kernels.cpu_features.describe()`, with the start-up probe's choice) heads the
table, so a reader sees which path the engine takes on this CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from zooinfer_kernels import cpu_build, cpu_features, gemm


def layer_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(K, N) of one decoder layer's linears as the engine fuses them."""
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    d = int(cfg.get("head_dim") or h // heads)
    return {"qkv": (h, (heads + 2 * kv) * d), "o": (heads * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def time_kernels(fns: dict, rounds: int, cpu_clock: bool) -> dict[str, float]:
    """Seconds per kernel: median of `rounds` alternating runs on the thread's CPU clock, or the
    best wall time where threads run in parallel (their CPU time would count spin-waits)."""
    clock = time.thread_time if cpu_clock else time.perf_counter
    runs = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for r in range(rounds):
        for name, fn in (fns.items() if r % 2 == 0 else reversed(fns.items())):
            t0 = clock()
            fn()
            runs[name].append(clock() - t0)
    pick = statistics.median if cpu_clock else min
    return {name: pick(ts) for name, ts in runs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default="2048,256,96")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.rounds < 1:
        ap.error("--threads and --rounds must be >= 1")
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows must be a comma list of integers, got {args.rows!r}")
    if not rows or min(rows) < 1:
        ap.error("--rows needs positive row counts")
    if not cpu_build.available():
        raise SystemExit("error: the C++ CPU kernels are unavailable; nothing to compare")
    from bench.throughput import hf_dir_for, resolve_model
    torch.set_num_threads(args.threads)
    label, path = resolve_model(args.model)
    cfg = json.loads((hf_dir_for(path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    cpu_clock = args.threads == 1
    print(f"model {label}, threads {args.threads}, {'thread CPU time, median' if cpu_clock else 'wall, best'} "
          f"of {args.rounds} rounds")
    print(cpu_features.describe())
    print(f"{'linear':<9}{'rows':>6}{'K':>6}{'N':>6}{'blocked':>9}{'panel':>8}{'mkl':>8}{'blk/mkl':>9}  GFLOP/s")
    results = []
    gen = torch.Generator().manual_seed(0)
    for name, (k, n) in layer_shapes(cfg).items():
        w = torch.randn(n, k, generator=gen)
        panels = gemm.pack_panels(w)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            with torch.no_grad():
                secs = time_kernels({"blocked": lambda: gemm.panel_linear_blocked(x, panels, n, None),
                                     "panel": lambda: gemm.panel_linear(x, panels, n, None),
                                     "mkl": lambda: F.linear(x, w)}, args.rounds, cpu_clock)
            rate = {kname: 2 * m * k * n / s / 1e9 for kname, s in secs.items()}
            results.append({"linear": name, "rows": m, "k": k, "n": n, "gflops": rate})
            print(f"{name:<9}{m:>6}{k:>6}{n:>6}{rate['blocked']:>9.1f}{rate['panel']:>8.1f}{rate['mkl']:>8.1f}"
                  f"{rate['blocked'] / rate['mkl']:>8.2f}x", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": label, "threads": args.threads, "rounds": args.rounds,
                                                   "results": results, **cpu_features.summary()}, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
