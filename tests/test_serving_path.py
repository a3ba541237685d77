"""The server path's hand-over from the engine thread to asyncio (runtime/async_engine.py):
one `call_soon_threadsafe` per step for all streams, a lagging stream caught up in one piece,
and through it all every token in order, the same tokens as offline, usage counts exact and
every block back in the pool when a client leaves."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
from starlette.testclient import TestClient

from runtime.async_engine import AsyncEngine, _Stream
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.serve import build_app

N_TOKENS = 24
PARAMS = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [4, 4, 5], [11, 12], [13, 2, 5, 9, 1]]


@pytest.fixture(scope="module")
def engine(tiny_hf):
    return Engine(tiny_hf("llama")[0], EngineConfig(max_model_len=128))


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy tokens of each prompt run alone, straight on the engine."""
    out = []
    for i, ids in enumerate(PROMPTS):
        engine.add_request(engine.make_request({"prompt_token_ids": ids}, PARAMS, request_id=f"ref{i}"))
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    out.append(list(o.outputs[0].token_ids))
    assert len({tuple(t) for t in out}) > 1       # the tiny model does not collapse to one output
    return out


def _all_free(engine: Engine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.kv_cache_stats()
    return not engine.scheduler.requests and stats["num_free_blocks"] == stats["num_blocks"]


def _output(index: int, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(index, "", tokens)], finished)


def test_lagging_stream_takes_the_latest_output_of_each_sample():
    async def run():
        s = _Stream(asyncio.get_running_loop())
        for item in (_output(0, [5]), _output(0, [5, 6]), _output(1, [9]), _output(0, [5, 6, 7]),
                     _output(0, [5, 6, 7, 8], finished=True), _output(1, [9, 3], finished=True)):
            s.put(item)
        got = [await s.get() for _ in range(4)]
        assert not s.items
        return [(o.outputs[0].index, o.outputs[0].token_ids, o.finished) for o in got]

    # cumulative outputs: a later one of the same sample holds the earlier ones' tokens
    assert asyncio.run(run()) == [(0, [5, 6], False), (1, [9], False), (0, [5, 6, 7, 8], True),
                                  (1, [9, 3], True)]


def test_one_handover_per_step_for_all_streams(engine, reference):
    ae = AsyncEngine(engine)
    steps = 0
    step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step
    ae.start()
    handovers = 0

    async def run():
        nonlocal handovers
        loop = asyncio.get_running_loop()
        send = loop.call_soon_threadsafe

        def counted(*a, **kw):
            nonlocal handovers
            handovers += 1
            return send(*a, **kw)

        loop.call_soon_threadsafe = counted
        started = [await ae.add_request({"prompt_token_ids": ids}, PARAMS, f"s{i}") for i, ids in enumerate(PROMPTS)]

        async def consume(stream):
            seen = []
            async for out in stream:
                toks = out.outputs[0].token_ids
                assert toks[:len(seen)] == seen and len(toks) > len(seen)     # in order, nothing lost
                seen = list(toks)
            return seen, out.finished

        return await asyncio.gather(*(consume(s) for _, s in started))

    try:
        results = asyncio.run(run())
    finally:
        engine.step = step
        ae.shutdown()
    assert [toks for toks, _ in results] == reference and all(done for _, done in results)
    # admissions are answered once per drain of commands (at most one per request), outputs once
    # per step: one per stream per token would be len(PROMPTS) * N_TOKENS = 120 hand-overs
    assert handovers <= steps + len(PROMPTS), (handovers, steps)
    assert _all_free(engine)


def test_slow_consumer_gets_one_chunk_with_every_token(engine, reference):
    ae = AsyncEngine(engine)
    ae.start()

    async def run():
        _, stream = await ae.add_request({"prompt_token_ids": PROMPTS[1]}, PARAMS, "slow")
        while engine.has_unfinished() or ae._pending:     # the consumer is away for the whole request
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return [out async for out in stream]

    try:
        outs = asyncio.run(run())
    finally:
        ae.shutdown()
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].token_ids == reference[1]
    assert _all_free(engine)


def _sse(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def test_streamed_usage_and_disconnect_free_blocks(engine, reference):
    """One prompt streams straight from its engine stream (no pump task): every token's text
    in order, usage exact; a client that leaves after two chunks gets its blocks freed."""
    ae = AsyncEngine(engine)
    ae.start()
    body = {"prompt": PROMPTS[0], "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    try:
        with TestClient(build_app(ae, "m")) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                chunks = _sse(r.iter_lines())
            tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
            assert tokens == reference[0]
            assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPTS[0]), "completion_tokens": N_TOKENS,
                                           "total_tokens": len(PROMPTS[0]) + N_TOKENS,
                                           "prompt_tokens_details": {"cached_tokens": 0}}
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
            plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            text = http.post("/v1/completions", json=plain).json()["choices"][0]["text"]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
            with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 100}) as r:
                for n, _ in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
                    if n == 1:
                        break
        assert _all_free(engine)
    finally:
        ae.shutdown()


def test_text_prompts_are_tokenized_off_the_engine_thread(tmp_path):
    """A text prompt is encoded on the tokenizer thread, by its own tokenizer copy, to the ids
    the engine's tokenizer gives; a bad one is refused there with its field, nothing enqueued."""
    from tests.serving import tiny_chat_spec
    engine = Engine(tiny_chat_spec(tmp_path), EngineConfig(max_model_len=256))
    ae = AsyncEngine(engine)
    ae.start()
    threads = []
    encode = ae._tokenizer.encode

    def recorded(*a, **kw):
        threads.append(threading.current_thread().name)
        return encode(*a, **kw)

    ae._tokenizer.encode = recorded
    text = "The quick brown fox jumps over the lazy dog, twice."

    async def run():
        req, stream = await ae.add_request(text, PARAMS, "t0")
        chat, chat_stream = await ae.add_request({"prompt": text, "add_special_tokens": False}, PARAMS, "t1")
        outs = [[o async for o in s][-1] for s in (stream, chat_stream)]
        with pytest.raises(ValueError, match="prompt: contains a lone UTF-16 surrogate"):
            await ae.add_request("bad \ud800", PARAMS, "t2")
        return req, chat, outs

    try:
        req, chat, outs = asyncio.run(run())
    finally:
        ae.shutdown()
    assert ae._tokenizer is not engine.tokenizer and len(threads) == 2     # the bad one fails before encoding
    assert all(name.startswith("zooinfer-tokenize") for name in threads)
    assert req.prompt == text and req.prompt_token_ids == engine.tokenizer.encode(text)
    assert chat.prompt_token_ids == engine.tokenizer.encode(text, add_special_tokens=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [N_TOKENS, N_TOKENS]
    assert _all_free(engine) and "t2" not in ae._streams


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to count threads")
def test_engine_is_built_on_a_thread_that_takes_its_openmp_team_with_it():
    """runtime.serve builds and warms the engine on a short-lived thread (async_engine.on_short_lived_thread): the OpenMP team its
    ops start ends with it, so the engine thread's team is the only one (two teams on 2 cores
    made libgomp put its workers to sleep between regions: 0.4 idle cores, served decode 40%
    slower). The helper returns the value, re-raises the error, and leaves no worker behind."""
    import torch
    from runtime.async_engine import on_short_lived_thread
    before, threads = _os_threads(), torch.get_num_threads()
    seen = []

    def work():
        seen.append(threading.current_thread().name)
        torch.set_num_threads(2)
        a = torch.randn(256, 256)
        for _ in range(5):
            a = torch.tanh(a @ a / 256)         # parallel regions: the thread's team starts
        return float(a.sum())

    try:
        value = on_short_lived_thread(work)
        deadline = time.monotonic() + 5
        while _os_threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _os_threads() == before, "the loading thread's OpenMP workers outlived it"
    finally:
        torch.set_num_threads(threads)
    assert isinstance(value, float) and seen == ["zooinfer-load"]
    with pytest.raises(ValueError, match="bad spec"):
        on_short_lived_thread(lambda: (_ for _ in ()).throw(ValueError("bad spec")))
