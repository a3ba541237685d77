"""KV cache dtypes (float32 / bfloat16 / int8 pages, cache/kv_dtype.py) on SmolLM2-135M, one invocation:

    python -m bench.kv_dtype [--ctx 2048] [--batch 8] [--steps 32] [--threads 2] [--budget-gib 1]
        [--skip-engine] [--agreement 8]

1. capacity: blocks and concurrent requests of `--ctx` tokens a `--budget-gib` pool holds
   (exact, from the engine's sizing; no model run);
2. kernel: the paged decode kernel alone on one SmolLM2 layer (9 query / 3 kv heads of 64),
   `--batch` decodes of `--ctx` tokens each over shuffled pages, dtypes interleaved rep by rep,
   medians and the ratio to float32;
3. engine: decode tok/s of the whole engine (SmolLM2 as shipped: GGUF weights) with `--batch`
   distinct prompts of `--ctx` tokens, timed over `--steps` decode steps after every prompt has
   prefilled (prefill not timed), one engine per dtype, same prompts;
4. agreement: greedy tokens (48 per prompt) with bf16 and int8 pages against float32 pages on
   `--agreement` fixed chat prompts: how many sequences are identical and where the others
   first differ.
The machine is shared: compare ratios within one run, not absolute numbers across runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from bench.cpu_attention import make_batch
from cache.kv_cache_spec import FullAttentionSpec
from cache.sizing import make_kv_cache_config, requests_that_fit
from zooinfer_kernels import cpu_build, paged_attention

SPEC = "zoo/smollm2-135m.yaml"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "List three uses of copper.", "Who wrote Hamlet?", "How do vaccines work?",
             "Give me a tip for learning to code.", "Why is the sky blue?", "What is a prime number?",
             "Describe a cat in one sentence.", "What does a CPU do?", "Name a famous painting."]


def capacity(ctx: int, budget: int) -> None:
    print(f"capacity: SmolLM2 (30 layers, 3 kv heads x 64), {budget / 2**30:g} GiB pool, requests of {ctx} tokens")
    for name, dtype in DTYPES.items():
        cfg = make_kv_cache_config({i: FullAttentionSpec(16, 3, 64, dtype) for i in range(30)}, 16,
                                   memory_bytes=budget)
        print(f"  {name:9s} page {cfg.groups[0].spec.page_size_bytes:6d} B/layer  blocks {cfg.num_blocks - 1:6d}  "
              f"concurrent requests {requests_that_fit(cfg, ctx):4d}")


def _as_dtype(cache32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from attention import kv_quant
    n, _, bs, heads, dim = cache32.shape
    spec = FullAttentionSpec(bs, heads, dim, dtype)
    buf = torch.zeros(n, spec.page_size_bytes, dtype=torch.uint8)
    cache = buf.view(dtype)[:, : spec.view_bytes() // dtype.itemsize].view(spec.cache_shape(n))
    if dtype == torch.int8:
        q, s = kv_quant.quantize(cache32.reshape(-1, heads, dim))
        cache.copy_(q.view(cache.shape))
        kv_quant.scales_view(cache).copy_(s.view(n, 2, bs, heads))
    else:
        cache.copy_(cache32)
    return cache


def kernel(ctx: int, batch: int, reps: int) -> None:
    if not cpu_build.available():
        print("kernel: C++ kernels unavailable, skipped")
        return
    layout, cache32, q = make_batch(batch, 9, 3, 64, ctx, None, seed=1)
    caches = {name: _as_dtype(cache32, dtype) for name, dtype in DTYPES.items()}
    rows = torch.arange(batch)
    seq_lens = torch.from_numpy(layout.seq_lens.astype(np.int64))
    out = torch.empty_like(q)
    times = {name: [] for name in caches}
    for _ in range(reps):
        for name, cache in caches.items():
            t0 = time.perf_counter()
            paged_attention.paged_decode(q, cache, layout.block_table, rows, rows, seq_lens, None, 0.125, out)
            times[name].append(time.perf_counter() - t0)
    print(f"kernel: paged_decode, one SmolLM2 layer, {batch} decodes x ~{ctx} tokens, "
          f"{torch.get_num_threads()} threads, median of {reps} (speed-up: median of per-rep ratios)")
    for name, t in times.items():
        ratio = statistics.median(f / x for f, x in zip(times["float32"], t))
        print(f"  {name:9s} {statistics.median(t) * 1e6:8.1f} us  x{ratio:.2f} vs float32")


def _prompts(tokenizer, ctx: int, batch: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `ctx` tokens: chat text, repeated and cut."""
    out = []
    for i in range(batch):
        text = " ".join(QUESTIONS[(i + j) % len(QUESTIONS)] for j in range(ctx // 4))
        ids = tokenizer.encode(text)
        out.append((ids * (ctx // len(ids) + 1))[:ctx])
    return out


def engine(ctx: int, batch: int, steps: int) -> None:
    from runtime import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=steps + 2, min_tokens=steps + 2)
    prompts = None
    print(f"engine: {SPEC}, {batch} prompts x {ctx} tokens, decode tok/s over {steps} steps "
          f"(prefill not timed), {torch.get_num_threads()} threads")
    rates = {}
    for name in DTYPES:
        llm = LLM(SPEC, max_model_len=ctx + steps + 8, max_num_seqs=batch, kv_cache_dtype=name,
                  kv_cache_memory=2 << 30)
        e = llm.engine
        prompts = prompts or _prompts(e.tokenizer, ctx, batch)
        for i, p in enumerate(prompts):
            e.add_request(e.make_request({"prompt_token_ids": p}, params, request_id=f"r{i}"))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running) or e.scheduler.waiting:
            e.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            e.step()
        rates[name] = batch * steps / (time.perf_counter() - t0)
        while e.has_unfinished():
            e.step()
        print(f"  {name:9s} {rates[name]:7.1f} tok/s  x{rates[name] / rates['float32']:.2f} vs float32", flush=True)
        del llm, e


def agreement(num: int) -> None:
    from runtime import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=48, min_tokens=48)
    outs = {}
    for name in DTYPES:
        llm = LLM(SPEC, max_model_len=512, kv_cache_dtype=name)
        tok = llm.engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS[:num]]
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    print(f"agreement: greedy, 48 tokens, {num} chat prompts, vs float32 pages")
    for name in ("bfloat16", "int8"):
        same = sum(a == b for a, b in zip(outs[name], outs["float32"]))
        firsts = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                  for a, b in zip(outs[name], outs["float32"]) if a != b]
        print(f"  {name:9s} {same}/{num} identical; others first differ at token {firsts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--agreement", type=int, default=8, help="prompts for the greedy agreement check (0: skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    capacity(args.ctx, int(args.budget_gib * 2**30))
    kernel(args.ctx, args.batch, args.reps)
    if not args.skip_engine:
        engine(args.ctx, args.batch, args.steps)
    if args.agreement:
        agreement(args.agreement)


if __name__ == "__main__":
    main()
