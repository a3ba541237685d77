"""Tensor-parallel step time, split into compute and communication, at tp = 1 and 2.

    python -m bench.parallel [--tp 1,2] [--pp 2] [--batch 16] [--prompt-len 128] [--decode-steps 20]
        [--threads 1] [--model SPEC]

Default model: a random Llama-shaped spec (hidden 512, 8 layers, 8 query / 4 KV heads of 64,
MLP 1536, SmolLM2's vocab of 49152, fp32; SmolLM2-135M itself has 9 heads, which 2 ranks
cannot split). `--batch` requests of `--prompt-len` tokens are prefilled in one step (timed
as "prefill"), then `--decode-steps` steps in which every request decodes one greedy token
are timed. Each rank runs `--threads` torch threads (default 1, so tp=2 uses the machine's
two cores and tp=1 one of them).

Per step, on rank 0: wall time of `Engine.step`, and the seconds spent in the model's
collectives (`TPGroup.comm_seconds`: all-reduces after each row-parallel product and the
embedding, the vocab-parallel greedy (max, index) exchange; with `--pp`, a row for that many
pipeline stages: the sends to stage 1 and the wait for the last stage's tokens). Communication includes the
wait for the slower rank, so it also measures load imbalance; compute is the rest (rank 0's
scheduling, input prep and its shard's forward). Medians over the timed steps.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from runtime import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent

SPEC = f"""extends: {ROOT / 'zoo' / 'smollm2-135m.yaml'}
name: bench-parallel
hidden_size: 512
layers:
  num: 8
attention:
  num_heads: 8
  num_kv_heads: 4
  head_dim: 64
mlp:
  intermediate_size: 1536
max_model_len: 1024
checkpoint:
  source: dummy
  init_std: 0.05
"""


def measure(model: str, tp: int, batch: int, prompt_len: int, decode_steps: int, pp: int = 1) -> dict:
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
              num_kv_blocks=batch * (prompt_len + decode_steps + 16) // 16 + 8, max_model_len=1024)
    engine = llm.engine
    tpg = engine.executor.tp
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 2, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    try:
        # one warm-up request end to end (first-call allocations, kernel build)
        engine.warm_up(params)
        for i in range(batch):
            ids = torch.randint(3, engine.spec.vocab_size, (prompt_len,), generator=g).tolist()
            engine.add_request(engine.make_request({"prompt_token_ids": ids}, params))
        steps = []
        for i in range(decode_steps + 1):
            comm0 = tpg.comm_seconds if tpg is not None else 0.0
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            steps.append((wall, (tpg.comm_seconds if tpg is not None else 0.0) - comm0))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()
    decode = steps[1:]
    med = lambda xs: statistics.median(xs) * 1e3       # noqa: E731
    return {"prefill_ms": steps[0][0] * 1e3, "prefill_comm_ms": steps[0][1] * 1e3,
            "decode_ms": med([w for w, _ in decode]), "decode_comm_ms": med([c for _, c in decode])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--pp", type=int, default=0, help="also measure this many pipeline stages (0: none)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="zoo YAML (default: the Llama-shaped spec above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "bench-parallel.yaml")
            Path(model).write_text(SPEC)
        rows = {f"tp={tp}": measure(model, tp, args.batch, args.prompt_len, args.decode_steps)
                for tp in (int(t) for t in args.tp.split(","))}
        if args.pp > 1:
            rows[f"pp={args.pp}"] = measure(model, 1, args.batch, args.prompt_len, args.decode_steps, pp=args.pp)
    print(f"{args.batch} requests x {args.prompt_len} prompt tokens, {args.decode_steps} decode steps, "
          f"{args.threads} thread(s) per rank; rank 0's step time, median ms")
    print(f"{'ranks':>6} {'phase':>8} {'step':>9} {'compute':>9} {'comm':>9} {'comm %':>7}")
    for name, r in rows.items():
        for phase in ("prefill", "decode"):
            step, comm = r[f"{phase}_ms"], r[f"{phase}_comm_ms"]
            print(f"{name:>6} {phase:>8} {step:9.2f} {step - comm:9.2f} {comm:9.2f} {100 * comm / step:6.1f}%")
    base = rows.get("tp=1")
    for name, r in rows.items():
        if base is not None and name != "tp=1":
            print(f"{name} / tp=1 step time: prefill {r['prefill_ms'] / base['prefill_ms']:.2f}x, "
                  f"decode {r['decode_ms'] / base['decode_ms']:.2f}x")


if __name__ == "__main__":
    main()
