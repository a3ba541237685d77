"""Hybrid KV cache groups against HF: sliding-window layers (Mistral: all sliding; Gemma 3:
5 sliding : 1 full, sandwich norms, local rope) with windows shorter than the prompts, and
state layers (Bamba: mamba2 around a full-attention layer; Qwen3-Next: gated DeltaNet, gated
full attention and MoE; GraniteMoeHybrid: mamba2 + attention without rope, MoE + shared MLP
and muP multipliers), whose states live in pool pages."""
from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, hf_greedy
from tests.test_parity import NEW, REGIMES, _check_regime, _prompts, tiny_reference

HYBRID_REGIMES = {**{k: v for k, v in REGIMES.items() if k != "preempt"},
                  "chunked": dict(max_num_batched_tokens=7)}     # chunks off block edges
# Pools just above one max_model_len request (window-limited groups hold ~4 blocks each).
PREEMPT_BLOCKS = {"mistral": 12, "gemma3": 40, "bamba": 24, "qwen3_next": 24, "granite": 24}


@pytest.fixture(scope="module", params=["mistral", "gemma3", "bamba", "qwen3_next", "granite"])
def tiny(request, tiny_hf):
    return (request.param, *tiny_reference(tiny_hf, request.param))


@pytest.mark.parametrize("regime", list(HYBRID_REGIMES) + ["preempt"])
def test_sliding_parity(tiny, regime):
    family, path, prompts, ref = tiny
    kwargs = HYBRID_REGIMES.get(regime) or dict(num_kv_blocks=PREEMPT_BLOCKS[family], max_model_len=160,
                                                max_num_batched_tokens=16)
    _check_regime(path, prompts, ref, regime, kwargs)


def test_window_matters(tiny_hf):
    """Guard against a vacuous pass: the same weights without the window generate differently."""
    from models import resolve_spec
    path, model = tiny_hf("mistral")
    prompts = _prompts(TINY_VOCAB)
    ref = hf_greedy(model, prompts, NEW)
    spec = resolve_spec(path)
    assert spec.layer_kinds == ["sliding_attention"] * 2 and spec.attention.sliding_window == 20
    model.config.sliding_window = None
    try:
        unwindowed = hf_greedy(model, prompts, NEW)
    finally:
        model.config.sliding_window = 20
    assert unwindowed != ref


def test_sliding_group_holds_at_most_the_window(tiny_hf):
    """While long generations run, every sliding group holds <= ceil((W-1)/B)+1 live blocks
    per decoding request, and freed window blocks go back to the pool."""
    path, _ = tiny_hf("gemma3")
    llm = LLM(path, max_num_batched_tokens=64)
    engine = llm.engine
    kv = engine.kv_manager
    window, bs = 20, 16
    cap = -(-(window - 1) // bs) + 1
    sliding = [m for m, g in zip(kv.managers, kv.config.groups) if type(g.spec).__name__ == "SlidingWindowSpec"]
    full = [m for m, g in zip(kv.managers, kv.config.groups) if type(g.spec).__name__ == "FullAttentionSpec"]
    assert len(sliding) == 5 and len(full) == 1 and kv.config.num_buffers == 1
    for i in range(4):
        engine.add_request(engine.make_request({"prompt_token_ids": list(range(3, 40 + 10 * i))},
                                               SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for req in engine.scheduler.running:
            if req.num_computed_tokens > req.num_prompt_tokens:      # its last step was a decode
                for m in sliding:
                    assert m.num_live_blocks(req.request_id) <= cap
                for m in full:
                    assert m.num_live_blocks(req.request_id) == -(-req.num_computed_tokens // bs)
                checked += 1
        # the runner's tables agree with the managers: dead slots point at the null block
        for req in engine.scheduler.running:
            row = engine.runner.batch.req_id_to_row.get(req.request_id)
            if row is None:
                continue
            for gid, m in enumerate(kv.managers):
                ids = [b.block_id for b in m.req_to_blocks[req.request_id]]
                table = engine.runner.batch.block_table[gid]
                assert table.np[row, :len(ids)].tolist() == ids
    assert checked > 100
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
