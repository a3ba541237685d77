"""Where an engine step's time goes: schedule, input prep, forward, sample, update.

    python -m bench.profile_step [--model tiny-llama] [--threads 1] [--decodes 64,256] [--decode-steps 30]
        [--workload/--no-workload] [--prefix-caching] [--cprofile N] [--torch-profile]
        [--against GIT_REF]

Two measurements, by default on the tiny random Llama of `bench.throughput` (hidden 256,
4 layers, vocab 32000, fp32; `--model smollm2` or any model `bench.throughput` takes):
- the throughput workload (64 requests, prompts 64-256 tokens, 64 greedy new tokens each,
  max_num_seqs=64, max_num_batched_tokens=2048) through `LLM.generate`, with tok/s;
- a steady-state decode microbench: N requests are prefilled, then `--decode-steps` steps
  in which every running request decodes one token are timed (N = 64 and 256).

Timing wraps the engine's own methods from here (no hooks live in engine code): every
wrapper is one `time.perf_counter()` pair, and on CPU nothing is asynchronous, so the
phases are exact without syncs. A step splits into
- schedule: `Scheduler.schedule`
- prep:     `ModelRunner.execute` up to the forward (batch delta, input ids/positions,
            slot mappings, attention plans)
- forward:  the model forward (embedding, layers, final norm)
- sample:   the rest of `execute` (LM head on the sampled rows, sampler, write-back)
- update:   the rest of `Engine.step` (`Scheduler.update`, outputs, detokenizer)
and engine overhead = everything but the forward (the LM head is counted in `sample`, and
shown on its own as `lm_head`, since it is model compute that only the sampled rows need;
when a greedy step takes its tokens from a fused head kernel (`zooinfer_kernels.lm_head.GreedyHead`),
`lm_head` includes that kernel's argmax).

`--against REF` runs every measurement twice in the same process, alternating: once as
the tree is, once with the torch attention backend and the sampler as they were at git
REF (loaded from `git show`, swapped into the runner), and prints the ratio. Runner,
scheduler and model code are the current tree's in both.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import types
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from bench.throughput import make_workload, resolve_model  # noqa: E402

PHASES = ("schedule", "prep", "forward", "sample", "update")
MODEL: dict = {}    # --model: "name", "path" and the "vocab" the random prompts draw from


def set_model(name: str) -> None:
    label, path = resolve_model(name)
    from models import resolve_spec
    MODEL.update(name=label, path=str(path), vocab=resolve_spec(path).vocab_size)


def model() -> dict:
    """The model set by `set_model` (tiny Llama for callers that set none, e.g. bench/test_bench_engine.py)."""
    if not MODEL:
        set_model("tiny-llama")
    return MODEL


@dataclass
class StepRecord:
    tokens: int = 0          # scheduled tokens
    decodes: int = 0         # requests scheduled for exactly one token
    phases: dict[str, float] = field(default_factory=dict)
    lm_head: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.phases.values())


class StepTimer:
    """Wraps one engine's step, schedule, execute, forward, compute_logits and sampler."""

    def __init__(self, engine):
        self.engine = engine
        self.records: list[StepRecord] = []
        self.enabled = True
        self._cur: StepRecord | None = None
        self._marks: dict[str, float] = {}
        sched, runner = engine.scheduler, engine.runner
        orig_step, orig_schedule = engine.step, sched.schedule
        orig_execute, orig_forward = runner.execute, runner.forward
        orig_logits = runner.model.compute_logits
        clock = time.perf_counter
        marks = self._marks

        def step():
            if not self.enabled:
                return orig_step()
            self._cur = rec = StepRecord()
            marks.clear()
            t0 = clock()
            outputs = orig_step()
            t1 = clock()
            if "execute_end" in marks and rec.tokens:
                rec.phases["schedule"] = marks["schedule_end"] - t0
                fwd_start = marks.get("forward_start", marks["execute_end"])
                fwd_end = marks.get("forward_end", fwd_start)
                rec.phases["prep"] = fwd_start - marks["execute_start"]
                rec.phases["forward"] = fwd_end - fwd_start
                rec.phases["sample"] = marks["execute_end"] - fwd_end
                rec.phases["update"] = t1 - marks["execute_end"]
                self.records.append(rec)
            self._cur = None
            return outputs

        def schedule():
            so = orig_schedule()
            marks["schedule_end"] = clock()
            if self._cur is not None:
                self._cur.tokens = so.total_num_scheduled_tokens
                self._cur.decodes = sum(1 for n in so.num_scheduled_tokens.values() if n == 1)
            return so

        def execute(so):
            marks["execute_start"] = clock()
            out = orig_execute(so)
            marks["execute_end"] = clock()
            return out

        def forward(*args, **kwargs):
            marks["forward_start"] = clock()
            out = orig_forward(*args, **kwargs)
            marks["forward_end"] = clock()
            return out

        def compute_logits(hidden):
            t0 = clock()
            out = orig_logits(hidden)
            if self._cur is not None:
                self._cur.lm_head += clock() - t0
            return out

        from zooinfer_kernels import lm_head

        def timed(kernel):   # the fused LM head + argmax kernels: counted as the LM head
            def run(*args):
                t0 = clock()
                out = kernel(*args)
                if self._cur is not None:
                    self._cur.lm_head += clock() - t0
                return out
            return run

        engine.step, sched.schedule, runner.execute, runner.forward = step, schedule, execute, forward
        runner.model.compute_logits = compute_logits
        # The model's GreedyHead calls these by module name; one engine per bench process.
        lm_head.linear_argmax, lm_head.screened_argmax = timed(lm_head.linear_argmax), timed(lm_head.screened_argmax)
        lm_head.quant_head.quant_argmax = timed(lm_head.quant_head.quant_argmax)   # a quantized head's

    def reset(self) -> None:
        self.records.clear()


def summarize(records: list[StepRecord]) -> dict:
    """Mean ms per step per phase, share of the step, and engine overhead (all but forward)."""
    if not records:
        return {}
    n = len(records)
    total = sum(r.total for r in records)
    row = {p: 1e3 * sum(r.phases[p] for r in records) / n for p in PHASES}
    row["lm_head"] = 1e3 * sum(r.lm_head for r in records) / n
    row["step"] = 1e3 * total / n
    row["median_step"] = 1e3 * statistics.median(r.total for r in records)
    row["overhead_pct"] = 100 * (total - sum(r.phases["forward"] for r in records)) / total
    row["overhead_ex_lm_head_pct"] = 100 * (total - sum(r.phases["forward"] + r.lm_head for r in records)) / total
    row["steps"] = n
    row["tokens_per_step"] = sum(r.tokens for r in records) / n
    return row


def print_table(title: str, row: dict) -> None:
    if not row:
        print(f"{title}: no steps")
        return
    step = row["step"]
    print(f"{title}: {row['steps']} steps, {row['tokens_per_step']:.0f} tokens/step, "
          f"{step:.2f} ms/step mean ({row['median_step']:.2f} median)")
    print(f"  {'phase':<10}{'ms/step':>10}{'% step':>9}")
    for p in PHASES:
        print(f"  {p:<10}{row[p]:>10.3f}{100 * row[p] / step:>8.1f}%")
    print(f"  {'(lm_head)':<10}{row['lm_head']:>10.3f}{100 * row['lm_head'] / step:>8.1f}%  (inside sample)")
    print(f"  engine overhead (all but forward): {row['overhead_pct']:.1f}%; "
          f"all but forward and LM head: {row['overhead_ex_lm_head_pct']:.1f}%")


def load_at(ref: str, path: str, name: str) -> types.ModuleType:
    """A module's source as it was at git `ref`, as a fresh module object."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "show", f"{ref}:{path}"], check=True, capture_output=True, text=True,
                         cwd=root).stdout
    mod = types.ModuleType(name)
    mod.__file__ = f"{ref}:{path}"
    sys.modules[name] = mod     # dataclasses look their module up while the class is built
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def swap_in(engine, ref: str | None) -> None:
    """Give the runner the torch backend and sampler of git `ref` (None: keep the tree's)."""
    if ref is None:
        return
    backend = load_at(ref, "attention/torch_backend.py", "_ref_torch_backend")
    try:
        sampler = load_at(ref, "runtime/worker/sampler.py", "_ref_sampler")
    except subprocess.CalledProcessError:   # refs from before the worker package
        sampler = load_at(ref, "runtime/sampler.py", "_ref_sampler")
    engine.runner.backend = backend.TorchAttentionBackend()
    engine.runner.sampler = sampler.Sampler()


def make_engine(max_num_seqs: int, ref: str | None = None):
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, dtype="float32")
    engine = Engine(model()["path"], cfg)
    swap_in(engine, ref)
    return engine


def variants(args) -> list[str | None]:
    return [None] if args.against is None else [None, args.against]


def label(ref: str | None) -> str:
    return "tree" if ref is None else f"@{ref}"


def alternate(rounds: int, items: list):
    """(round, item) pairs, the order flipped every round so drift hits every item alike."""
    for r in range(rounds):
        for item in (items if r % 2 == 0 else items[::-1]):
            yield r, item


def median_row(rows: list[dict]) -> dict:
    return sorted(rows, key=lambda r: r["step"])[len(rows) // 2]


def run_workload(args) -> dict:
    from runtime import LLM, SamplingParams
    prompts = make_workload(64, 64, 256, model()["vocab"], seed=0)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    runs = {}
    for ref in variants(args):
        # Prefix caching off by default: with it, every round after the first would find its
        # prompts cached by the previous round and skip most of the prefill.
        llm = LLM(model()["path"], max_num_seqs=64, max_num_batched_tokens=2048, dtype="float32",
                  enable_prefix_caching=args.prefix_caching)
        swap_in(llm.engine, ref)
        timer = StepTimer(llm.engine)
        llm.generate(reqs[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        runs[ref] = dict(llm=llm, timer=timer, tok_s=[], rows=[], outputs=None)
    for _, ref in alternate(args.rounds, list(runs)):
        run = runs[ref]
        run["timer"].reset()
        t0 = time.perf_counter()
        outs = run["llm"].generate(reqs, sp, use_tqdm=False)
        run["tok_s"].append(64 * 64 / (time.perf_counter() - t0))
        run["rows"].append(summarize(run["timer"].records))
        run["outputs"] = [o.outputs[0].token_ids for o in outs]
    for ref, run in runs.items():
        tok_s = run["tok_s"]
        print(f"{model()['name']} workload [{label(ref)}]: {statistics.median(tok_s):.1f} out tok/s median "
              f"({', '.join(f'{t:.1f}' for t in tok_s)})")
        print_table("  all steps (median round)", median_row(run["rows"]))
    if args.against is not None:
        a, b = (statistics.median(runs[r]["tok_s"]) for r in variants(args))
        same = runs[None]["outputs"] == runs[args.against]["outputs"]
        print(f"  ratio tree / @{args.against}: {a / b:.2f}x out tok/s; greedy outputs identical: {same}")
    if args.cprofile:
        llm = runs[None]["llm"]
        run_cprofile(lambda: llm.generate(reqs, sp, use_tqdm=False), args.cprofile)
    return runs


def prefill_to_decode(engine, n: int, max_tokens: int) -> None:
    """Add n requests and step until every one of them is decoding."""
    from runtime.sampling_params import RequestOutputKind, SamplingParams
    # FINAL_ONLY, as LLM.generate asks for: the decode steps are then the offline path's.
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for p in make_workload(n, 64, 256, model()["vocab"], seed=1):
        engine.add_request(engine.make_request({"prompt_token_ids": p}, sp))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    engine.step()   # the first step where every request decodes


def run_decode(args, n: int) -> dict:
    runs = {}
    for ref in variants(args):
        engine = make_engine(n, ref)
        timer = StepTimer(engine)
        timer.enabled = False
        # Early requests decode while later ones prefill (about n * 160 / 2048 steps); every
        # request must still be running after the warm-up, the rounds and the profilers.
        prefill_to_decode(engine, n, max_tokens=n * 256 // 2048 + args.decode_steps * (args.rounds + 2) + 8)
        timer.enabled = True
        for _ in range(3):   # warm the decode path
            engine.step()
        runs[ref] = dict(engine=engine, timer=timer, rows=[])
    for _, ref in alternate(args.rounds, list(runs)):
        run = runs[ref]
        run["timer"].reset()
        for _ in range(args.decode_steps):
            run["engine"].step()
        assert all(r.decodes == n for r in run["timer"].records), "a measured step was not all decodes"
        run["rows"].append(summarize(run["timer"].records))
    for ref, run in runs.items():
        row = run["row"] = median_row(run["rows"])
        print_table(f"steady decode, {n} running requests [{label(ref)}] (median of {args.rounds} rounds)", row)
        print(f"  -> {1e3 * n / row['step']:.1f} out tok/s at this batch")
    if args.against is not None:
        a, b = (runs[r]["row"]["step"] for r in variants(args))
        print(f"  ratio step time @{args.against} / tree: {b / a:.2f}x")
    engine = runs[None]["engine"]
    if args.torch_profile:
        run_torch_profile(engine, args.decode_steps)
    if args.cprofile:
        run_cprofile(lambda: [engine.step() for _ in range(args.decode_steps)], args.cprofile)
    return runs


def run_cprofile(fn, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(buf.getvalue())


def run_torch_profile(engine, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama | smollm2 | gemma3 | spec yaml | HF dir")
    ap.add_argument("--decodes", default="64,256", help="comma list of running-request counts")
    ap.add_argument("--decode-steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--cprofile", type=int, nargs="?", const=25, default=0,
                    help="also print the top N cProfile entries by own time")
    ap.add_argument("--torch-profile", action="store_true", help="torch profiler table for decode steps")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                    help="workload: keep prefix caching on (later rounds then hit the first round's prompts)")
    ap.add_argument("--against", default=None, metavar="GIT_REF",
                    help="also run with the torch backend and sampler of this git ref, alternating; print ratios")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    set_model(args.model)
    print(f"{model()['name']}: torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    if args.workload:
        run_workload(args)
    for n in [int(x) for x in args.decodes.split(",") if x.strip()]:
        run_decode(args, n)
    print(f"load at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
