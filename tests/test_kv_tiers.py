"""KV tiers below the pool (cache/tiers/): greedy outputs never change, hits and swaps are
exact, tier files survive a restart, and a bad or foreign entry is a miss, never a wrong answer."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.kv_tiers import attach_tiers
from runtime.metrics import ServerMetrics
from tests.serving import free_port
from tests.zoo_parity import assert_all_free, tight_pool_blocks

torch.set_num_threads(1)

NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)


def _ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chat(llm: LLM, num_convs: int = 4, turns: int = 3, system: int = 40) -> list[list[int]]:
    """A multi-turn chat workload: every conversation starts with one shared system prompt,
    and each turn's prompt is the conversation so far (its earlier prompts and answers)
    plus a new user message; all conversations take their turn together. Then the first
    turn's prompts come back (a second user asking the same), long after the pool let
    them go. Returns every answer, in order."""
    sys_prompt = _ids(system, 1)
    history = [sys_prompt + _ids(9 + 5 * c, 10 + c) for c in range(num_convs)]
    first, answers = [list(h) for h in history], []
    for t in range(turns):
        outs = llm.generate([{"prompt_token_ids": h} for h in history], GREEDY, use_tqdm=False)
        for c, o in enumerate(outs):
            answers.append(o.outputs[0].token_ids)
            history[c] = history[c] + o.outputs[0].token_ids + _ids(7, 100 * t + c)
    outs = llm.generate([{"prompt_token_ids": p} for p in first], GREEDY, use_tqdm=False)
    return answers + [o.outputs[0].token_ids for o in outs]


TIGHT = dict(max_model_len=160, max_num_batched_tokens=32, max_num_seqs=4)


def assert_tiers_exercised(llm, preempted: bool = True) -> dict:
    """The tight-pool chat really went through the tiers: pages were evicted, written back and
    hit in the host tier, swaps balance (each swapped-out request came back or fell back to
    recompute), and every block and swap reservation was given back. `preempted`: the pool
    also forced preemption and at least one swap-in. Returns the stats for further checks."""
    st = llm.kv_cache_stats()
    t = st["kv_tiers"]
    assert st["evictions"] > 0, "the pool was meant to force eviction"
    if preempted:
        assert st["num_preemptions"] > 0 and t["swapped_in"] > 0, "the pool was meant to force preemption by swap"
    assert t["written_back_blocks"] > 0 and t["tier_hit_tokens"] > 0 and t["tiers"]["host"]["hits"] > 0
    assert t["swapped_in"] + t["swap_fallbacks"] == t["swapped_out"]
    assert_all_free(llm)
    assert llm.engine.tiers.host.reserved == 0     # swap space all given back
    return st


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mistral", "bamba", "granite", "qwen3_next"])
def test_greedy_equal_with_tiers_on_and_off(tiny_hf, tmp_path, family):
    """Gemma 3 and Mistral have sliding windows (20 tokens), Bamba and Granite-4.0-H Mamba2,
    Qwen3-Next Gated DeltaNet state layers: every kind's entries go through the tiers."""
    path, _ = tiny_hf(family)
    blocks = tight_pool_blocks(path, TIGHT["max_model_len"], TIGHT["max_num_batched_tokens"])
    want = chat(LLM(path, **TIGHT, num_kv_blocks=400))            # tiers off (and a roomy pool)
    on = LLM(path, **TIGHT, num_kv_blocks=blocks, kv_host_tier_bytes=1 << 24, kv_disk_tier_dir=str(tmp_path),
             preemption_mode="auto", swap_min_tokens=24)
    assert chat(on) == want
    st = assert_tiers_exercised(on)
    t = st["kv_tiers"]
    metrics = ServerMetrics("m")
    metrics.update_engine_state(st)
    text = metrics.render().decode()
    assert f'zooinfer_kv_tier_hits{{model_name="m",tier="host"}} {float(t["tiers"]["host"]["hits"])}' in text
    assert f'zooinfer_kv_tier_hit_tokens{{model_name="m"}} {float(t["tier_hit_tokens"])}' in text


@pytest.mark.parametrize("kwargs,field", [
    ({"kv_host_tier_bytes": -1}, "kv_host_tier_bytes"), ({"kv_disk_tier_dir": 3}, "kv_disk_tier_dir"),
    ({"preemption_mode": "sometimes"}, "preemption_mode"), ({"swap_min_tokens": 0}, "swap_min_tokens"),
    ({"preemption_mode": "swap"}, "kv_host_tier_bytes"), ({"kv_remote_tier_url": "http://x"}, "kv_remote_tier_url"),
    ({"kv_host_tier_bytes": 1 << 20, "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_tier_write_through": "yes"}, "kv_tier_write_through")])
def test_bad_tier_settings_fail_in_one_line_naming_the_field(kwargs, field):
    """Checked before the tiers touch the engine (hence engine=None here)."""
    with pytest.raises(ValueError, match=field) as e:
        attach_tiers(None, EngineConfig(**kwargs), None)
    assert "\n" not in str(e.value)


def test_unreachable_redis_fails_at_start_in_one_line():
    with pytest.raises(ValueError, match="kv_remote_tier_url") as e:
        attach_tiers(None, EngineConfig(kv_remote_tier_url=f"redis://127.0.0.1:{free_port()}/0"), None)
    assert "cannot reach it" in str(e.value) and "\n" not in str(e.value)


def test_a_request_waiting_for_its_kv_does_not_stall_the_others(tiny_hf):
    """While a prompt's prefix loads from a (here: held back) tier, it waits off the queue
    and a running request keeps decoding; once the load lands, the prompt gets its tier
    hit and the same answer as the first time."""
    import threading
    path, _ = tiny_hf("llama")
    llm = LLM(path, max_model_len=160, num_kv_blocks=40, kv_host_tier_bytes=1 << 24)
    engine, host = llm.engine, llm.engine.tiers.host
    a = _ids(60, 5)
    first = llm.generate([{"prompt_token_ids": a}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate([{"prompt_token_ids": _ids(120, 50 + i)} for i in range(5)], GREEDY, use_tqdm=False)
    assert engine.tiers.counters["written_back_blocks"] >= 3      # a's blocks left the pool for the tier
    gate, load = threading.Event(), host._load
    host._load = lambda key: gate.wait(30) and load(key)
    b = engine.make_request({"prompt_token_ids": _ids(20, 6)}, SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True))
    engine.add_request(b)
    engine.step()
    again = engine.make_request({"prompt_token_ids": a}, GREEDY)
    engine.add_request(again)
    done = {}
    for _ in range(6):
        for out in engine.step():
            done[out.request_id] = out
    assert engine.kv_cache_stats()["kv_tiers"]["num_waiting_for_kv"] == 1
    assert len(b.output_token_ids) >= 6 and again.request_id not in done
    gate.set()
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert done[again.request_id].outputs[0].token_ids == first
    assert done[again.request_id].num_cached_tokens == 48         # 3 full blocks, one token left to compute
    assert engine.kv_cache_stats()["kv_tiers"]["tier_hit_tokens"] == 48


# kimi-linear-small once stalled here: a state hybrid's tier hit that did not fit an idle
# engine's pool was given back and retried only in a later step: the idle engine stopped first.
ZOO_KINDS = ["deepseek-v3-small", "kimi-linear-small", "minimax-small", "lfm2-small", "falcon-h1-small",
             "nemotron-h-small", "gpt-oss-small", "smollm3-small", "olmo-hybrid-small", "qwen3.5-small"]


@pytest.mark.parametrize("name", ZOO_KINDS)
def test_every_other_kind_equal_with_tiers_on_and_off(tmp_path, name):
    """The zoo's other kinds through the tiers, on their small specs (seeded weights): MLA's
    latent rows, KDA, lightning and short_conv states, parallel and mixer-less layers, sinks,
    NoPE, Qwen3.5's DeltaNet; the same answers with eviction forced and tier hits served
    (preemption and swaps, which this pool forces only for some of them, are the test above's)."""
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "zoo" / f"{name}.yaml"
    blocks = tight_pool_blocks(path, TIGHT["max_model_len"], TIGHT["max_num_batched_tokens"])
    want = chat(LLM(path, **TIGHT, num_kv_blocks=400))
    on = LLM(path, **TIGHT, num_kv_blocks=blocks, kv_host_tier_bytes=1 << 24, kv_disk_tier_dir=str(tmp_path),
             preemption_mode="auto", swap_min_tokens=24)
    assert chat(on) == want
    st = on.kv_cache_stats()
    t = st["kv_tiers"]
    assert st["evictions"] > 0, "the pool was meant to force eviction"
    assert t["written_back_blocks"] > 0 and t["tier_hit_tokens"] > 0
    assert t["swapped_in"] + t["swap_fallbacks"] == t["swapped_out"]
    assert_all_free(on)
