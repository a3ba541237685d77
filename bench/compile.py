"""Does torch.compile pay on this machine? Our engine with compile off and on, one process.

    python -m bench.compile [--model tiny-llama|smollm2|<spec yaml or hf dir>] [--rounds 3]
        [--requests 64] [--min-prompt 64] [--max-prompt 256] [--new-tokens 64]
        [--threads 1] [--compile-cache-dir DIR]

The workload is bench.throughput's (random prompt ids, fixed seed, greedy, EOS ignored, all
prompts in one `generate`), and so are the model helpers and our engine's settings. Both
engines are built first; the compiled one compiles at start-up (its warm-up), which is the
compile time printed. Then each engine runs once untimed, and the timed rounds alternate
(the order flips each round so drift on a shared machine hits both). Printed: output
tokens/s median and min-max per engine, the compiled/eager ratio, compile time, whether the
greedy outputs are identical, and graphs / recompiles seen during the timed rounds (both
should be 0: the warm-up's graph serves every batch).

The inductor cache is a fresh temporary directory unless `--compile-cache-dir` is given, so
by default the compile time is a cold one; run twice with the same directory for a warm one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from bench.throughput import Ours, make_workload, resolve_model  # noqa: E402


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama | smollm2 | gemma3 | spec yaml | HF dir")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--compile-cache-dir", default=None,
                    help="inductor cache to use (default: a fresh temporary one, i.e. a cold compile)")
    args = ap.parse_args(argv)
    if args.min_prompt < 1 or args.max_prompt < args.min_prompt or args.rounds < 1:
        ap.error("need 1 <= min-prompt <= max-prompt and rounds >= 1")
    torch.set_num_threads(args.threads)
    cache_dir = args.compile_cache_dir or tempfile.mkdtemp(prefix="zooinfer-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir

    import torch._dynamo.utils as dynamo_utils
    label, path = resolve_model(args.model)
    load_start = os.getloadavg()
    eager = Ours(path, args.max_model_len)
    t0 = time.perf_counter()
    compiled = Ours(path, args.max_model_len, compile=True)
    init_s = time.perf_counter() - t0
    compile_s = compiled.llm.engine.startup_seconds["compile"]
    spec = eager.llm.engine.spec
    prompts = make_workload(args.requests, args.min_prompt, args.max_prompt, spec.vocab_size, args.seed)
    n_out = args.requests * args.new_tokens
    print(f"model {label} ({path}), {spec.dtype}, threads {torch.get_num_threads()}, inductor cache {cache_dir}")
    print(f"workload: {args.requests} requests, prompt {args.min_prompt}-{args.max_prompt} tokens "
          f"({sum(map(len, prompts))} total), {args.new_tokens} new tokens each ({n_out} total), "
          f"seed {args.seed}, {args.rounds} rounds")
    print(f"compile (warm-up at engine start): {compile_s:.1f} s; compiled engine init {init_s:.1f} s", flush=True)

    engines = {"eager": eager, "compiled": compiled}
    outputs = {name: e.run(prompts, args.new_tokens) for name, e in engines.items()}   # untimed
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    recompiles = sum(dynamo_utils.counters["recompiles"].values())
    tps: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            t = time.perf_counter()
            out = engines[name].run(prompts, args.new_tokens)
            tps[name].append(n_out / (time.perf_counter() - t))
            assert out == outputs[name], f"{name}: greedy outputs changed between rounds"
            print(f"  round {r + 1} {name:8s} {tps[name][-1]:8.1f} tok/s", flush=True)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"] - graphs
    recompiles = sum(dynamo_utils.counters["recompiles"].values()) - recompiles

    same = sum(a == b for a, b in zip(outputs["eager"], outputs["compiled"]))
    ratio = statistics.median(tps["compiled"]) / statistics.median(tps["eager"])
    print(f"\n{'engine':10s} {'out tok/s median (min-max)':>30s}")
    for name in engines:
        print(f"{name:10s} {_fmt(tps[name]):>30s}")
    print(f"compiled / eager: {ratio:.2f}x")
    saved = n_out / statistics.median(tps["eager"]) - n_out / statistics.median(tps["compiled"])
    payback = f"pays back after {compile_s / saved:.1f} such workloads" if saved > 0 else "never pays back"
    print(f"compile time: {compile_s:.1f} s; saves {saved:.1f} s per workload: {payback}")
    print(f"identical greedy outputs: {same}/{len(prompts)}")
    print(f"graphs / recompiles during timed rounds: {graphs} / {recompiles}")
    print(f"load average: {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
