"""pytest-benchmark suites of the whole engine on the tiny random Llama of `bench.throughput`:
offline throughput (ours, and each peer whose venv exists), time to first token and
per-token latency at batch 1 and 32, prefix caching on and off, and the step breakdown.

    pytest bench/test_bench_engine.py --benchmark-only [--benchmark-autosave]
    pytest bench/test_bench_engine.py --benchmark-only --benchmark-compare=0001 --benchmark-compare-fail=median:10%

Not collected by the default `pytest` run (testpaths = ["tests"]). Every benchmark checks
what it ran (output counts, all-decode steps, cache hit rates), and its `extra_info` carries
the rate it stands for (tok/s, TTFT or per-token ms), the CPU model, its flags and the kernel
paths (`zooinfer_kernels.cpu_features`), so a saved run says which path it measured.
ZOOINFER_BENCH_THREADS sets the torch threads (default 1: the machines are shared).
"""
from __future__ import annotations

import os

import pytest
import torch

from bench.peers import VENV_PEERS, is_installed
from bench.prefix_cache import run as run_prefix_workload
from bench.profile_step import StepTimer, make_engine, prefill_to_decode, summarize
from bench.throughput import TINY_LLAMA, Peer, ensure_tiny_llama, make_workload, model_key
from zooinfer_kernels import cpu_features, lm_head

THREADS = int(os.environ.get("ZOOINFER_BENCH_THREADS", "1"))
REQUESTS, NEW_TOKENS = 32, 32          # the offline workload: prompts 64-256 tokens
torch.set_num_threads(THREADS)


def _info(benchmark, **values) -> None:
    """extra_info: the measured rates plus the CPU and the kernel paths that produced them."""
    s = cpu_features.summary()
    benchmark.extra_info.update(cpu_model=s["cpu_model"], cpu_flags=" ".join(s["cpu_flags"]), threads=THREADS,
                                **{f"path_{k}": v for k, v in s["kernel_paths"].items()}, **values)


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    return make_workload(REQUESTS, 64, 256, TINY_LLAMA["vocab_size"], seed=0)


@pytest.fixture(scope="module")
def llm():
    from runtime import LLM
    return LLM(str(ensure_tiny_llama()), max_num_seqs=64, max_num_batched_tokens=2048, dtype="float32")


def _generate(llm, prompts, new_tokens: int) -> list[list[int]]:
    from runtime import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)]


def test_offline_throughput_ours(benchmark, llm, workload):
    _generate(llm, workload[:4], 4)   # warm-up
    outs = benchmark.pedantic(_generate, args=(llm, workload, NEW_TOKENS), rounds=3, iterations=1)
    assert [len(o) for o in outs] == [NEW_TOKENS] * REQUESTS
    _info(benchmark, out_tok_s=REQUESTS * NEW_TOKENS / benchmark.stats.stats.median)


@pytest.mark.parametrize("peer", VENV_PEERS)
def test_offline_throughput_peer(benchmark, peer, workload):
    """The same workload on a peer in its own venv (`python -m bench.peers.setup`)."""
    if not is_installed(peer):
        pytest.skip(f"no {peer} venv (python -m bench.peers.setup)")
    hf_dir = ensure_tiny_llama()
    eng = Peer(peer, hf_dir, model_key(hf_dir), workload, NEW_TOKENS, THREADS, 256 + NEW_TOKENS + 16)
    try:
        outs = benchmark.pedantic(eng.run, args=(workload, NEW_TOKENS), rounds=3, iterations=1)
    finally:
        eng.close()
    assert [len(o) for o in outs] == [NEW_TOKENS] * REQUESTS
    _info(benchmark, out_tok_s=REQUESTS * NEW_TOKENS / benchmark.stats.stats.median, peer_version=eng.version)


@pytest.mark.parametrize("batch", [1, 32])
def test_time_to_first_token(benchmark, llm, batch):
    """`batch` prompts of 128 tokens, one output token each: the prefill and first sample."""
    prompts = make_workload(batch, 128, 128, TINY_LLAMA["vocab_size"], seed=2)
    _generate(llm, prompts[:1], 1)
    outs = benchmark.pedantic(_generate, args=(llm, prompts, 1), rounds=5, iterations=1)
    assert [len(o) for o in outs] == [1] * batch
    _info(benchmark, ttft_ms=1e3 * benchmark.stats.stats.median, batch=batch)


@pytest.mark.parametrize("batch", [1, 32])
def test_per_token_latency(benchmark, batch):
    """One decode step with `batch` running requests (prompts 64-256 tokens): per-token latency."""
    rounds = 30
    engine = make_engine(max(batch, 2))
    prefill_to_decode(engine, batch, max_tokens=batch * 256 // 2048 + rounds + 16)
    engine.step()
    before = [r.num_output_tokens for r in engine.scheduler.running]
    benchmark.pedantic(engine.step, rounds=rounds, iterations=1)
    after = [r.num_output_tokens for r in engine.scheduler.running]
    assert len(after) == batch and [a - b for a, b in zip(after, before)] == [rounds] * batch   # all decodes
    med = benchmark.stats.stats.median
    _info(benchmark, per_token_ms=1e3 * med, out_tok_s=batch / med, batch=batch)


@pytest.mark.parametrize("caching", ["off", "on"])
def test_prefix_cache(benchmark, caching):
    """16 requests sharing a 512-token prefix, 8 new tokens each; with caching on the prefix
    is computed once (the first round fills the cache; the warm rounds are timed)."""
    from runtime import LLM
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(10, 30000, (512,), generator=g).tolist()
    prompts = [prefix + torch.randint(10, 30000, (24,), generator=g).tolist() for _ in range(16)]
    llm = LLM(str(ensure_tiny_llama()), enable_prefix_caching=caching == "on", max_num_batched_tokens=2048,
              dtype="float32")
    run_prefix_workload(llm, prompts[:1], 2)
    res = benchmark.pedantic(run_prefix_workload, args=(llm, prompts, 8), rounds=3, iterations=1)
    assert (res["hit_rate"] > 0.5) if caching == "on" else res["hit_rate"] == 0
    _info(benchmark, out_tok_s=res["out_tok_s"], ttft_p50_ms=1e3 * res["ttft_p50"], hit_rate=res["hit_rate"])


def test_step_breakdown(benchmark, monkeypatch):
    """10 decode steps at 64 running requests, split by `bench.profile_step.StepTimer` into
    schedule / prep / forward / sample / update (and the LM head); mean ms per phase."""
    for name in ("linear_argmax", "screened_argmax"):   # StepTimer wraps these module-wide: undo after
        monkeypatch.setattr(lm_head, name, getattr(lm_head, name))
    engine = make_engine(64)
    timer = StepTimer(engine)
    timer.enabled = False
    prefill_to_decode(engine, 64, max_tokens=64 * 256 // 2048 + 60)
    timer.enabled = True
    engine.step()
    timer.reset()
    benchmark.pedantic(lambda: [engine.step() for _ in range(10)], rounds=3, iterations=1)
    row = summarize(timer.records)
    assert row["steps"] == 30 and row["tokens_per_step"] == 64
    _info(benchmark, **{f"{k}_ms": round(row[k], 3) for k in ("schedule", "prep", "forward", "sample", "update",
                                                               "lm_head", "step")},
          overhead_pct=round(row["overhead_pct"], 1), out_tok_s=64e3 / row["step"])
