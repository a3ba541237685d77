"""Where a batch-1 decode step of a quantized model spends its time: ``python -m bench.quant_profile``.

    python -m bench.quant_profile [--model gemma3] [--quantization gguf] [--activations int8]
        [--steps 32] [--threads 1] [--no-quant-head]

One request (a 32-token prompt) is prefilled, then `--steps` decode steps are timed twice:
plainly (wall ms per step, median) and under torch.profiler, whose ops are put in buckets:
- head: everything inside the greedy head call (`GreedyHead.__call__`: the LM head product
  and the argmax, or the fused quantized head);
- body linears: the quantized (`zooinfer_cpu::quant_linear*`) and packed fp32 linears;
- attention: the paged KV write and attention kernels;
- norms / elementwise: the fused RMSNorm, add + RMSNorm, rope and act * mul kernels;
- embedding: the token embedding lookup (a `QuantEmbedding` dequantizes its rows);
- other torch ops: every other aten op (views, adds, copies, ...), by its own time.
"Python / dispatch / engine" is the profiled steps' wall time minus the ops' total, i.e. what
no op accounts for: the interpreter, op dispatch, the scheduler and the runner's bookkeeping
(the profiler's own cost lands there too). The plain median step is printed beside it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = ("head", "body linears", "attention", "norms / elementwise", "embedding", "other torch ops")
_KERNEL_BUCKET = {"quant_linear": "body linears", "quant_linear_q8": "body linears", "panel_linear": "body linears",
                  "panel_linear_blocked": "body linears", "_mkl_linear": "body linears",
                  "write_kv": "attention", "paged_decode": "attention", "paged_prefill": "attention",
                  "rms_norm": "norms / elementwise", "add_rms_norm": "norms / elementwise",
                  "rope": "norms / elementwise", "act_mul": "norms / elementwise"}
_MARKS = {"bench::head": "head", "bench::embedding": "embedding"}


def _bucket(evt) -> str:
    """The bucket of a profiler event: its nearest marked ancestor's (head, embedding), else its
    own kernel's, else other torch ops."""
    e = evt
    while e is not None:
        if e.name in _MARKS:
            return _MARKS[e.name]
        e = e.cpu_parent
    short = evt.name.split("::")[-1]
    return _KERNEL_BUCKET.get(short, "other torch ops")


def _mark(obj, attr: str, label: str) -> None:
    """Wrap obj.attr in a profiler range named `label`."""
    orig = getattr(obj, attr)

    def run(*args, **kwargs):
        with torch.profiler.record_function(label):
            return orig(*args, **kwargs)
    setattr(obj, attr, run)


def build(model: str, method: str, activations: str):
    from bench.throughput import resolve_model
    from runtime import LLM
    label, _ = resolve_model(model)
    spec = ROOT / "zoo" / f"{label}.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        overlay = Path(tmp) / f"{label}.yaml"
        overlay.write_text(f"extends: {spec}\nquantization: {{method: {method}, activations: {activations}}}\n")
        return LLM(str(overlay), max_num_seqs=4, max_model_len=1024, enable_prefix_caching=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--activations", default="int8", choices=("float32", "int8"))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quant-head", action=argparse.BooleanOptionalAction, default=True,
                    help="greedy steps on the quantized head's screen (zooinfer_kernels/quant_head.py); "
                         "--no-quant-head: logits then argmax, as before it")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from zooinfer_kernels import lm_head
    from runtime.sampling_params import SamplingParams
    llm = build(args.model, args.quantization, args.activations)
    engine = llm.engine
    model = engine.model
    if not args.quant_head:
        model.lm_head.quant_screen = None
    _mark(lm_head.GreedyHead, "__call__", "bench::head")
    _mark(model.embed_tokens, "forward", "bench::embedding")
    sp = SamplingParams(temperature=0, max_tokens=2 * args.steps + 16, ignore_eos=True)
    engine.add_request(engine.make_request({"prompt_token_ids": list(range(100, 132))}, sp))
    for _ in range(4):           # the prefill and a few warm decode steps
        engine.step()
    wall = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        wall.append(1e3 * (time.perf_counter() - t0))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        profiled = 1e3 * (time.perf_counter() - t0) / args.steps
    ms: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.name in _MARKS:
            continue
        ms[_bucket(evt)] += evt.self_cpu_time_total / 1e3 / args.steps
    step = statistics.median(wall)
    print(f"{args.model} {args.quantization} activations {args.activations}, quant head {args.quant_head}, "
          f"threads {args.threads}, "
          f"load {os.getloadavg()[0]:.1f}: decode step {step:.2f} ms median ({min(wall):.2f}-{max(wall):.2f}), "
          f"{1e3 / step:.1f} tok/s; under the profiler {profiled:.2f} ms (the table's step)")
    step = profiled
    print("| part | ms / step | share |\n|---|---|---|")
    for b in BUCKETS:
        print(f"| {b} | {ms[b]:.2f} | {100 * ms[b] / step:.0f}% |")
    rest = step - sum(ms.values())
    print(f"| Python / dispatch / engine | {rest:.2f} | {100 * rest / step:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
