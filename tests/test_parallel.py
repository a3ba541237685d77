"""Tensor and pipeline parallel on CPU (gloo, one torch thread per rank, fp32): tp=2 and pp=2
give tp=1's tokens.

Each model runs one workload at tp=1, tp=2 and pp=2 under the same engine knobs: chunked prefill
(a 16-token budget), a pool tight enough to preempt, prefix caching (prompts sharing two
blocks arrive after the first is cached) and staggered arrivals; greedy tokens, preemption
counts and prefix-hit counts must be equal, and every block must come back. Worker processes
never outlive a test (`tp_llm` stops and joins them, and checks they are gone).
"""
from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.executor import WorkerDiedError
from tests.zoo_parity import assert_all_free, staggered

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "zoo"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextmanager
def tp_llm(model, **kwargs):
    """An LLM whose worker processes are stopped, joined and checked gone afterwards."""
    llm = LLM(model, **kwargs)
    pids = list(getattr(llm.engine.executor, "worker_pids", []))
    try:
        yield llm
    finally:
        llm.engine.close()
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(p) for p in pids), f"worker processes left running: {pids}"


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()   # noqa: E731
    shared = ids(32)                            # two full blocks the later prompts hit
    return [shared + ids(9), ids(23), ids(41), shared + ids(5), ids(7), shared + ids(17)]


def _workload(llm: LLM) -> tuple[list[list[int]], dict]:
    """Staggered arrivals, then (state layers hit at a saved checkpoint) the shared prefix again."""
    prompts = _prompts(llm.engine.spec.vocab_size)
    out = staggered(llm, prompts, GREEDY, first=2, start_after=3)
    for again in (prompts[0][:32] + prompts[2][:9], prompts[0][:32] + prompts[1][:6]):
        out += [llm.generate({"prompt_token_ids": again}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids]
    stats = llm.kv_cache_stats()
    assert_all_free(llm)
    return out, {k: stats[k] for k in ("num_preemptions", "prefix_cache_hits")}


MODELS = {    # model -> the pool that makes this workload preempt (blocks incl. the null block)
    "smollm2-tiny": 10, "mistral-sw-small": 9, "bamba-small": 24, "qwen3-next-small": 24,
    "deepseek-v3-small": 10,
}


def _knobs(name: str) -> dict:
    return dict(max_num_batched_tokens=16, num_kv_blocks=MODELS[name], max_model_len=128,
                enable_prefix_caching=True, max_num_seqs=4)


@pytest.fixture(scope="module")
def smollm2_tp2():
    """smollm2-tiny at tp=2 under the parity knobs, shared by the tests below."""
    with tp_llm(ZOO / "smollm2-tiny.yaml", tensor_parallel_size=2, **_knobs("smollm2-tiny")) as llm:
        yield llm


PP_SLOW = {"mistral-sw-small", "qwen3-next-small", "deepseek-v3-small"}   # their pp=2 runs with -m slow (time budget)


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_and_pp2_match_tp1(name, request):
    ref, ref_stats = _workload(LLM(ZOO / f"{name}.yaml", **_knobs(name)))
    assert len({tuple(r) for r in ref}) == len(ref), "outputs must vary across prompts"
    assert ref_stats["num_preemptions"] > 0 and ref_stats["prefix_cache_hits"] > 0, ref_stats
    if name == "smollm2-tiny":
        got, stats = _workload(request.getfixturevalue("smollm2_tp2"))
    else:
        with tp_llm(ZOO / f"{name}.yaml", tensor_parallel_size=2, **_knobs(name)) as llm:
            got, stats = _workload(llm)
    assert got == ref
    assert stats == ref_stats
    if name not in PP_SLOW:
        _check_pp2(name, ref, ref_stats)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PP_SLOW))
def test_pp2_matches_tp1_slow(name):
    ref, ref_stats = _workload(LLM(ZOO / f"{name}.yaml", **_knobs(name)))
    _check_pp2(name, ref, ref_stats)


def _check_pp2(name: str, ref, ref_stats) -> None:
    """pp=2: two stages of half the layers each, every step as two micro-batches."""
    with tp_llm(ZOO / f"{name}.yaml", pipeline_parallel_size=2, **_knobs(name)) as llm:
        got, stats = _workload(llm)
        model = llm.engine.model
        half = llm.engine.spec.num_layers // 2
        assert list(model.layer_range) == list(range(half))
        assert all(p.numel() == 0 for p in model.layers[-1].parameters())         # stage 1's layers dropped here
        assert getattr(model.lm_head, "packed", model.lm_head.weight).numel() == 0
        if name == "smollm2-tiny":          # sampled rows and logprobs come back from the last stage
            _check_sampled(llm)
    assert got == ref
    assert stats == ref_stats


def test_shards_are_halves(smollm2_tp2):
    """Each rank holds half the heads, half the MLP, half the vocab, and half of each KV page
    under the same number of blocks."""
    ref = LLM(ZOO / "smollm2-tiny.yaml", **_knobs("smollm2-tiny"))
    full, half = ref.engine.model, smollm2_tp2.engine.model
    assert half.lm_head.weight.shape[0] * 2 == full.lm_head.weight.shape[0]
    assert half.embed_tokens.weight.shape[0] * 2 == full.embed_tokens.weight.shape[0]
    a_full, a_half = full.layers[0].self_attn, half.layers[0].self_attn
    assert (a_half.num_heads, a_half.num_kv_heads) == (2, 1) and (a_full.num_heads, a_full.num_kv_heads) == (4, 2)
    w_full, w_half = full.layers[0].mlp.down_proj.weight, half.layers[0].mlp.down_proj.weight
    assert w_half.shape == (w_full.shape[0], w_full.shape[1] // 2)
    assert torch.equal(w_half, w_full[:, : w_full.shape[1] // 2])     # rank 0: the first half of the columns
    kv_full, kv_half = ref.engine.runner.kv_caches[0], smollm2_tp2.engine.runner.kv_caches[0]
    assert kv_half.numel() * 2 == kv_full.numel()
    assert smollm2_tp2.engine.kv_manager.config.num_blocks == ref.engine.kv_manager.config.num_blocks


def test_sampled_and_logprobs_match(smollm2_tp2):
    """Seeded sampling gathers the full logits and broadcasts rank 0's draw: same tokens,
    logprobs within float32 tolerance."""
    _check_sampled(smollm2_tp2)


def _check_sampled(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_k=50, seed=3, max_tokens=8, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in _prompts(49152)[:3]]
    ref = LLM(ZOO / "smollm2-tiny.yaml", **_knobs("smollm2-tiny")).generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert len({tuple(r.outputs[0].token_ids) for r in ref}) == len(ref)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lr.keys() == lg.keys()
            assert all(abs(lr[t].logprob - lg[t].logprob) < 1e-4 for t in lr)
    assert_all_free(llm)


def test_startup_checks_are_one_line():
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 3: attention.num_heads is 4; .*divide") as e:
        LLM(ZOO / "smollm2-tiny.yaml", tensor_parallel_size=3)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="layer kind short_conv has no tensor-parallel rule"):
        LLM(ZOO / "lfm2-small.yaml", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="compile and cuda_graphs are not supported"):
        LLM(ZOO / "smollm2-tiny.yaml", tensor_parallel_size=2, compile=True)
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size 3: layers.num is 2; .*must divide it$"):
        LLM(ZOO / "smollm2-tiny.yaml", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="cannot both exceed 1"):
        LLM(ZOO / "smollm2-tiny.yaml", pipeline_parallel_size=2, tensor_parallel_size=2)


@pytest.mark.parametrize("dim", ["tensor", pytest.param("pipeline", marks=pytest.mark.slow)])
def test_killed_worker_is_a_clear_error(dim):
    with tp_llm(ZOO / "smollm2-tiny.yaml", **{f"{dim}_parallel_size": 2}, max_model_len=128,
                parallel_timeout_s=10) as llm:
        engine = llm.engine
        engine.add_request(engine.make_request({"prompt_token_ids": list(range(3, 30))}, GREEDY))
        engine.step()
        pid = engine.executor.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"^{dim}-parallel rank 1 \(pid {pid}\) died with exit code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerDiedError, match="rank 1"):      # the engine stays failed
            engine.step()


@pytest.mark.slow      # ~20 s: the timeout, then a stopped rank's own timeout at shutdown
def test_stuck_worker_times_out():
    """A rank that stops answering (SIGSTOP) fails the step within the collective timeout."""
    with tp_llm(ZOO / "smollm2-tiny.yaml", tensor_parallel_size=2, max_model_len=128,
                parallel_timeout_s=3) as llm:
        engine = llm.engine
        engine.add_request(engine.make_request({"prompt_token_ids": list(range(3, 30))}, GREEDY))
        engine.step()
        pid = engine.executor.worker_pids[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(WorkerDiedError, match="times out after 3 s"):
                engine.step()
            assert time.monotonic() - start < 3 + 5
        finally:
            os.kill(pid, signal.SIGCONT)


SERVER_TESTS = ("test_completion_matches_offline_greedy", "test_chat_completion_uses_the_chat_template",
                "test_streaming_equals_non_streaming", "test_n_and_seeds", "test_stop_strings", "test_logprobs",
                "test_error_responses", "test_load_with_disconnects")


@pytest.mark.slow      # ~60-90 s on 2 shared cores: a server start with two ranks and eight server tests
def test_server_with_tensor_parallel_size_2(tmp_path):
    """`serve --tensor-parallel-size 2` passes the server tests (tests/test_server.py, run
    against it); a killed worker then turns /health into 503 and requests into a clear error;
    SIGINT leaves no worker behind."""
    import httpx
    import openai
    import psutil

    from tests import test_server
    from tests.serving import running_server, tiny_chat_spec

    spec = tiny_chat_spec(tmp_path)
    key = test_server.KEY
    with running_server(spec, "--api-key", key, "--max-body-bytes", "20000", "--body-timeout", "3",
                        "--tensor-parallel-size", "2") as (proc, base):
        workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())
                   and "resource_tracker" not in " ".join(c.cmdline())]
        assert len(workers) == 1
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
        llm = LLM(spec)
        for name in SERVER_TESTS:
            fn = getattr(test_server, name)
            args = {"client": client, "llm": llm, "server": base}
            fn(**{k: args[k] for k in fn.__code__.co_varnames[:fn.__code__.co_argcount]})
        workers[0].kill()
        deadline = time.monotonic() + 10
        while not _dead(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.APIError, match="rank 1"):
            client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=4)
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]
    deadline = time.monotonic() + 10
    while not all(_dead(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_dead(w) for w in workers)


def _dead(proc) -> bool:
    """Gone, or a zombie its parent has not reaped yet (psutil.Process)."""
    import psutil
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow      # ~20 s: two worker starts' worth
def test_failed_start_leaves_no_worker():
    """A pool too small for one request fails the start after the workers are up: they stop."""
    import psutil
    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM(ZOO / "smollm2-tiny.yaml", tensor_parallel_size=2, num_kv_blocks=3, max_model_len=128)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        new = [c for c in psutil.Process().children() if c.pid not in before and not _dead(c)
               and "resource_tracker" not in " ".join(c.cmdline())]
        if not new:
            break
        time.sleep(0.05)
    assert not new, new


@pytest.mark.slow      # ~15 s each: more families (biases and sinks, MoE, hybrids of both kinds)
@pytest.mark.parametrize("name", ["gpt-oss-small", "qwen3-moe-small", "granite-hybrid-small", "falcon-h1-small",
                                  "nemotron-h-small", "qwen3.5-small", "smollm3-small"])
def test_tp2_more_families(name):
    knobs = dict(max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=64)
    prompts = _prompts(512)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(ZOO / f"{name}.yaml", **knobs).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert len({tuple(r) for r in ref}) == len(ref)
    with tp_llm(ZOO / f"{name}.yaml", tensor_parallel_size=2, **knobs) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    assert got == ref


def test_micro_batches_split_one_step():
    """A step's requests as two micro-batches of about half the tokens each: the batch delta
    and the copies before the forward go with the first, the copies after it with the second."""
    from runtime.executor.pipeline import split_micro_batches
    from runtime.scheduler import SchedulerOutput
    so = SchedulerOutput(num_scheduled_tokens={"a": 9, "b": 1, "c": 1, "d": 7}, total_num_scheduled_tokens=18,
                         finished_req_ids={"x"}, copies_before=[(0, [1], [2])], copies_after=[(0, [3], [4])],
                         new_block_ids={"b": [[5]]})
    first, second = split_micro_batches(so)
    assert first.num_scheduled_tokens == {"a": 9} and first.total_num_scheduled_tokens == 9
    assert second.num_scheduled_tokens == {"b": 1, "c": 1, "d": 7} and second.total_num_scheduled_tokens == 9
    assert first.finished_req_ids == {"x"} and first.new_block_ids == {"b": [[5]]} and not second.new_block_ids
    assert first.copies_before == [(0, [1], [2])] and not second.copies_before
    assert not first.copies_after and second.copies_after == [(0, [3], [4])]
    assert split_micro_batches(SchedulerOutput(num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3))[0] \
        .num_scheduled_tokens == {"a": 3}
