"""Quantized weights: quality (mean KL, top-1 agreement vs fp32) and batch-1 decode speed, per format.

    python -m bench.quant [--models smollm2-135m gemma3-270m] [--formats gguf int8 int4 int4_asym]
        [--positions 2048] [--window 256] [--decode-tokens 64] [--rounds 3] [--threads 1]

Quality, as llama.cpp's `perplexity --kl-divergence` measures it: the next-token distribution at
every position of fixed text (this repo's README.md, tokenized, cut into `--window`-token
windows, the first `--positions` tokens), mean KL(fp32 || quantized) and the fraction of
positions whose argmax agrees. Both sides are the HF transformers model of the embedded
checkpoint; the quantized side has its linears swapped for our `QuantLinear` (the same kernels
the engine runs): `gguf` with the GGUF's own blocks, the others made by our loader from the
float weights. The fp32 reference is the embedded checkpoint, i.e. the shipped GGUF dequantized
(the original bf16 weights are not available offline): for `gguf` the KL measures only how our
kernels round; int8 / int4 are quantized again from those weights.

Speed: our engine (`runtime.LLM`), one request, greedy `--decode-tokens` tokens after a short
prompt, per format and in fp32 (`quantization none`, packed panels), timed alternately over
`--rounds` rounds in this one process; tokens/s is new tokens over the decode time (the time
after the first token). Weight bytes are those of the linears the kernels stream.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _swap_linears(model, fmt: str, spec) -> int:
    """Replace the HF model's linears (and its tied head) with `QuantLinear`s of format `fmt`."""
    from torch import nn

    from models.quant import QuantLinear, quantize_int4, quantize_int8
    make = {"int8": quantize_int8, "int4": lambda w: quantize_int4(w, 32),
            "int4_asym": lambda w: quantize_int4(w, 32, symmetric=False)}
    src = None
    if fmt == "gguf":
        from models.quant_gguf import GGUFLinears
        from models.quant_load import gguf_path
        src = GGUFLinears(gguf_path(spec))
    count = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        if src is not None:
            qw = src.weight(f"{name}.weight")
        else:   # the head in int8 under every method, as models/quant_load.py does
            qw = make["int8" if name == "lm_head" else fmt](module.weight.detach())
        if qw is None:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, QuantLinear(qw, module.bias))
        count += 1
    return count


@torch.no_grad()
def quality(name: str, formats: list[str], positions: int, window: int) -> list[tuple]:
    """Per format: (model, format, linears swapped, positions, mean KL, max KL, top-1 agreement).
    All models are held at once and run window by window, so only one window's logits live."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models import resolve_spec
    from models.embedded import ensure_embedded
    path = ensure_embedded(name)
    spec = resolve_spec(ROOT / "zoo" / f"{name}.yaml")
    ids = AutoTokenizer.from_pretrained(path)((ROOT / "README.md").read_text()).input_ids[:positions]
    windows = [torch.tensor(ids[i:i + window]) for i in range(0, len(ids), window)]
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    models, swapped = {}, {}
    for fmt in formats:
        models[fmt] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        swapped[fmt] = _swap_linears(models[fmt], fmt, spec)
    kl = {fmt: [] for fmt in formats}
    top1 = {fmt: [] for fmt in formats}
    for w in windows:
        ref = F.log_softmax(ref_model(w[None]).logits[0].float(), dim=-1)
        for fmt, model in models.items():
            got = F.log_softmax(model(w[None]).logits[0].float(), dim=-1)
            kl[fmt].append((ref.exp() * (ref - got)).sum(-1))
            top1[fmt].append((ref.argmax(-1) == got.argmax(-1)).float())
    rows = []
    for fmt in formats:
        k, t = torch.cat(kl[fmt]), torch.cat(top1[fmt])
        rows.append((name, fmt, swapped[fmt], k.numel(), k.mean().item(), k.max().item(), t.mean().item()))
    return rows


def _decode_rate(llm, prompt: list[int], tokens: int) -> float:
    from runtime import SamplingParams
    first = SamplingParams(temperature=0, max_tokens=1)
    full = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], full, use_tqdm=False)
    t2 = time.perf_counter()
    return (tokens - 1) / ((t2 - t1) - (t1 - t0))    # minus prefill + first token


def speed(name: str, formats: list[str], tokens: int, rounds: int) -> list[tuple]:
    from models.quant import weight_bytes
    from runtime import LLM
    prompt = list(range(100, 132))
    engines = {}
    for fmt in ["none", *formats]:
        llm = LLM(str(ROOT / "zoo" / f"{name}.yaml"), max_num_seqs=1, max_model_len=512, quantization=fmt,
                  enable_prefix_caching=False)
        engines[fmt] = (llm, weight_bytes(llm.engine.model))    # every weight, the embedding included
        _decode_rate(llm, prompt, 8)                                # warm-up
    rates = {fmt: [] for fmt in engines}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for fmt in order:
            rates[fmt].append(_decode_rate(engines[fmt][0], prompt, tokens))
    base = statistics.median(rates["none"])
    return [(name, fmt, engines[fmt][1] / 2**20, statistics.median(v), min(v), max(v),
             statistics.median(v) / base) for fmt, v in rates.items()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--formats", nargs="+", default=["gguf", "int8", "int4", "int4_asym"])
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {' '.join(f'{x:.1f}' for x in __import__('os').getloadavg())}")
    if not args.skip_quality:
        print(f"\n{'model':<14}{'format':<11}{'linears':>8}{'positions':>10}{'mean KL':>12}{'max KL':>11}{'top-1':>8}")
        for name in args.models:
            for row in quality(name, args.formats, args.positions, args.window):
                print(f"{row[0]:<14}{row[1]:<11}{row[2]:>8}{row[3]:>10}{row[4]:>12.2e}{row[5]:>11.2e}{row[6]:>8.2%}")
    if not args.skip_speed:
        print(f"\nbatch-1 decode, {args.decode_tokens} tokens, median (min-max) of {args.rounds} rounds")
        print(f"{'model':<14}{'format':<11}{'weight MiB':>11}{'tok/s':>8}{'range':>16}{'vs fp32':>9}")
        for name in args.models:
            for row in speed(name, args.formats, args.decode_tokens, args.rounds):
                print(f"{row[0]:<14}{row[1]:<11}{row[2]:>11.1f}{row[3]:>8.1f}{f'{row[4]:.1f}-{row[5]:.1f}':>16}"
                      f"{row[6]:>8.2f}x")


if __name__ == "__main__":
    main()
