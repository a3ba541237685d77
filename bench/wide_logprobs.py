"""Whole-vocabulary prompt logprobs (prompt_logprobs=-1) offline, with the cyclic GC paused
while the rows are built (runtime/vocab_logprobs.gc_paused) and not, in one run:

    python -m bench.wide_logprobs [--positions 29] [--repeats 3]

A tiny seeded SmolLM2 variant (its real 49152-token vocabulary) so the time is the rows', not
the model's. Prints the median seconds of each mode and their ratio.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=29, help="prompt tokens with a row (the prompt has one more)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import runtime.worker.prompt_logprobs as prompt_logprobs
    from runtime import LLM, SamplingParams
    from tests.serving import tiny_chat_spec
    llm = LLM(str(tiny_chat_spec(Path(tempfile.mkdtemp()))), max_logprobs=49152)
    prompt = {"prompt_token_ids": list(range(100, 101 + args.positions))}
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    llm.generate([prompt], params, use_tqdm=False)              # warm-up (and the vocabulary table)
    paused, times = prompt_logprobs.gc_paused, {"gc on": [], "gc paused": []}
    for _ in range(args.repeats):
        for mode in times:          # interleaved, so both see the same machine load
            prompt_logprobs.gc_paused = paused if mode == "gc paused" else (lambda wide: contextlib.nullcontext())
            t = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            times[mode].append(time.perf_counter() - t)
            assert len(out[0].prompt_logprobs[1]) == llm.engine.spec.vocab_size
    prompt_logprobs.gc_paused = paused
    med = {m: statistics.median(v) for m, v in times.items()}
    for m, v in times.items():
        print(f"{m:10s} median {med[m]:6.2f} s  {[round(x, 2) for x in v]}")
    print(f"{args.positions} positions x {llm.engine.spec.vocab_size} entries: gc paused is "
          f"{med['gc on'] / med['gc paused']:.2f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
