"""AsyncEngine: the engine thread behind the server (in-process, no sockets)."""
from __future__ import annotations

import asyncio
import time

import pytest
from starlette.testclient import TestClient

from runtime.async_engine import AsyncEngine, EngineDeadError
from runtime.engine import Engine
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.serve import build_app

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def engine(tiny_hf):
    return Engine(tiny_hf("llama")[0], EngineConfig(max_model_len=128))


def _wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_streams_and_aborts_on_close(engine):
    ae = AsyncEngine(engine)
    ae.start()

    async def run():
        req, stream = await ae.add_request({"prompt_token_ids": [1, 2, 3]}, PARAMS, "a")
        assert req.prompt_token_ids == [1, 2, 3]
        outs = [out async for out in stream]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40
        lens = [len(o.outputs[0].token_ids) for o in outs]   # one per step; a lagging reader gets the latest
        assert lens == sorted(set(lens)) and lens[-1] == 40
        _, stream = await ae.add_request({"prompt_token_ids": [4, 5]}, PARAMS, "b")
        async for out in stream:
            break                                   # the client goes away after one token
        await stream.aclose()
        with pytest.raises(ValueError, match="prompt is empty"):
            await ae.add_request({"prompt_token_ids": []}, PARAMS, "c")

    asyncio.run(run())
    _wait_idle(engine)
    stats = engine.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and not engine.scheduler.requests
    ae.shutdown()
    assert not ae.healthy


def test_engine_death_fails_fast_and_marks_unhealthy(engine):
    def broken_step():
        raise RuntimeError("kernel exploded")

    engine.step = broken_step
    ae = AsyncEngine(engine)
    ae.start()
    app = build_app(ae, "m")
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        health = http.get("/health")
        assert health.status_code == 503 and "kernel exploded" in health.json()["error"]
        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503     # refused at once, not hung

    async def late():
        with pytest.raises(EngineDeadError):
            await ae.add_request({"prompt_token_ids": [1]}, PARAMS, "z")

    asyncio.run(late())
