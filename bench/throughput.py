"""Offline throughput: our engine vs HF transformers `generate`, same model, same workload.

    python -m bench.throughput [--model tiny-llama|smollm2|<spec yaml or hf dir>]
        [--requests 64] [--min-prompt 64] [--max-prompt 256] [--new-tokens 64]
        [--threads 1] [--rounds 2] [--hf-batch 16] [--json out.json] [--profile [N]]

Workload: `--requests` prompts of random token ids (fixed seed), lengths uniform in
[min-prompt, max-prompt]; every request generates exactly `--new-tokens` tokens greedily
(ours: ignore_eos; HF: min_new_tokens = max_new_tokens so EOS cannot stop it).

- ours: `runtime.LLM(model, max_num_seqs=64, max_num_batched_tokens=2048)`, all prompts in
  one `generate` call (continuous batching, chunked prefill, paged KV).
- hf:   `AutoModelForCausalLM.generate`, static batches of `--hf-batch` in input order, left
  padding with an attention mask, greedy, default (sdpa) attention, float32.

Both engines are loaded once, warmed up, then timed alternately over `--rounds` rounds (the
order flips each round so drift on a shared machine hits both). The table shows output
tokens/s (median, min-max), the ratio ours/HF of the medians, the load average, and how many
of our outputs equal HF's greedy tokens (first round; batched padded HF greedy can differ
from unpadded in rare near-ties).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

TINY_LLAMA = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1024,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
TINY_LLAMA_VERSION = 1   # bump when TINY_LLAMA or its seed changes: a new cache dir is made


def bench_cache_dir() -> Path:
    root = os.environ.get("ZOOINFER_CACHE") or Path.home() / ".cache" / "zooinfer"
    return Path(root) / "bench"


def ensure_tiny_llama() -> Path:
    """A random Llama (seed 0) saved with save_pretrained, cached; written atomically."""
    target = bench_cache_dir() / f"tiny-llama-v{TINY_LLAMA_VERSION}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import LlamaConfig, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama.work-", dir=target.parent))
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.float32)
        model.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:   # another process won the race: use its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name: str) -> tuple[str, Path]:
    """(label, path given to our LLM). HF needs an HF dir: a spec YAML must name one."""
    if name == "tiny-llama":
        return name, ensure_tiny_llama()
    if name in ("smollm2", "smollm2-135m"):
        from models.embedded import ensure_embedded
        return "smollm2-135m", ensure_embedded("smollm2-135m")
    p = Path(name)
    if not p.exists():
        raise SystemExit(f"error: --model {name!r}: not tiny-llama, smollm2, a spec file or an HF dir")
    return p.stem if p.is_file() else p.name, p


def hf_dir_for(path: Path) -> Path:
    if path.is_dir():
        return path
    from models import resolve_spec
    from models.loader import checkpoint_dir
    d = checkpoint_dir(resolve_spec(path))
    if d is None or not (Path(d) / "config.json").exists():
        raise SystemExit(f"error: {path}: its checkpoint is not an HF directory; HF cannot load it")
    return Path(d)


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_len, max_len + 1, size=n)
    return [rng.integers(0, vocab, size=int(L)).tolist() for L in lens]


# ------------------------------------------------------------------ engines
class Ours:
    name = "ours"

    def __init__(self, path: Path, max_model_len: int | None):
        from runtime import LLM, SamplingParams
        kwargs = dict(max_num_seqs=64, max_num_batched_tokens=2048, dtype="float32")
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        self.llm = LLM(str(path), **kwargs)
        self.SamplingParams = SamplingParams

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        sp = self.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


class HF:
    name = "hf"

    def __init__(self, hf_dir: Path, batch: int):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        cfg = self.model.config
        pad = cfg.pad_token_id
        if pad is None:
            eos = cfg.eos_token_id
            pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        self.pad = int(pad)
        self.batch = batch

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.batch):
            chunk = prompts[start:start + self.batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):   # left padding
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.pad, num_beams=1)
            results.extend(out[:, width:].tolist())
        return results


# ------------------------------------------------------------------ driver
def agreement(ours: list[list[int]], hf: list[list[int]]) -> dict:
    equal = sum(a == b for a, b in zip(ours, hf))
    prefix = []
    for a, b in zip(ours, hf):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k)
    distinct = len({t for seq in ours for t in seq})
    return {"equal": equal, "total": len(ours), "mean_common_prefix": float(np.mean(prefix)),
            "min_common_prefix": int(min(prefix)), "distinct_tokens_ours": distinct}


def profile_ours(ours: Ours, prompts, new_tokens: int, seconds: float, top: int = 10) -> str:
    """Run ours under cProfile for ~`seconds`; top cumulative entries in our packages."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    t0, runs = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        prof.enable()
        ours.run(prompts, new_tokens)
        prof.disable()
        runs += 1
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    stats.print_stats(r"(runtime|cache|attention|models)/", top)
    buf.write(f"\n-- all code (top {top + 10} cumulative) --\n")
    stats.print_stats(top + 10)
    return f"cProfile of ours: {runs} run(s), {time.perf_counter() - t0:.1f} s\n" + buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama | smollm2 | spec yaml | HF dir")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="cap our engine's max_model_len (default: the model's)")
    ap.add_argument("--engines", default="ours,hf", help="comma list of ours,hf")
    ap.add_argument("--json", dest="json_out", default=None, help="write results to this file")
    ap.add_argument("--profile", type=float, nargs="?", const=20.0, default=None,
                    help="after timing, cProfile our engine for ~N seconds (default 20)")
    args = ap.parse_args(argv)
    if args.min_prompt < 1 or args.max_prompt < args.min_prompt or args.rounds < 1:
        ap.error("need 1 <= min-prompt <= max-prompt and rounds >= 1")

    torch.set_num_threads(args.threads)
    engines_wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    load_start = os.getloadavg()

    label, path = resolve_model(args.model)
    hf_dir = hf_dir_for(path)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    prompts = make_workload(args.requests, args.min_prompt, args.max_prompt, vocab, args.seed)
    n_prompt = sum(map(len, prompts))
    n_out = args.requests * args.new_tokens
    print(f"model {label} ({hf_dir}), fp32, torch threads {torch.get_num_threads()}")
    print(f"workload: {args.requests} requests, prompt {args.min_prompt}-{args.max_prompt} tokens "
          f"({n_prompt} total), {args.new_tokens} new tokens each ({n_out} total), seed {args.seed}")

    engines = []
    for name in engines_wanted:
        t0 = time.perf_counter()
        eng = Ours(path, args.max_model_len) if name == "ours" else HF(hf_dir, args.hf_batch) if name == "hf" \
            else ap.error(f"unknown engine {name!r}")
        engines.append(eng)
        print(f"loaded {name} in {time.perf_counter() - t0:.1f} s", flush=True)

    # Warm-up: a small piece of the real workload through each engine.
    warm = prompts[:4]
    for eng in engines:
        t0 = time.perf_counter()
        eng.run(warm, min(4, args.new_tokens))
        print(f"warm-up {eng.name}: {time.perf_counter() - t0:.2f} s", flush=True)

    times: dict[str, list[float]] = {e.name: [] for e in engines}
    first_outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for eng in order:
            t0 = time.perf_counter()
            outs = eng.run(prompts, args.new_tokens)
            dt = time.perf_counter() - t0
            times[eng.name].append(dt)
            got = sum(map(len, outs))
            if got != n_out:
                print(f"WARNING: {eng.name} produced {got} output tokens, expected {n_out}", file=sys.stderr)
            first_outputs.setdefault(eng.name, outs)
            print(f"round {r + 1}/{args.rounds} {eng.name:>4}: {dt:7.2f} s  {n_out / dt:9.1f} out tok/s  "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)

    load_end = os.getloadavg()
    rows = {}
    for name, ts in times.items():
        tps = [n_out / t for t in ts]
        rows[name] = {"seconds": ts, "out_tok_s": tps, "median_out_tok_s": statistics.median(tps),
                      "min_out_tok_s": min(tps), "max_out_tok_s": max(tps),
                      "median_total_tok_s": (n_prompt + n_out) / statistics.median(ts)}
    ratio = (rows["ours"]["median_out_tok_s"] / rows["hf"]["median_out_tok_s"]
             if "ours" in rows and "hf" in rows else None)
    agree = agreement(first_outputs["ours"], first_outputs["hf"]) if ratio is not None else None

    print()
    print(f"{'engine':<8}{'out tok/s (median)':>20}{'min-max':>22}{'prompt+out tok/s':>19}{'median s':>10}")
    for name, row in rows.items():
        mm = f"{row['min_out_tok_s']:.1f}-{row['max_out_tok_s']:.1f}"
        print(f"{name:<8}{row['median_out_tok_s']:>20.1f}{mm:>22}{row['median_total_tok_s']:>19.1f}"
              f"{statistics.median(row['seconds']):>10.2f}")
    if ratio is not None:
        print(f"ratio ours/hf (median out tok/s): {ratio:.2f}x")
        print(f"greedy agreement (round 1): {agree['equal']}/{agree['total']} outputs identical; "
              f"mean common prefix {agree['mean_common_prefix']:.1f}/{args.new_tokens}, "
              f"min {agree['min_common_prefix']}; {agree['distinct_tokens_ours']} distinct tokens in ours")
    print(f"load average: start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
          f"end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} ({os.cpu_count()} cpus)")

    profile_text = None
    if args.profile and engines and engines[0].name == "ours":
        profile_text = profile_ours(engines[0], prompts, args.new_tokens, args.profile)
        print()
        print(profile_text)

    if args.json_out:
        result = {"model": label, "hf_dir": str(hf_dir), "threads": torch.get_num_threads(),
                  "workload": {"requests": args.requests, "min_prompt": args.min_prompt,
                               "max_prompt": args.max_prompt, "new_tokens": args.new_tokens,
                               "seed": args.seed, "prompt_tokens": n_prompt, "output_tokens": n_out},
                  "hf_batch": args.hf_batch, "rounds": args.rounds, "engines": rows, "ratio_ours_hf": ratio,
                  "agreement": agree, "loadavg_start": load_start, "loadavg_end": load_end,
                  "torch": torch.__version__}
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
